// 2:4 sparse matmul y = x @ W with W given in the sparse24/v1 compressed format (framework-free).
//
// W is the Keras kernel [K, N] with 2:4 sparsity along K, stored as values [N, K/2] and
// meta [N, ceil(K/8)] (see docs/FORMAT.md). x is [M, K] row-major, y is [M, N] row-major.
#ifndef TF_SPARSE24_CC_SPARSE24_SPMM_H_
#define TF_SPARSE24_CC_SPARSE24_SPMM_H_

#include <cstdint>
#include <functional>
#include <string>

#include "cc/sparse24/cpu_features.h"
#include "cc/sparse24/dtype.h"

namespace sparse24 {

struct SpmmArgs {
  DType dtype;            // element type of x, values and y (accumulation is float32)
  const void* x;          // [M, K], row stride ldx elements
  int64_t ldx;
  const void* values;     // [N, K/2]
  const uint8_t* meta;    // [N, ceil(K/8)]
  int64_t M, K, N;
  void* y;                // [M, N], row stride ldy elements
  int64_t ldy;
};

// Runs `fn(begin, end)` over [0, total) in parallel; `cost_per_unit` is a rough cycle count per
// unit so the caller's pool can pick a block size (TensorFlow's thread pool ParallelFor contract).
using ParallelFor =
    std::function<void(int64_t total, int64_t cost_per_unit,
                       const std::function<void(int64_t, int64_t)>& fn)>;

// Runs the whole product with the kernel variant for `isa` (kAuto: the best the CPU supports).
// Returns "" or, if meta breaks the format, validate_meta's message (first bad row and group); y is
// then unspecified. Each work unit checks its own meta rows just before reading them, so the check
// costs no extra pass over the weights or extra round trip through the thread pool.
// Throws std::bad_alloc, always on the calling thread (never from a parallel_for worker), when
// x's float32 copy, its packed panels or a kernel's scratch cannot be allocated.
// Precondition: shapes valid (K % 4 == 0), isa supported (callers check with isa_supported).
std::string spmm(const SpmmArgs& args, Isa isa, const ParallelFor& parallel_for);

}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_SPMM_H_
