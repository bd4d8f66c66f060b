// Compile-only check that cusparselt.h's declarations match a real cusparseLt.h (the wheel's).
// Not part of the op library. Built by scripts/gpu_check.sh and tests/test_gpu_build.py with
//   -I<wheel>/include -I<cuda>/include; compiling is the test (static_assert).
#include <cusparseLt.h>

#include <type_traits>

#include "cc/sparse24/cusparselt.h"

namespace lt = sparse24::lt;

#define SAME_VALUE(ours, theirs) static_assert((ours) == static_cast<int>(theirs), #theirs)
SAME_VALUE(lt::kSuccess, CUSPARSE_STATUS_SUCCESS);
SAME_VALUE(lt::kNotSupported, CUSPARSE_STATUS_NOT_SUPPORTED);
SAME_VALUE(lt::kCudaR32F, CUDA_R_32F);
SAME_VALUE(lt::kCudaR16F, CUDA_R_16F);
SAME_VALUE(lt::kCudaR16BF, CUDA_R_16BF);
SAME_VALUE(lt::kOpNonTranspose, CUSPARSE_OPERATION_NON_TRANSPOSE);
SAME_VALUE(lt::kOpTranspose, CUSPARSE_OPERATION_TRANSPOSE);
SAME_VALUE(lt::kOrderCol, CUSPARSE_ORDER_COL);
SAME_VALUE(lt::kOrderRow, CUSPARSE_ORDER_ROW);
SAME_VALUE(lt::kSparsity50Percent, CUSPARSELT_SPARSITY_50_PERCENT);
SAME_VALUE(lt::kCompute32F, CUSPARSE_COMPUTE_32F);
SAME_VALUE(lt::kMatmulAlgDefault, CUSPARSELT_MATMUL_ALG_DEFAULT);
SAME_VALUE(lt::kAlgConfigId, CUSPARSELT_MATMUL_ALG_CONFIG_ID);
SAME_VALUE(lt::kAlgConfigMaxId, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID);

#define FITS(ours, theirs)                                          \
  static_assert(sizeof(ours) >= sizeof(theirs), #theirs " size"); \
  static_assert(alignof(ours) >= alignof(theirs), #theirs " alignment")
FITS(lt::Handle, cusparseLtHandle_t);
FITS(lt::MatDescriptor, cusparseLtMatDescriptor_t);
FITS(lt::MatmulDescriptor, cusparseLtMatmulDescriptor_t);
FITS(lt::MatmulAlgSelection, cusparseLtMatmulAlgSelection_t);
FITS(lt::MatmulPlan, cusparseLtMatmulPlan_t);

// Enums and cudaStream_t travel as int and void*: same size on every supported platform.
static_assert(sizeof(cusparseStatus_t) == sizeof(lt::Status), "status size");
static_assert(sizeof(cudaDataType) == sizeof(int), "cudaDataType size");
static_assert(sizeof(cusparseComputeType) == sizeof(int), "compute type size");
static_assert(sizeof(cudaStream_t) == sizeof(void*), "stream size");

// Same number of parameters for every entry point we bind (a renamed or re-shaped API fails here).
template <typename R, typename... A> constexpr int arity(R (*)(A...)) { return sizeof...(A); }
#define SAME_ARITY(field, fn) \
  static_assert(arity(decltype(lt::Api::field){}) == arity(&fn), #fn " parameters")
SAME_ARITY(Init, cusparseLtInit);
SAME_ARITY(Destroy, cusparseLtDestroy);
SAME_ARITY(GetVersion, cusparseLtGetVersion);
SAME_ARITY(DenseDescriptorInit, cusparseLtDenseDescriptorInit);
SAME_ARITY(StructuredDescriptorInit, cusparseLtStructuredDescriptorInit);
SAME_ARITY(MatDescriptorDestroy, cusparseLtMatDescriptorDestroy);
SAME_ARITY(MatmulDescriptorInit, cusparseLtMatmulDescriptorInit);
SAME_ARITY(MatmulAlgSelectionInit, cusparseLtMatmulAlgSelectionInit);
#if defined(CUSPARSELT_VERSION) && CUSPARSELT_VERSION >= 800  // added in 0.8.0
SAME_ARITY(MatmulAlgSelectionDestroy, cusparseLtMatmulAlgSelectionDestroy);
#endif
SAME_ARITY(MatmulAlgGetAttribute, cusparseLtMatmulAlgGetAttribute);
SAME_ARITY(MatmulGetWorkspace, cusparseLtMatmulGetWorkspace);
SAME_ARITY(MatmulPlanInit, cusparseLtMatmulPlanInit);
SAME_ARITY(MatmulPlanDestroy, cusparseLtMatmulPlanDestroy);
SAME_ARITY(Matmul, cusparseLtMatmul);
SAME_ARITY(MatmulSearch, cusparseLtMatmulSearch);
SAME_ARITY(SpMMACompressedSize2, cusparseLtSpMMACompressedSize2);
SAME_ARITY(SpMMACompress2, cusparseLtSpMMACompress2);

int main() { return 0; }
