// AVX2 GEMV-like SpMM kernel for a few rows of x (M <= 4): memory-bound, so it streams the values
// and meta once, in storage order, and gathers x in registers.
//
// x is first copied with each 16-float chunk's groups reordered [g0 g2 | g1 g3] (x is the
// activation; a few KiB). Per column and chunk (4 groups, 8 kept values, 2 meta bytes): the
// 16-bit meta is broadcast and shifted per lane into vpermilps controls (vpermilps reads only the
// low 2 bits, so no mask); vpermilps picks g0's kept pair into lanes 0-1 and g2's into 4-5 of the
// first half, g1's into 2-3 and g3's into 6-7 of the second; one blend gives the kept x in the
// values' own order. Then one FMA per row.
#include <immintrin.h>

#include <algorithm>
#include <memory>

#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace spmm_internal {
namespace {

constexpr int kMaxRows = 4;
// Values are read in one sequential stream; prefetching 8 KiB ahead keeps more lines in flight than
// the hardware prefetcher does on a loaded memory bus (+30% at 1x4096x4096, bench/spmm_core_bench).
constexpr int64_t kPrefetchBytes = 8192;

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
void columns(const SpmmWork& w, const float* xs, int64_t n0, int64_t n1) {
  const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8;
  const int64_t chunks = w.K / 16, groups = w.K / 4, lds = 16 * chunks;
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t v0 = n * half_k;
    const uint8_t* meta = w.meta + n * meta_row;
    __m256 acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    auto step = [&](int64_t c, __m256(&acc)[ROWS]) {
      const __m256 v = load8_values(w.dtype, w.values, v0 + 8 * c);
      const uint32_t bits = meta[2 * c] | (static_cast<uint32_t>(meta[2 * c + 1]) << 8);
      const __m256i ctrl = _mm256_srlv_epi32(_mm256_set1_epi32(bits), shifts);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const float* x = xs + r * lds + 16 * c;
        const __m256 lo = _mm256_permutevar_ps(_mm256_loadu_ps(x), ctrl);
        const __m256 hi = _mm256_permutevar_ps(_mm256_loadu_ps(x + 8), ctrl);
        acc[r] = _mm256_fmadd_ps(v, _mm256_blend_ps(lo, hi, 0xCC), acc[r]);
      }
    };
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      __builtin_prefetch(static_cast<const char*>(w.values) +
                         (v0 + 8 * c) * dtype_size(w.dtype) + kPrefetchBytes);
      step(c, acc0);
      step(c + 1, acc1);
    }
    if (c < chunks) step(c, acc0);
    for (int r = 0; r < ROWS; ++r) {
      const float* x = w.x + r * w.ldx;
      float sum = hsum(_mm256_add_ps(acc0[r], acc1[r]));
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
  const int64_t lds = w.K / 16 * 16;
  std::unique_ptr<float[]> xs(new float[kMaxRows * lds + 1]);
  for (int64_t m0 = 0; m0 < w.M; m0 += kMaxRows) {  // the dispatcher sends M <= kMaxRows
    SpmmWork rows = w;
    rows.x = w.x + m0 * w.ldx;
    rows.y = static_cast<char*>(w.y) + m0 * w.ldy * dtype_size(w.dtype);
    rows.M = std::min<int64_t>(kMaxRows, w.M - m0);
    for (int64_t r = 0; r < rows.M; ++r) {  // chunk [g0 g1 g2 g3] -> [g0 g2 g1 g3]
      for (int64_t c = 0; c < lds; c += 16) {
        const float* src = rows.x + r * w.ldx + c;
        float* dst = xs.get() + r * lds + c;
        _mm_storeu_ps(dst, _mm_loadu_ps(src));
        _mm_storeu_ps(dst + 4, _mm_loadu_ps(src + 8));
        _mm_storeu_ps(dst + 8, _mm_loadu_ps(src + 4));
        _mm_storeu_ps(dst + 12, _mm_loadu_ps(src + 12));
      }
    }
    switch (rows.M) {
      case 1: columns<1>(rows, xs.get(), n0, n1); break;
      case 2: columns<2>(rows, xs.get(), n0, n1); break;
      case 3: columns<3>(rows, xs.get(), n0, n1); break;
      default: columns<4>(rows, xs.get(), n0, n1); break;
    }
  }
}

}  // namespace spmm_internal
}  // namespace sparse24
