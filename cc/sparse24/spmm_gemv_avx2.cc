// AVX2 GEMV-like SpMM kernel for a few rows of x (M <= 4): memory-bound, so it streams the values
// and meta once, in storage order, and gathers x in registers.
//
// Per column and 16 k (4 groups, 8 kept values, 2 meta bytes): the 16-bit meta is broadcast and
// shifted per lane into vpermilps controls (vpermilps reads only the low 2 bits, so no mask), x's
// two 8-float halves [g0|g1] and [g2|g3] are permuted within their 128-bit lanes and blended into
// [g0 g0 g2 g2 g1 g1 g3 g3] order, and the 8 values are put in the same order with one vpermpd
// (shared by all rows). Then one FMA per row.
#include <immintrin.h>

#include <algorithm>

#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace spmm_internal {
namespace {

constexpr int kMaxRows = 4;

inline __m256 load8_values(DType dtype, const void* values, int64_t i) {
  if (dtype == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(values) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + i));
  if (dtype == DType::kBFloat16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_cvtph_ps(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int ROWS>
void columns(const SpmmWork& w, int64_t n0, int64_t n1) {
  const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8;
  const int64_t chunks = w.K / 16, groups = w.K / 4;
  const __m256i shifts = _mm256_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t v0 = n * half_k;
    const uint8_t* meta = w.meta + n * meta_row;
    __m256 acc[2][ROWS];
    for (int r = 0; r < ROWS; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 v = _mm256_castpd_ps(_mm256_permute4x64_pd(
          _mm256_castps_pd(load8_values(w.dtype, w.values, v0 + 8 * c)), 0xD8));
      const uint32_t bits = meta[2 * c] | (static_cast<uint32_t>(meta[2 * c + 1]) << 8);
      const __m256i ctrl = _mm256_srlv_epi32(_mm256_set1_epi32(bits), shifts);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const float* x = w.x + r * w.ldx + 16 * c;
        const __m256 lo = _mm256_permutevar_ps(_mm256_loadu_ps(x), ctrl);
        const __m256 hi = _mm256_permutevar_ps(_mm256_loadu_ps(x + 8), ctrl);
        acc[c & 1][r] = _mm256_fmadd_ps(v, _mm256_blend_ps(lo, hi, 0xCC), acc[c & 1][r]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const float* x = w.x + r * w.ldx;
      float sum = hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
      for (int64_t g = 4 * chunks; g < groups; ++g) {  // up to 3 trailing groups
        const unsigned b = meta[g >> 1] >> ((g & 1) * 4);
        sum += load_f32(w.dtype, w.values, v0 + 2 * g) * x[4 * g + (b & 3u)];
        sum += load_f32(w.dtype, w.values, v0 + 2 * g + 1) * x[4 * g + ((b >> 2) & 3u)];
      }
      store_f32(w.dtype, w.y, r * w.ldy + n, sum);
    }
  }
}

}  // namespace

void spmm_gemv_avx2(const SpmmWork& w, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < w.M; m0 += kMaxRows) {  // the dispatcher sends M <= kMaxRows
    SpmmWork rows = w;
    rows.x = w.x + m0 * w.ldx;
    rows.y = static_cast<char*>(w.y) + m0 * w.ldy * dtype_size(w.dtype);
    rows.M = std::min<int64_t>(kMaxRows, w.M - m0);
    switch (rows.M) {
      case 1: columns<1>(rows, n0, n1); break;
      case 2: columns<2>(rows, n0, n1); break;
      case 3: columns<3>(rows, n0, n1); break;
      default: columns<4>(rows, n0, n1); break;
    }
  }
}

}  // namespace spmm_internal
}  // namespace sparse24
