// Elements of the cudaDataType a stand-in library is handed (CUDA_R_32F, _16F, _16BF) as float,
// for fake_cusparselt.cc and fake_cublas.cc.
#ifndef TF_SPARSE24_TESTS_CUDA_ELEMENTS_H_
#define TF_SPARSE24_TESTS_CUDA_ELEMENTS_H_

#include <cstdint>

#include "cc/sparse24/dtype.h"
#include "cc/sparse24/half.h"

namespace cuda_on_cpu {

constexpr int kR32F = 0, kR16F = 2, kR16BF = 14;  // library_types.h

inline bool known_type(int type) { return type == kR32F || type == kR16F || type == kR16BF; }

inline float load_element(int type, const void* data, int64_t i) {
  if (type == kR32F) return static_cast<const float*>(data)[i];
  const uint16_t h = static_cast<const uint16_t*>(data)[i];
  return type == kR16BF ? sparse24::bf16_to_f32(h) : sparse24::f16_to_f32(h);
}

inline void store_element(int type, void* data, int64_t i, float v) {
  if (type == kR32F) {
    static_cast<float*>(data)[i] = v;
  } else {
    static_cast<uint16_t*>(data)[i] =
        type == kR16BF ? sparse24::f32_to_bf16(v) : sparse24::f32_to_f16(v);
  }
}

}  // namespace cuda_on_cpu

#endif  // TF_SPARSE24_TESTS_CUDA_ELEMENTS_H_
