// y = x @ W on the Sparse Tensor Cores through cuSPARSELt (framework-free).
//
// W [K, N] (Keras kernel, 2:4 along K) is cuSPARSELt's structured operand A = W^T [N, K] (row-major,
// exactly the rows of sparse24/v1's values/meta); x [M, K] row-major is the dense operand B, used
// transposed (op(B) = x^T [K, M]); the output D = y^T is column-major [N, M], i.e. y [M, N]
// row-major. This is torch's _cslt_sparse_mm(W^T, x.t(), transpose_result=True) layout (its
// F.linear on a semi-structured weight), so no transposes are materialised.
//
// Usage: LtContext::get() once per device; per weight an LtSparseOperand (compress once, keep the
// compressed buffer); per (M, K, N) an LtMatmulPlan. Memory is always the caller's (TF's allocator
// in the op, cudaMalloc in gpu_check). Every call returns "" on success or an error message that
// names the cuSPARSELt call and its status.
#ifndef TF_SPARSE24_CC_SPARSE24_GPU_SPMM_H_
#define TF_SPARSE24_CC_SPARSE24_GPU_SPMM_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cc/sparse24/cusparselt.h"
#include "cc/sparse24/dtype.h"

namespace sparse24 {
namespace gpu {

// Rows of x are padded to this multiple before cuSPARSELt sees them (callers pad M).
constexpr int64_t kLtRowMultiple = 16;

// Why the cuSPARSELt path does not take this problem ("" if it may: the library can still refuse
// it, which LtMatmulPlan::init reports). float32: cuSPARSELt's fp32 mode is 1:2 sparse, not 2:4.
std::string lt_unsupported_reason(DType dtype, int64_t K, int64_t N);

inline int64_t lt_padded_rows(int64_t m) {
  return (m + kLtRowMultiple - 1) / kLtRowMultiple * kLtRowMultiple;
}

// The cuSPARSELt library and one handle per CUDA device (created on first use, never destroyed).
class LtContext {
 public:
  // For the calling thread's current device; nullptr with *error if cuSPARSELt is missing.
  static LtContext* get(std::string* error);
  const lt::Api& api() const { return *api_; }
  const lt::Handle* handle() const { return &handle_; }
  int version() const { return version_; }

 private:
  const lt::Api* api_ = nullptr;
  lt::Handle handle_{};
  int version_ = 0;
};

// cuSPARSELt's compressed form of one weight.
class LtSparseOperand {
 public:
  LtSparseOperand() = default;
  LtSparseOperand(const LtSparseOperand&) = delete;
  LtSparseOperand& operator=(const LtSparseOperand&) = delete;
  ~LtSparseOperand();

  std::string init(LtContext* ctx, DType dtype, int64_t K, int64_t N);
  size_t compressed_bytes() const { return compressed_bytes_; }
  size_t scratch_bytes() const { return scratch_bytes_; }
  // wt: the dense W^T [N, K] (decompress(..., transposed=true)); scratch: scratch_bytes() bytes.
  std::string compress(const void* wt, void* compressed, void* scratch, cudaStream_t stream) const;

 private:
  LtContext* ctx_ = nullptr;
  lt::MatDescriptor desc_{};
  bool has_desc_ = false;
  size_t compressed_bytes_ = 0, scratch_bytes_ = 0;
};

// One matmul shape. M must be a multiple of kLtRowMultiple (pad x).
class LtMatmulPlan {
 public:
  LtMatmulPlan() = default;
  LtMatmulPlan(const LtMatmulPlan&) = delete;
  LtMatmulPlan& operator=(const LtMatmulPlan&) = delete;
  ~LtMatmulPlan();

  std::string init(LtContext* ctx, DType dtype, int64_t M, int64_t K, int64_t N);
  size_t workspace_bytes() const { return workspace_bytes_; }
  std::string run(const void* compressed, const void* x, void* y, void* workspace,
                  cudaStream_t stream) const;
  // Times the library's configurations on these buffers (synchronous) and keeps the fastest; the
  // workspace must then be re-read. Writes y. Returns "" and sets *config to the chosen id.
  std::string search(const void* compressed, const void* x, void* y, void* workspace,
                     cudaStream_t stream, int* config);

 private:
  void release();
  LtContext* ctx_ = nullptr;
  lt::MatDescriptor a_{}, b_{}, c_{};
  lt::MatmulDescriptor matmul_{};
  lt::MatmulAlgSelection alg_{};
  lt::MatmulPlan plan_{};
  int stage_ = 0;  // how many of a_, b_, c_, matmul_, alg_, plan_ exist (destroyed in reverse)
  size_t workspace_bytes_ = 0;
};

}  // namespace gpu
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_GPU_SPMM_H_
