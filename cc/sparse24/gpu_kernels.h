// CUDA kernels on the sparse24/v1 format (framework-free; see docs/FORMAT.md and docs/GPU.md).
//
// All launchers are asynchronous on `stream` and return the launch's cudaError_t. Matrices are
// row-major: W [K, N] (Keras kernel), values [N, K/2], meta [N, ceil(K/8)], x [M, K], y [M, N].
// Element type T: float, __half or __nv_bfloat16, chosen by DType.
#ifndef TF_SPARSE24_CC_SPARSE24_GPU_KERNELS_H_
#define TF_SPARSE24_CC_SPARSE24_GPU_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cc/sparse24/dtype.h"

namespace sparse24 {
namespace gpu {

// No error found: the value the check slots hold after reset_error_slots.
constexpr unsigned long long kNoError = ~0ull;

// Sets `count` uint64 error slots to kNoError.
cudaError_t reset_error_slots(unsigned long long* slots, int count, cudaStream_t stream);

// W [K, N] -> values, meta, exactly as format.compress (pads are +0.0). K % 4 == 0.
// A group with more than two non-zeros sets *first_bad to min(g * N + n) over such groups
// (W's memory order: group, then column); its values/meta entries are then unspecified.
cudaError_t compress(DType dtype, const void* w, int64_t K, int64_t N, void* values, uint8_t* meta,
                     unsigned long long* first_bad, cudaStream_t stream);

// Validates meta [N, ceil(K/8)]: slot[0] = min(n * (K/4) + g) over groups whose positions are not
// strictly ascending; slot[1] = min n whose last byte has a non-zero high nibble when K % 8 == 4.
cudaError_t check_meta(const uint8_t* meta, int64_t K, int64_t N, unsigned long long* slots,
                       cudaStream_t stream);

// values, meta -> W [K, N] (transposed = false) or W^T [N, K] (transposed = true; the dense form of
// cuSPARSELt's sparse operand A). Every element is written (+0.0 off the kept positions).
cudaError_t decompress(DType dtype, const void* values, const uint8_t* meta, int64_t K, int64_t N,
                       bool transposed, void* out, cudaStream_t stream);

// y = x @ W straight from values/meta, float32 accumulation. The portable path for float32 and for
// shapes cuSPARSELt does not take; simple (one warp per output column and 4 rows, CUDA cores).
cudaError_t spmm_simple(DType dtype, const void* x, const void* values, const uint8_t* meta,
                        int64_t M, int64_t K, int64_t N, void* y, cudaStream_t stream);

// spmm_simple, unless *fingerprint == expected (device memory, read when the kernel runs): then it
// leaves y alone. Lets a cached result be repaired on the device, without a host round trip, when
// the weight turns out to have changed (see Sparse24MatMul's GPU kernel).
cudaError_t spmm_simple_unless(DType dtype, const void* x, const void* values, const uint8_t* meta,
                               int64_t M, int64_t K, int64_t N, void* y,
                               const unsigned long long* fingerprint, unsigned long long expected,
                               cudaStream_t stream);

// Makes y = x @ W NaN where a dense matmul would be NaN and the kernels above (or cuSPARSELt),
// which skip W's zeros, may not be: y[m, n] = NaN wherever x[m, k] is NaN/Inf and W[k, n] is zero
// (off the kept positions, or a kept zero); products with kept non-zeros already carried NaN/Inf
// through the matmul. Each row of x is scanned once; only rows holding NaN/Inf do more work.
cudaError_t propagate_nonfinite(DType dtype, const void* x, const void* values,
                                const uint8_t* meta, int64_t M, int64_t K, int64_t N, void* y,
                                cudaStream_t stream);

// *out = a 64-bit fingerprint of a compressed weight's bytes (values, then meta), computed on the
// device: every byte counts, with its position and buffer. The op's cache key check.
cudaError_t fingerprint_weight(const void* values, int64_t values_bytes, const uint8_t* meta,
                               int64_t meta_bytes, unsigned long long* out, cudaStream_t stream);

}  // namespace gpu
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_GPU_KERNELS_H_
