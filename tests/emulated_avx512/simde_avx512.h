// Test-only: lets the AVX-512 kernels (cc/sparse24/*_avx512.cc) run on a CPU without AVX-512.
//
// tests/cc_build.py force-includes this header (-include) when it compiles those files with the
// AVX2 flags instead of the AVX-512 ones: SIMDe (Debian's libsimde-dev) then supplies every
// _mm512_* intrinsic, built from AVX2 operations, under its native name, while the kernels' AVX2
// code stays native. SIMDe 0.7 lacks three intrinsics the kernels use; they are written out below
// from the same AVX2/F16C conversions the AVX2 kernels use, lane by lane, and so are two more the
// AVX512_BF16 kernel's pack uses (a masked 64-bit gather, a 16-bit compare into a mask).
#ifndef TF_SPARSE24_TESTS_EMULATED_AVX512_SIMDE_AVX512_H_
#define TF_SPARSE24_TESTS_EMULATED_AVX512_SIMDE_AVX512_H_

#include <immintrin.h>  // first, so the native AVX2 names are not aliased

#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

// 16 uint16 -> 16 int32 (zero-extended).
static inline simde__m512i emulated_mm512_cvtepu16_epi32(__m256i a) {
  alignas(32) uint16_t in[16];
  alignas(64) int32_t out[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(in), a);
  for (int i = 0; i < 16; ++i) out[i] = in[i];
  return simde_mm512_loadu_si512(out);
}

// 16 float16 -> 16 float32, eight at a time with F16C.
static inline simde__m512 emulated_mm512_cvtph_ps(__m256i a) {
  alignas(64) float out[16];
  _mm256_store_ps(out, _mm256_cvtph_ps(_mm256_castsi256_si128(a)));
  _mm256_store_ps(out + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
  return simde_mm512_loadu_ps(out);
}

// Sum of the 16 lanes (in lane order; the hardware's order differs, within float rounding).
static inline float emulated_mm512_reduce_add_ps(simde__m512 v) {
  alignas(64) float lanes[16];
  simde_mm512_storeu_ps(lanes, v);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
}

// Lanes i with bit i of k set: the 64 bits at base + index[i] * scale; the others from src.
static inline simde__m512i emulated_mm512_mask_i64gather_epi64(simde__m512i src, simde__mmask8 k,
                                                               simde__m512i index,
                                                               const void* base, int scale) {
  alignas(64) int64_t lanes[8], offsets[8];
  simde_mm512_storeu_si512(lanes, src);
  simde_mm512_storeu_si512(offsets, index);
  for (int i = 0; i < 8; ++i) {
    if (k >> i & 1) {
      std::memcpy(&lanes[i], static_cast<const char*>(base) + offsets[i] * scale, 8);
    }
  }
  return simde_mm512_loadu_si512(lanes);
}

// Bit i: 16-bit lane i of a equals that of b.
static inline simde__mmask32 emulated_mm512_cmpeq_epi16_mask(simde__m512i a, simde__m512i b) {
  alignas(64) uint16_t x[32], y[32];
  simde_mm512_storeu_si512(x, a);
  simde_mm512_storeu_si512(y, b);
  simde__mmask32 mask = 0;
  for (int i = 0; i < 32; ++i) mask |= static_cast<simde__mmask32>(x[i] == y[i]) << i;
  return mask;
}

#define _mm512_cvtepu16_epi32 emulated_mm512_cvtepu16_epi32
#define _mm512_cvtph_ps emulated_mm512_cvtph_ps
#define _mm512_reduce_add_ps emulated_mm512_reduce_add_ps
#define _mm512_mask_i64gather_epi64 emulated_mm512_mask_i64gather_epi64
#define _mm512_cmpeq_epi16_mask emulated_mm512_cmpeq_epi16_mask

#endif  // TF_SPARSE24_TESTS_EMULATED_AVX512_SIMDE_AVX512_H_
