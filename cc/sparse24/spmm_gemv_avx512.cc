// AVX-512 GEMV-like SpMM kernel for a few rows of x (M <= 4). Per column and 32 k (8 groups, 16
// kept values, 4 meta bytes): lane i's index into the 32 x floats is 4 * (i / 2) plus its 2-bit
// meta field, and one vpermt2ps gathers the kept x from two zmm registers; one FMA per row.
// Compiled everywhere, run only where CPUID reports AVX-512 (see docs/KERNELS.md).
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on their own _mm512_undefined_*.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace spmm_internal {
namespace {

constexpr int kMaxRows = 4;
constexpr int64_t kPrefetchBytes = 8192;  // as in spmm_gemv_avx2.cc

inline __m512 load16_values(DType dtype, const void* values, int64_t i) {
  if (dtype == DType::kFloat32) return _mm512_loadu_ps(static_cast<const float*>(values) + i);
  const auto* src = static_cast<const uint16_t*>(values) + i;
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  if (dtype == DType::kBFloat16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_cvtph_ps(h);
}

template <int ROWS>
void columns(const SpmmWork& w, int64_t n0, int64_t n1) {
  const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8;
  const int64_t chunks = w.K / 32, groups = w.K / 4;
  const __m512i shifts =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base =
      _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i three = _mm512_set1_epi32(3);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t v0 = n * half_k;
    const uint8_t* meta = w.meta + n * meta_row;
    __m512 acc0[ROWS], acc1[ROWS];  // two sets, so each FMA chain waits on every other chunk
    for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    auto step = [&](int64_t c, __m512(&acc)[ROWS]) {
      __builtin_prefetch(static_cast<const char*>(w.values) +
                         (v0 + 16 * c) * dtype_size(w.dtype) + kPrefetchBytes);
      const __m512 v = load16_values(w.dtype, w.values, v0 + 16 * c);
      uint32_t bits;
      std::memcpy(&bits, meta + 4 * c, sizeof(bits));  // little endian: byte b -> bits 8b..8b+7
      const __m512i idx = _mm512_add_epi32(
          base, _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(bits), shifts), three));
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const float* x = w.x + r * w.ldx + 32 * c;
        const __m512 g = _mm512_permutex2var_ps(_mm512_loadu_ps(x), idx, _mm512_loadu_ps(x + 16));
        acc[r] = _mm512_fmadd_ps(v, g, acc[r]);
      }
    };
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      step(c, acc0);
      step(c + 1, acc1);
    }
    if (c < chunks) step(c, acc0);
    for (int r = 0; r < ROWS; ++r) {
      const float* x = w.x + r * w.ldx;
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
      for (int64_t g = 8 * chunks; g < groups; ++g) {  // up to 7 trailing groups
        const unsigned b = meta[g >> 1] >> ((g & 1) * 4);
        sum += load_f32(w.dtype, w.values, v0 + 2 * g) * x[4 * g + (b & 3u)];
        sum += load_f32(w.dtype, w.values, v0 + 2 * g + 1) * x[4 * g + ((b >> 2) & 3u)];
      }
      store_f32(w.dtype, w.y, r * w.ldy + n, sum);
    }
  }
}

}  // namespace

void spmm_gemv_avx512(const SpmmWork& w, int64_t n0, int64_t n1) {
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
