// Portable SpMM kernel: one output at a time, two kept products per 4-element group.
#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace spmm_internal {

void spmm_rows_scalar(const SpmmWork& w, int64_t n0, int64_t n1) {
  const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8, groups = w.K / 4;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t v_base = n * half_k;
    const uint8_t* meta = w.meta + n * meta_row;
    for (int64_t m = 0; m < w.M; ++m) {
      const float* x = w.x + m * w.ldx;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const unsigned bits = meta[g >> 1] >> ((g & 1) * 4);
        acc += load_f32(w.dtype, w.values, v_base + 2 * g) * x[4 * g + (bits & 3u)];
        acc += load_f32(w.dtype, w.values, v_base + 2 * g + 1) * x[4 * g + ((bits >> 2) & 3u)];
      }
      store_f32(w.dtype, w.y, m * w.ldy + n, acc);
    }
  }
}

}  // namespace spmm_internal
}  // namespace sparse24
