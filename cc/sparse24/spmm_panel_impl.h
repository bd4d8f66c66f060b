// The panel SpMM microkernel, written once over a SIMD traits type and instantiated per ISA
// (spmm_panel_avx2.cc, spmm_panel_avx512.cc), and the x^T pack it reads. Include only from those
// files.
//
// x^T is packed in panels of 48 (AVX2) or 96 (AVX-512) rows: [K][width] floats, so the rows of one
// panel for one k are `width` consecutive floats. For each output column n and each kept element
// (k, value) of column n, the kernel broadcasts the value and FMAs it with the panel row at k
// (address from the 2-bit meta): loads and FMAs only, no shuffles, on the useful half of the
// multiply-adds. K runs in blocks of k_block rows that stay in L1 while all the call's columns (at
// most kMaxCols) stream their values; the columns' partial sums live in a stack buffer between
// blocks. See docs/KERNELS.md.
#ifndef TF_SPARSE24_CC_SPARSE24_SPMM_PANEL_IMPL_H_
#define TF_SPARSE24_CC_SPARSE24_SPMM_PANEL_IMPL_H_

#include <immintrin.h>  // AVX2: both instantiating ISAs have it (the tile transposition)

#include <algorithm>
#include <cstdint>

#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace spmm_internal {
namespace panel {

constexpr int64_t kMaxCols = 256;     // columns a panel keeps partial sums of across K (the
                                      // schedule's widest column tile)
constexpr int64_t kPrefetchCols = 4;  // how far ahead a column's values are prefetched

// The plain functions here have internal linkage (static): each ISA's translation unit keeps its
// own copy, compiled with its own flags, so the linker can never hand the AVX2 path an AVX-512 one.

// In place: c[i] holds column i of an 8x8 block on entry, row i on exit.
static inline void transpose8x8(__m256 (&c)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(c[i], c[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(c[i], c[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    c[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Elements [k, k + kCount) of an x row of dtype D as float32 (kCount 8, or 4 with zeros above).
template <DType D, int kCount>
static inline __m256 load_x(const char* row, int64_t k) {
  if constexpr (D == DType::kFloat32) {
    const float* p = reinterpret_cast<const float*>(row) + k;
    return kCount == 8 ? _mm256_loadu_ps(p) : _mm256_zextps128_ps256(_mm_loadu_ps(p));
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + k);
    const __m128i h = kCount == 8 ? _mm_loadu_si128(p) : _mm_loadl_epi64(p);
    if constexpr (D == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Elements k0 .. k0 + kCount of 8 x rows (rows >= live read as zeros) to xt rows k0.. (stride
// width) at column dst, by one 8x8 register transpose; ORs each row's Inf/NaN lanes into nonfinite.
template <DType D, int kCount, bool kAllLive>
static inline void pack_block(const char* x, int64_t row_bytes, int live, int64_t k0, float* dst,
                              int64_t width, __m256 (&nonfinite)[8]) {
  const __m256 exponent = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  __m256 c[8];
  for (int i = 0; i < 8; ++i) {
    if (!kAllLive && i >= live) {
      c[i] = _mm256_setzero_ps();
      continue;
    }
    c[i] = load_x<D, kCount>(x + i * row_bytes, k0);
    nonfinite[i] = _mm256_or_ps(
        nonfinite[i], _mm256_cmp_ps(_mm256_and_ps(c[i], exponent), exponent, _CMP_EQ_OQ));
  }
  transpose8x8(c);  // c[j]: element k0 + j of the 8 rows
  for (int j = 0; j < kCount; ++j) _mm256_store_ps(dst + (k0 + j) * width, c[j]);
}

// Packs `rows` rows of x (row stride ldx elements) transposed into xt [K][width] float32, rows
// `rows..width` zero; bad[r] = row r holds NaN/Inf (a float32 Inf/NaN exactly when the bf16/f16
// element was one). Rows in blocks of 8, each streamed along K: the reads are 8 sequential streams
// the prefetchers follow (k-outer order, 48 streams, ran 1.5-2x slower). K % 4 == 0; width a
// multiple of 8.
template <DType D>
static void pack_panel_as(const void* x, int64_t ldx, int64_t rows, int64_t K, int64_t width,
                          float* xt, uint8_t* bad) {
  const int64_t row_bytes = ldx * dtype_size(D), full_k = K / 8 * 8;
  for (int64_t r0 = 0; r0 < width; r0 += 8) {
    const int live = static_cast<int>(std::clamp<int64_t>(rows - r0, 0, 8));
    const char* rows8 = static_cast<const char*>(x) + r0 * row_bytes;
    __m256 nonfinite[8];
    for (int i = 0; i < 8; ++i) nonfinite[i] = _mm256_setzero_ps();
    if (live == 8) {
      for (int64_t k0 = 0; k0 < full_k; k0 += 8) {
        pack_block<D, 8, true>(rows8, row_bytes, live, k0, xt + r0, width, nonfinite);
      }
    } else {
      for (int64_t k0 = 0; k0 < full_k; k0 += 8) {
        pack_block<D, 8, false>(rows8, row_bytes, live, k0, xt + r0, width, nonfinite);
      }
    }
    if (full_k < K) {
      pack_block<D, 4, false>(rows8, row_bytes, live, full_k, xt + r0, width, nonfinite);
    }
    for (int i = 0; i < live; ++i) bad[r0 + i] = _mm256_movemask_ps(nonfinite[i]) != 0;
  }
}

static void pack_transposed(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K,
                            int64_t width, float* xt, uint8_t* bad) {
  switch (dtype) {
    case DType::kFloat32:
      return pack_panel_as<DType::kFloat32>(x, ldx, rows, K, width, xt, bad);
    case DType::kBFloat16:
      return pack_panel_as<DType::kBFloat16>(x, ldx, rows, K, width, xt, bad);
    case DType::kFloat16:
      return pack_panel_as<DType::kFloat16>(x, ldx, rows, K, width, xt, bad);
  }
}

// 8 float32 to bfloat16 or float16 at dst, rounded to nearest even, NaN kept quiet: bit for bit
// what store_f32 writes (vcvtps2ph with imm 0 rounds as f32_to_f16 does). Element by element, this
// conversion took a quarter of an M = 2048, K = 512 bfloat16 call.
static inline void store8_16bit(DType dtype, uint16_t* dst, __m256 v) {
  __m128i h;
  if (dtype == DType::kFloat16) {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  } else {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i top = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    h = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
}

// y[m0 + r, t0 + c] = sums[c * width + r] for r < rows, t0 + c < t1: 8x8 blocks are transposed
// in registers (a scalar transposition cost a fifth of an M=32 call), the edges one by one.
static void store_tile(const SpmmWork& w, int64_t width, const float* sums, int64_t m0,
                       int64_t rows, int64_t t0, int64_t t1) {
  const int64_t full_rows = rows / 8 * 8;
  for (int64_t r0 = 0; r0 < full_rows; r0 += 8) {
    int64_t n = t0;
    for (; n + 8 <= t1; n += 8) {
      __m256 c[8];
      for (int i = 0; i < 8; ++i) c[i] = _mm256_load_ps(sums + (n - t0 + i) * width + r0);
      transpose8x8(c);
      for (int j = 0; j < 8; ++j) {
        const int64_t at = (m0 + r0 + j) * w.ldy + n;
        if (w.dtype == DType::kFloat32) {
          _mm256_storeu_ps(static_cast<float*>(w.y) + at, c[j]);
        } else {
          store8_16bit(w.dtype, static_cast<uint16_t*>(w.y) + at, c[j]);
        }
      }
    }
    for (; n < t1; ++n) {
      for (int64_t r = r0; r < r0 + 8; ++r) {
        store_f32(w.dtype, w.y, (m0 + r) * w.ldy + n, sums[(n - t0) * width + r]);
      }
    }
  }
  for (int64_t r = full_rows; r < rows; ++r) {
    for (int64_t n = t0; n < t1; ++n) {
      store_f32(w.dtype, w.y, (m0 + r) * w.ldy + n, sums[(n - t0) * width + r]);
    }
  }
}

// Rows of k per block, so a panel's block of x^T (k_block * width floats) stays near 16 KiB of L1
// beside the partial sums and the streaming values. Whole meta bytes: a multiple of 8.
constexpr int64_t k_block_for(int64_t width) { return 4096 / width / 8 * 8; }

// Accumulator sets for R registers per panel row: R * S >= 8 independent FMA chains.
constexpr int accumulator_sets(int R) { return (8 + R - 1) / R; }

// V: SIMD traits with `using reg`, `kLanes`, zero(), load(const float*), store(float*, reg),
// broadcast(const float*), fmadd(a, b, c) = a * b + c, add(a, b), and
// widen(DType, const void* src, int64_t i, float* dst): kLanes bf16/f16 values from src[i] to
// float32.
//
// R: SIMD registers per panel row (width = R * kLanes rows of x). S: accumulator sets, so R * S
// independent FMA chains hide the FMA latency.
template <class V, int R, int S = accumulator_sets(R)>
struct Microkernel {
  static constexpr int64_t kWidth = R * V::kLanes;

  // Row offset (in floats) of the kept element at 2-bit position `pos` of group `group` (0 or 1)
  // of a meta byte's 8 panel rows: shifts, masks and a multiply by a constant on the integer ports,
  // which have room, instead of a table load on the load ports, which the x loads and broadcasts
  // keep busy (core bench A/B in cache: 5-8% faster than a 4 KiB offset table).
  static inline int64_t row_offset(uint32_t pos, int group) {
    return static_cast<int64_t>(4 * group + pos) * kWidth;
  }

  // acc[s][r] += sum over the kept elements of groups [g0, g1) of one column, x block at xk
  // (xk points at the panel row of group g0's first k). vals: that column's values from group g0,
  // float32; meta: its meta from the byte holding group g0 (g0 even).
  static inline void run(const float* xk, const float* vals, const uint8_t* meta, int64_t groups,
                         typename V::reg (&acc)[S][R]) {
    const int64_t bytes = groups / 2;
    for (int64_t j = 0; j < bytes; ++j) {  // one meta byte: 2 groups, 4 kept elements
      const uint32_t b = meta[j];
      const int64_t off[4] = {row_offset(b & 3, 0), row_offset((b >> 2) & 3, 0),
                              row_offset((b >> 4) & 3, 1), row_offset(b >> 6, 1)};
      const float* x0 = xk + j * 8 * kWidth;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const typename V::reg v = V::broadcast(vals + 4 * j + i);
        const float* xr = x0 + off[i];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[i % S][r] = V::fmadd(v, V::load(xr + r * V::kLanes), acc[i % S][r]);
        }
      }
    }
    if (groups & 1) {  // a trailing odd group: low nibble of the next byte
      const uint32_t b = meta[bytes];
      const float* x0 = xk + bytes * 8 * kWidth;
      const float* x_lo = x0 + row_offset(b & 3, 0);
      const float* x_hi = x0 + row_offset((b >> 2) & 3, 0);
      const typename V::reg v0 = V::broadcast(vals + 4 * bytes);
      const typename V::reg v1 = V::broadcast(vals + 4 * bytes + 1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[0][r] = V::fmadd(v0, V::load(x_lo + r * V::kLanes), acc[0][r]);
        acc[1 % S][r] = V::fmadd(v1, V::load(x_hi + r * V::kLanes), acc[1 % S][r]);
      }
    }
  }

  // The values of one column's K block are a short run far from the previous column's (row
  // stride K/2), which the hardware prefetcher does not foresee: ask for it a few columns ahead.
  static inline void prefetch_column(const SpmmWork& w, int64_t v, int64_t groups, int64_t n,
                                     int64_t meta_row, int64_t kb) {
    const char* p = static_cast<const char*>(w.values) + v * dtype_size(w.dtype);
    const int64_t bytes = 2 * groups * dtype_size(w.dtype);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
    __builtin_prefetch(w.meta + n * meta_row + kb / 8);
  }

  // One panel (rows m0 .. m0 + rows) times columns [n0, n1) (at most kMaxCols), written to y.
  // Each K block of x^T, in L1, serves all the columns before the next block; the columns' partial
  // sums live in `sums` (L2) between blocks. spmm_panel_avx512bf16.cc's kernel walks K the same
  // way. (Until 2026-12-01 a block served tiles of 64 columns, K in super-blocks of ~160 KiB kept
  // in L2 while the tiles passed; one block for all columns is 2-17% faster on Zen 5, every ISA.)
  static void columns(const SpmmWork& w, const float* xt, int64_t m0, int64_t rows, int64_t n0,
                      int64_t n1) {
    const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8, k_block = k_block_for(kWidth);
    // On the stack (48 KiB at width 48): a per-thread heap buffer instead ran 5-7% slower at
    // M = 16-32 on Zen 5. Threads need a stack of ~128 KiB or more (at width 96 the sums alone take
    // 96 KiB; TF's and Python's threads have 8 MiB).
    alignas(64) float sums[kMaxCols * kWidth];
    alignas(64) float vbuf[1024];  // widened values of one column's K block (k_block <= 2048)
    for (int64_t kb = 0; kb < w.K; kb += k_block) {
      const int64_t groups = (std::min(w.K, kb + k_block) - kb) / 4;
      const float* xk = xt + kb * kWidth;
      for (int64_t n = n0; n < n1; ++n) {
        typename V::reg acc[S][R];
        float* sum = sums + (n - n0) * kWidth;
        for (int s = 0; s < S; ++s) {
          for (int r = 0; r < R; ++r) {
            acc[s][r] = (s == 0 && kb > 0) ? V::load(sum + r * V::kLanes) : V::zero();
          }
        }
        const int64_t v0 = n * half_k + kb / 2;
        if (n + kPrefetchCols < n1) prefetch_column(w, v0 + kPrefetchCols * half_k, groups,
                                                    n + kPrefetchCols, meta_row, kb);
        const float* vals;
        if (w.dtype == DType::kFloat32) {
          vals = static_cast<const float*>(w.values) + v0;
        } else {
          const int64_t count = 2 * groups;
          int64_t i = 0;
          for (; i + V::kLanes <= count; i += V::kLanes) {
            V::widen(w.dtype, w.values, v0 + i, vbuf + i);
          }
          for (; i < count; ++i) vbuf[i] = load_f32(w.dtype, w.values, v0 + i);
          vals = vbuf;
        }
        run(xk, vals, w.meta + n * meta_row + kb / 8, groups, acc);
        for (int r = 0; r < R; ++r) {
          for (int s = 1; s < S; ++s) acc[0][r] = V::add(acc[0][r], acc[s][r]);
          V::store(sum + r * V::kLanes, acc[0][r]);
        }
      }
    }
    store_tile(w, kWidth, sums, m0, rows, n0, n1);
  }
};

// Registers of `lanes` rows per panel row for a panel of `rows` (at most the panel's) rows: the
// tail panel's width is rounded up to whole registers, and the packs zero-fill the rows past M. The
// packs and for_each_panel take the width from here.
constexpr int panel_regs(int64_t rows, int64_t lanes) {
  return static_cast<int>((rows + lanes - 1) / lanes);
}

// One panel of x (`rows` at most the panel's rows) packed for the kernel of V: see pack_transposed.
template <class V>
void pack_panel(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K, float* xt,
                uint8_t* bad) {
  pack_transposed(dtype, x, ldx, rows, K, panel_regs(rows, V::kLanes) * V::kLanes, xt, bad);
}

// The tail panel's kernel: Kernel<regs>, for regs <= R.
template <template <int> class Kernel, int R, class Word>
void tail_columns(int regs, const SpmmWork& w, const Word* x, int64_t m0, int64_t rows, int64_t n0,
                  int64_t n1) {
  if constexpr (R >= 1) {
    if (regs != R) return tail_columns<Kernel, R - 1>(regs, w, x, m0, rows, n0, n1);
    Kernel<R>::columns(w, x, m0, rows, n0, n1);
  }
}

// All rows of y for columns [n0, n1), for both panel kernels (Microkernel and
// spmm_panel_avx512bf16.cc's): Kernel<R>::columns on each panel of kRows rows (R = registers
// of kLanes rows), then on the tail panel (R: its rows rounded up to whole registers, the pack's
// width), kMaxCols columns at a time. x: the pack, row_words words per row of x.
template <template <int> class Kernel, int kLanes, int64_t kRows, class Word>
void for_each_panel(const SpmmWork& w, const Word* x, int64_t row_words, int64_t n0, int64_t n1) {
  static_assert(kRows % kLanes == 0, "panel width must be whole registers");
  constexpr int kFullR = kRows / kLanes;
  for (int64_t c0 = n0; c0 < n1; c0 += kMaxCols) {
    const int64_t c1 = std::min(n1, c0 + kMaxCols);
    int64_t m0 = 0;
    for (; m0 + kRows <= w.M; m0 += kRows) {
      Kernel<kFullR>::columns(w, x + m0 * row_words, m0, kRows, c0, c1);
    }
    const int64_t rows = w.M - m0;
    if (rows == 0) continue;
    tail_columns<Kernel, kFullR>(panel_regs(rows, kLanes), w, x + m0 * row_words, m0, rows, c0,
                                 c1);
  }
}

template <class V>
struct MicrokernelOf {
  template <int R>
  using Kernel = Microkernel<V, R>;
};

// All rows of y for columns [n0, n1) with the x^T panels of V's kernel, kRows rows each.
template <class V, int64_t kRows>
void run_panels(const SpmmWork& w, int64_t n0, int64_t n1) {
  for_each_panel<MicrokernelOf<V>::template Kernel, V::kLanes, kRows>(w, w.xt, w.K, n0, n1);
}

}  // namespace panel
}  // namespace spmm_internal
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_SPMM_PANEL_IMPL_H_
