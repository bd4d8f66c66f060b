// cuSPARSELt calls behind gpu_spmm.h. Host code only; compiled with nvcc for the CUDA headers.
#include "cc/sparse24/gpu_spmm.h"

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>

namespace sparse24 {
namespace gpu {
namespace {

int lt_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return lt::kCudaR16F;
    case DType::kBFloat16: return lt::kCudaR16BF;
    case DType::kFloat32: return lt::kCudaR32F;
  }
  return -1;
}

constexpr uint32_t kAlignmentBytes = 16;

std::string fail(const char* call, lt::Status status) {
  return std::string(call) + " failed: " + lt::status_string(status);
}

#define LT_RETURN_IF_ERROR(call_name, expr)                    \
  do {                                                         \
    const lt::Status _s = (expr);                              \
    if (_s != lt::kSuccess) return fail(call_name, _s);        \
  } while (0)

}  // namespace

std::string lt_unsupported_reason(DType dtype, int64_t K, int64_t N) {
  if (dtype == DType::kFloat32) {
    return "float32: cuSPARSELt's float32 mode needs 1:2 sparsity, not 2:4 (use float16 or "
           "bfloat16 for the Sparse Tensor Cores)";
  }
  if (K % 16 != 0 || N % 16 != 0 || K == 0 || N == 0) {
    return "K=" + std::to_string(K) + ", N=" + std::to_string(N) +
           ": cuSPARSELt needs K and N to be non-zero multiples of 16";
  }
  return "";
}

LtContext* LtContext::get(std::string* error) {
  static std::mutex mu;
  static auto* contexts = new std::map<int, std::unique_ptr<LtContext>>();
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    *error = std::string("cudaGetDevice failed: ") + cudaGetErrorString(e);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu);
  auto it = contexts->find(device);
  if (it != contexts->end()) return it->second.get();
  const lt::Api* api = lt::load_cusparselt(error);
  if (!api) return nullptr;
  auto ctx = std::make_unique<LtContext>();
  ctx->api_ = api;
  if (lt::Status s = api->Init(&ctx->handle_); s != lt::kSuccess) {
    *error = fail("cusparseLtInit", s) + " on CUDA device " + std::to_string(device) +
             " (cuSPARSELt needs compute capability 8.0 or newer)";
    return nullptr;
  }
  // major * 1000 + minor * 100 + patch. Older releases numbered the compute types differently
  // (PyTorch's cuSPARSELt glue dates the change to 0.5.2: value 2, our CUSPARSE_COMPUTE_32F,
  // meant TF32 before), so anything before 0.6, the oldest API checked here, is refused.
  if (api->GetVersion(&ctx->handle_, &ctx->version_) != lt::kSuccess || ctx->version_ < 600) {
    *error = "cuSPARSELt version code " + std::to_string(ctx->version_) +
             " found; tf_sparse24 needs 0.6 (600) or newer (pip install -U "
             "nvidia-cusparselt-cu12, or -cu13 with CUDA 13)";
    api->Destroy(&ctx->handle_);
    return nullptr;
  }
  return contexts->emplace(device, std::move(ctx)).first->second.get();
}

LtSparseOperand::~LtSparseOperand() {
  if (has_desc_) ctx_->api().MatDescriptorDestroy(&desc_);
}

std::string LtSparseOperand::init(LtContext* ctx, DType dtype, int64_t K, int64_t N) {
  ctx_ = ctx;
  const lt::Api& api = ctx->api();
  LT_RETURN_IF_ERROR("cusparseLtStructuredDescriptorInit",
                     api.StructuredDescriptorInit(ctx->handle(), &desc_, N, K, K, kAlignmentBytes,
                                                  lt_type(dtype), lt::kOrderRow,
                                                  lt::kSparsity50Percent));
  has_desc_ = true;
  LT_RETURN_IF_ERROR("cusparseLtSpMMACompressedSize2",
                     api.SpMMACompressedSize2(ctx->handle(), &desc_, &compressed_bytes_,
                                              &scratch_bytes_));
  return "";
}

std::string LtSparseOperand::compress(const void* wt, void* compressed, void* scratch,
                                      cudaStream_t stream) const {
  LT_RETURN_IF_ERROR("cusparseLtSpMMACompress2",
                     ctx_->api().SpMMACompress2(ctx_->handle(), &desc_, /*is_sparse_a=*/1,
                                                lt::kOpNonTranspose, wt, compressed, scratch,
                                                stream));
  return "";
}

