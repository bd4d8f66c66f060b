// The panel SpMM microkernel, written once over a SIMD traits type and instantiated per ISA
// (spmm_panel_avx2.cc, spmm_panel_avx512.cc). Include only from those files.
//
// x^T is packed in panels of kPanelRows rows: [K][width] floats, so the rows of one panel for one k
// are `width` consecutive floats. For each output column n and each kept element (k, value) of
// column n, the kernel broadcasts the value and FMAs it with the panel row at k (address from the
// 2-bit meta): loads and FMAs only, no shuffles, on the useful half of the multiply-adds. The K
// loop is blocked (kBlock rows of the panel stay in L1 while a tile of columns streams its values);
// partial sums live in a small per-tile buffer between K blocks. See docs/KERNELS.md.
#ifndef TF_SPARSE24_CC_SPARSE24_SPMM_PANEL_IMPL_H_
#define TF_SPARSE24_CC_SPARSE24_SPMM_PANEL_IMPL_H_

#include <algorithm>
#include <cstdint>

#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace spmm_internal {
namespace panel {

constexpr int64_t kTileCols = 64;     // columns whose partial sums share the tile buffer
constexpr int64_t kPrefetchCols = 4;  // how far ahead a column's values are prefetched

// V: SIMD traits with `using reg`, `kLanes`, zero(), load(const float*), store(float*, reg),
// broadcast(const float*), fmadd(a, b, c) = a * b + c, add(a, b), and
// widen(DType, const void* src, int64_t i, float* dst): kLanes bf16/f16 values from src[i] to
// float32.
//
// R: SIMD registers per panel row (width = R * kLanes rows of x). S: accumulator sets, so R * S
// independent FMA chains hide the FMA latency.
template <class V, int R, int S>
struct Microkernel {
  static constexpr int64_t kWidth = R * V::kLanes;

  // acc[s][r] += sum over the kept elements of groups [g0, g1) of one column, x block at xk
  // (xk points at the panel row of group g0's first k). vals: that column's values from group g0,
  // float32; meta: its meta from the byte holding group g0 (g0 even).
  static inline void run(const float* xk, const float* vals, const uint8_t* meta, int64_t groups,
                         typename V::reg (&acc)[S][R]) {
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {  // two meta bytes: 4 groups, 8 kept elements
      const unsigned b0 = meta[g >> 1], b1 = meta[(g >> 1) + 1];
      const float* x0 = xk + g * 4 * kWidth;
      const int64_t off[8] = {
          (b0 & 3) * kWidth,           ((b0 >> 2) & 3) * kWidth,
          (4 + ((b0 >> 4) & 3)) * kWidth, (4 + (b0 >> 6)) * kWidth,
          (8 + (b1 & 3)) * kWidth,     (8 + ((b1 >> 2) & 3)) * kWidth,
          (12 + ((b1 >> 4) & 3)) * kWidth, (12 + (b1 >> 6)) * kWidth};
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const typename V::reg v = V::broadcast(vals + 2 * g + i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[i % S][r] = V::fmadd(v, V::load(x0 + off[i] + r * V::kLanes), acc[i % S][r]);
        }
      }
    }
    for (; g < groups; ++g) {  // 1..3 trailing groups
      const unsigned bits = meta[g >> 1] >> ((g & 1) * 4);
      const float* x0 = xk + g * 4 * kWidth;
      const typename V::reg v0 = V::broadcast(vals + 2 * g), v1 = V::broadcast(vals + 2 * g + 1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[0][r] = V::fmadd(v0, V::load(x0 + (bits & 3) * kWidth + r * V::kLanes), acc[0][r]);
        acc[1 % S][r] =
            V::fmadd(v1, V::load(x0 + ((bits >> 2) & 3) * kWidth + r * V::kLanes), acc[1 % S][r]);
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

  // One panel (rows m0 .. m0 + rows) times columns [n0, n1), written to y.
  static void panel(const SpmmWork& w, const float* xt, int64_t m0, int64_t rows, int64_t n0,
                    int64_t n1, int64_t k_block) {
    const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8;
    alignas(64) float sums[kTileCols * kWidth];
    alignas(64) float vbuf[1024];  // widened values of one column's K block (k_block / 2 <= 1024)
    for (int64_t t0 = n0; t0 < n1; t0 += kTileCols) {
      const int64_t t1 = std::min(n1, t0 + kTileCols);
      for (int64_t kb = 0; kb < w.K; kb += k_block) {
        const int64_t groups = (std::min(w.K, kb + k_block) - kb) / 4;
        const float* xk = xt + kb * kWidth;
        for (int64_t n = t0; n < t1; ++n) {
          typename V::reg acc[S][R];
          float* sum = sums + (n - t0) * kWidth;
          for (int s = 0; s < S; ++s) {
            for (int r = 0; r < R; ++r) {
              acc[s][r] = (s == 0 && kb > 0) ? V::load(sum + r * V::kLanes) : V::zero();
            }
          }
          const int64_t v0 = n * half_k + kb / 2;
          if (n + kPrefetchCols < t1) prefetch_column(w, v0 + kPrefetchCols * half_k, groups,
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
      for (int64_t r = 0; r < rows; ++r) {  // transpose the tile's sums into y rows
        for (int64_t n = t0; n < t1; ++n) {
          store_f32(w.dtype, w.y, (m0 + r) * w.ldy + n, sums[(n - t0) * kWidth + r]);
        }
      }
    }
  }
};

// All rows of y for columns [n0, n1): full panels of kPanelRows rows, then the tail panel.
template <class V>
void run_panels(const SpmmWork& w, int64_t n0, int64_t n1) {
  static_assert(kPanelRows % V::kLanes == 0, "panel width must be whole registers");
  constexpr int kFullR = kPanelRows / V::kLanes;
  constexpr int64_t kBlockFull = 128;  // rows of k: 128 * 32 floats = 16 KiB of x^T in L1
  int64_t m0 = 0;
  for (; m0 + kPanelRows <= w.M; m0 += kPanelRows) {
    Microkernel<V, kFullR, (8 + kFullR - 1) / kFullR>::panel(w, w.xt + m0 * w.K, m0, kPanelRows,
                                                             n0, n1, kBlockFull);
  }
  const int64_t rows = w.M - m0;
  if (rows == 0) return;
  const float* xt = w.xt + m0 * w.K;
  const int regs = static_cast<int>((rows + V::kLanes - 1) / V::kLanes);
  // Narrower panels: longer K blocks keep the same L1 footprint.
  if constexpr (kFullR >= 4) {
    if (regs == 3) return Microkernel<V, 3, 4>::panel(w, xt, m0, rows, n0, n1, 168);
    if (regs == 4) return Microkernel<V, 4, 2>::panel(w, xt, m0, rows, n0, n1, 128);
  }
  if constexpr (kFullR >= 2) {
    if (regs == 2) return Microkernel<V, 2, 4>::panel(w, xt, m0, rows, n0, n1, 256);
  }
  Microkernel<V, 1, 8>::panel(w, xt, m0, rows, n0, n1, 512);
}

}  // namespace panel
}  // namespace spmm_internal
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_SPMM_PANEL_IMPL_H_
