// AVX2 + FMA instantiation of the panel SpMM kernel (8 float32 lanes; F16C for float16 values).
#include <immintrin.h>

#include "cc/sparse24/spmm_panel_impl.h"

namespace sparse24 {
namespace spmm_internal {
namespace {

struct Avx2 {
  using reg = __m256;
  static constexpr int64_t kLanes = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static void widen(DType dtype, const void* src, int64_t i, float* dst) {
    const auto* p = static_cast<const uint16_t*>(src) + i;
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const reg f = dtype == DType::kBFloat16
                      ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                      : _mm256_cvtph_ps(h);
    _mm256_storeu_ps(dst, f);
  }
};

}  // namespace

void spmm_panel_avx2(const SpmmWork& work, int64_t n0, int64_t n1) {
  panel::run_panels<Avx2, kPanelRowsAvx2>(work, n0, n1);
}

void pack_panel_avx2(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K, float* xt,
                     uint8_t* bad) {
  panel::pack_panel<Avx2>(dtype, x, ldx, rows, K, xt, bad);
}

}  // namespace spmm_internal
}  // namespace sparse24
