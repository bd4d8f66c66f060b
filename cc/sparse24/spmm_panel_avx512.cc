// AVX-512 (F/BW/VL/DQ) instantiation of the panel SpMM kernel: 16 float32 lanes, a 96-row panel
// is six zmm registers. Compiled everywhere, run only where CPUID reports AVX-512 (not on the
// machine this was developed on; see docs/KERNELS.md).
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on their own _mm512_undefined_*.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "cc/sparse24/spmm_panel_impl.h"

namespace sparse24 {
namespace spmm_internal {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int64_t kLanes = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static void widen(DType dtype, const void* src, int64_t i, float* dst) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i));
    const reg f = dtype == DType::kBFloat16
                      ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                      : _mm512_cvtph_ps(h);
    _mm512_storeu_ps(dst, f);
  }
};

}  // namespace

void spmm_panel_avx512(const SpmmWork& work, int64_t n0, int64_t n1) {
  panel::run_panels<Avx512, kPanelRowsAvx512>(work, n0, n1);
}

void pack_panel_avx512(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K, float* xt,
                       uint8_t* bad) {
  panel::pack_panel<Avx512>(dtype, x, ldx, rows, K, xt, bad);
}

}  // namespace spmm_internal
}  // namespace sparse24