LtMatmulPlan::~LtMatmulPlan() { release(); }

void LtMatmulPlan::release() {
  if (!ctx_) return;
  const lt::Api& api = ctx_->api();
  if (stage_ >= 6) api.MatmulPlanDestroy(&plan_);
  if (stage_ >= 5 && api.MatmulAlgSelectionDestroy) api.MatmulAlgSelectionDestroy(&alg_);
  // stage 4 (matmul descriptor) has no destroy call.
  if (stage_ >= 3) api.MatDescriptorDestroy(&c_);
  if (stage_ >= 2) api.MatDescriptorDestroy(&b_);
  if (stage_ >= 1) api.MatDescriptorDestroy(&a_);
  stage_ = 0;
}

std::string LtMatmulPlan::init(LtContext* ctx, DType dtype, int64_t M, int64_t K, int64_t N) {
  release();
  ctx_ = ctx;
  const lt::Api& api = ctx->api();
  const lt::Handle* h = ctx->handle();
  const int type = lt_type(dtype);
  LT_RETURN_IF_ERROR("cusparseLtStructuredDescriptorInit(A = W^T)",
                     api.StructuredDescriptorInit(h, &a_, N, K, K, kAlignmentBytes, type,
                                                  lt::kOrderRow, lt::kSparsity50Percent));
  stage_ = 1;
  // B: x [M, K] row-major, used transposed (op(B) = x^T [K, M]), as torch's _cslt_sparse_mm does
  // for x.t(); describing it as column-major [K, M] instead would be the same bytes.
  LT_RETURN_IF_ERROR("cusparseLtDenseDescriptorInit(B = x)",
                     api.DenseDescriptorInit(h, &b_, M, K, K, kAlignmentBytes, type,
                                             lt::kOrderRow));
  stage_ = 2;
  LT_RETURN_IF_ERROR("cusparseLtDenseDescriptorInit(C = D = y^T)",
                     api.DenseDescriptorInit(h, &c_, N, M, N, kAlignmentBytes, type,
                                             lt::kOrderCol));
  stage_ = 3;
  LT_RETURN_IF_ERROR("cusparseLtMatmulDescriptorInit",
                     api.MatmulDescriptorInit(h, &matmul_, lt::kOpNonTranspose,
                                              lt::kOpTranspose, &a_, &b_, &c_, &c_,
                                              lt::kCompute32F));
  stage_ = 4;
  LT_RETURN_IF_ERROR("cusparseLtMatmulAlgSelectionInit",
                     api.MatmulAlgSelectionInit(h, &alg_, &matmul_, lt::kMatmulAlgDefault));
  stage_ = 5;
  LT_RETURN_IF_ERROR("cusparseLtMatmulPlanInit", api.MatmulPlanInit(h, &plan_, &matmul_, &alg_));
  stage_ = 6;
  LT_RETURN_IF_ERROR("cusparseLtMatmulGetWorkspace",
                     api.MatmulGetWorkspace(h, &plan_, &workspace_bytes_));
  return "";
}

std::string LtMatmulPlan::run(const void* compressed, const void* x, void* y, void* workspace,
                              cudaStream_t stream) const {
  const float alpha = 1.f, beta = 0.f;
  void* streams[1] = {stream};
  LT_RETURN_IF_ERROR("cusparseLtMatmul",
                     ctx_->api().Matmul(ctx_->handle(), &plan_, &alpha, compressed, x, &beta, y, y,
                                        workspace, streams, 1));
  return "";
}

std::string LtMatmulPlan::search(const void* compressed, const void* x, void* y, void* workspace,
                                 cudaStream_t stream, int* config) {
  const float alpha = 1.f, beta = 0.f;
  void* streams[1] = {stream};
  const lt::Api& api = ctx_->api();
  LT_RETURN_IF_ERROR("cusparseLtMatmulSearch",
                     api.MatmulSearch(ctx_->handle(), &plan_, &alpha, compressed, x, &beta, y, y,
                                      workspace, streams, 1));
  // The chosen id is informational: -1 if this library version does not report it.
  if (api.MatmulAlgGetAttribute(ctx_->handle(), &alg_, lt::kAlgConfigId, config,
                                sizeof(*config)) != lt::kSuccess) {
    *config = -1;
  }
  LT_RETURN_IF_ERROR("cusparseLtMatmulGetWorkspace",
                     api.MatmulGetWorkspace(ctx_->handle(), &plan_, &workspace_bytes_));
  return "";
}

}  // namespace gpu
}  // namespace sparse24
