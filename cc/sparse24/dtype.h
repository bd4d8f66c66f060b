// Element types the core handles, and float conversions for the 16-bit ones (framework-free).
#ifndef TF_SPARSE24_CC_SPARSE24_DTYPE_H_
#define TF_SPARSE24_CC_SPARSE24_DTYPE_H_

#include <cstdint>
#include <cstring>

namespace sparse24 {

enum class DType { kFloat32, kBFloat16, kFloat16 };

inline int64_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, NaN kept quiet (same rounding TensorFlow's bfloat16 cast uses).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_DTYPE_H_
