// Internal interface between the SpMM dispatcher (spmm.cc) and its per-ISA kernels.
//
// The dispatcher turns x into float32 (a converted copy for bf16/f16, the caller's buffer for f32)
// and, for the panel kernels, packs it transposed; each kernel then computes all M rows of y for a
// range of output columns [n0, n1) straight from the stored values/meta. See docs/KERNELS.md.
#ifndef TF_SPARSE24_CC_SPARSE24_SPMM_KERNELS_H_
#define TF_SPARSE24_CC_SPARSE24_SPMM_KERNELS_H_

#include <cstdint>

#include "cc/sparse24/dtype.h"
#include "cc/sparse24/half.h"

namespace sparse24 {
namespace spmm_internal {

// Rows of x per panel of the panel kernels, 6 SIMD registers per panel row: 48 for AVX2 (8 float32
// lanes), 96 for the AVX-512 float32 and bfloat16 pair kernels (16 lanes; 48 rows left them
// registers to spare). At 96 rows each value broadcast and meta lookup serves twice the rows
// (Zen 5, single thread: float32 2048x2048x512 16.5 -> 15.5 ms, 256x4096x4096 31.7 -> 28.7;
// bfloat16 11.4 -> 10.1, 20.2 -> 18.6). Each pack lays a panel out as K-major rows of `width`
// words (the panel's rows rounded up to whole registers, rows past M zero).
constexpr int64_t kPanelRowsAvx2 = 48;
constexpr int64_t kPanelRowsAvx512 = 96;

struct SpmmWork {
  DType dtype;              // of values and y
  int64_t M, K, N;
  const void* values;       // [N, K/2]
  const uint8_t* meta;      // [N, ceil(K/8)]
  const float* x;           // [M, K] float32, row stride ldx (gemv and scalar kernels)
  int64_t ldx;
  const float* xt;          // packed x^T panels (panel kernels), else null
  void* y;                  // [M, N], row stride ldy
  int64_t ldy;
};

// Computes y[0:M, n0:n1]. Thread-safe for disjoint column ranges.
using SpmmKernel = void (*)(const SpmmWork& work, int64_t n0, int64_t n1);

// Packs one panel, `rows` (at most the kernel's panel rows) rows of x with row stride ldx elements
// of `dtype`, transposed into xt [K][width] float32, width = rows rounded up to the ISA's registers
// (rows past `rows` zero, xt 32-byte aligned), and sets bad[r] = row r holds NaN/Inf. One per
// panel ISA, beside its kernel, which reads the panel at the same width.
using PanelPack = void (*)(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K,
                           float* xt, uint8_t* bad);

void spmm_rows_scalar(const SpmmWork& work, int64_t n0, int64_t n1);
void spmm_gemv_avx2(const SpmmWork& work, int64_t n0, int64_t n1);
void spmm_panel_avx2(const SpmmWork& work, int64_t n0, int64_t n1);
void pack_panel_avx2(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K, float* xt,
                     uint8_t* bad);
void spmm_gemv_avx512(const SpmmWork& work, int64_t n0, int64_t n1);
void spmm_panel_avx512(const SpmmWork& work, int64_t n0, int64_t n1);
void pack_panel_avx512(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K, float* xt,
                       uint8_t* bad);
// bfloat16 only (AVX512_BF16): x packed as pairs of the elements a group can keep, not as x^T.
void spmm_pairs_avx512bf16(const SpmmWork& work, int64_t n0, int64_t n1);
void pack_pairs_avx512bf16(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K,
                           float* xt, uint8_t* bad);

// Words (4 bytes, a float's size) per row of x in the pair panels: 6 bf16 pairs per group of 4 k
// (the x^T panels hold K).
constexpr int64_t pair_panel_words(int64_t K) { return K / 4 * 6; }

inline float load_f32(DType dtype, const void* p, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

inline void store_f32(DType dtype, void* p, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = v;
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
      return;
  }
}

}  // namespace spmm_internal
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_SPMM_KERNELS_H_
