// Dense y = x @ W with cuBLAS (framework-free), loaded at run time like cuSPARSELt. The GPU op's
// path for what cuSPARSELt does not take (float32, unaligned shapes) at batch sizes where a dense
// matmul on the decompressed weight beats the plain kernel; gpu_check's dense baseline.
#ifndef TF_SPARSE24_CC_SPARSE24_GPU_BLAS_H_
#define TF_SPARSE24_CC_SPARSE24_GPU_BLAS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cc/sparse24/dtype.h"

namespace sparse24 {
namespace gpu {

// Loads cuBLAS once ($TF_SPARSE24_CUBLAS, libcublas.so.13 / .12 / libcublas.so on the loader
// path, then the nvidia-cublas wheels beside the package). True with *where = the file loaded;
// false with *where = what was tried and why it failed.
bool load_cublas(std::string* where);

// y [m, n] = x [m, k] @ w [k, n], all row-major, of `dtype`, float32 accumulation (exact float32
// for float32: no TF32), on `stream`. One cuBLAS handle per device, created on first use.
// exact_reduction: split-K partial sums stay float32 for 16-bit outputs too
// (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION: the op's fallback); false is cuBLAS' default,
// which TensorFlow and PyTorch run (gpu_check's timed dense baseline).
// Returns "" or an error naming the call and its status.
std::string dense_gemm(DType dtype, const void* x, const void* w, int64_t m, int64_t k, int64_t n,
                       void* y, cudaStream_t stream, bool exact_reduction = true);

}  // namespace gpu
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_GPU_BLAS_H_
