// cuSPARSELt, loaded at run time with dlopen (framework-free, no CUDA or cuSPARSELt headers needed).
//
// The package never links cuSPARSELt: CPU builds do not need it, and a GPU build finds
// libcusparseLt.so.0 when first used (see load_cusparselt). The few types and entry points used here
// are declared below from NVIDIA's cuSPARSELt documentation (API of cuSPARSELt 0.6 .. 0.10):
// opaque structs are declared at least as large as the library's (512 bytes in 0.6-0.10, 1024
// reserved here), enums keep the library's values, and cudaDataType / cudaStream_t travel as int /
// void*, which is the same ABI. cusparselt_abi_check.cc static_asserts all of this against a real
// cusparseLt.h where one is installed (scripts/gpu_check.sh runs it).
#ifndef TF_SPARSE24_CC_SPARSE24_CUSPARSELT_H_
#define TF_SPARSE24_CC_SPARSE24_CUSPARSELT_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace sparse24 {
namespace lt {

struct alignas(16) Handle { uint8_t data[1024]; };
struct alignas(16) MatDescriptor { uint8_t data[1024]; };
struct alignas(16) MatmulDescriptor { uint8_t data[1024]; };
struct alignas(16) MatmulAlgSelection { uint8_t data[1024]; };
struct alignas(16) MatmulPlan { uint8_t data[1024]; };

using Status = int;  // cusparseStatus_t
constexpr Status kSuccess = 0;
constexpr Status kNotSupported = 10;

// cudaDataType values (library_types.h).
constexpr int kCudaR32F = 0;
constexpr int kCudaR16F = 2;
constexpr int kCudaR16BF = 14;

constexpr int kOpNonTranspose = 0;   // cusparseOperation_t
constexpr int kOpTranspose = 1;
constexpr int kOrderCol = 1;         // cusparseOrder_t
constexpr int kOrderRow = 2;
constexpr int kSparsity50Percent = 0;  // cusparseLtSparsity_t
constexpr int kCompute32F = 2;       // cusparseComputeType: 32I=0, 16F=1, 32F=2
constexpr int kMatmulAlgDefault = 0;  // cusparseLtMatmulAlg_t
constexpr int kAlgConfigId = 0;      // cusparseLtMatmulAlgAttribute_t
constexpr int kAlgConfigMaxId = 1;

// Entry points, in the order of the cuSPARSELt documentation. Pointers to a const handle etc. are
// passed as in the C API.
struct Api {
  Status (*Init)(Handle*);
  Status (*Destroy)(const Handle*);
  Status (*GetVersion)(const Handle*, int*);
  Status (*DenseDescriptorInit)(const Handle*, MatDescriptor*, int64_t rows, int64_t cols,
                                int64_t ld, uint32_t alignment, int value_type, int order);
  Status (*StructuredDescriptorInit)(const Handle*, MatDescriptor*, int64_t rows, int64_t cols,
                                     int64_t ld, uint32_t alignment, int value_type, int order,
                                     int sparsity);
  Status (*MatDescriptorDestroy)(const MatDescriptor*);
  Status (*MatmulDescriptorInit)(const Handle*, MatmulDescriptor*, int op_a, int op_b,
                                 const MatDescriptor* a, const MatDescriptor* b,
                                 const MatDescriptor* c, const MatDescriptor* d, int compute_type);
  Status (*MatmulAlgSelectionInit)(const Handle*, MatmulAlgSelection*, const MatmulDescriptor*,
                                   int alg);
  Status (*MatmulAlgSelectionDestroy)(const MatmulAlgSelection*);  // nullptr before 0.8
  Status (*MatmulAlgGetAttribute)(const Handle*, const MatmulAlgSelection*, int attribute,
                                  void* data, size_t size);
  Status (*MatmulGetWorkspace)(const Handle*, const MatmulPlan*, size_t* size);
  Status (*MatmulPlanInit)(const Handle*, MatmulPlan*, const MatmulDescriptor*,
                           const MatmulAlgSelection*);
  Status (*MatmulPlanDestroy)(const MatmulPlan*);
  Status (*Matmul)(const Handle*, const MatmulPlan*, const void* alpha, const void* a,
                   const void* b, const void* beta, const void* c, void* d, void* workspace,
                   void** streams, int32_t num_streams);
  Status (*MatmulSearch)(const Handle*, MatmulPlan*, const void* alpha, const void* a,
                         const void* b, const void* beta, const void* c, void* d, void* workspace,
                         void** streams, int32_t num_streams);
  Status (*SpMMACompressedSize2)(const Handle*, const MatDescriptor* sparse, size_t* compressed,
                                 size_t* buffer);
  Status (*SpMMACompress2)(const Handle*, const MatDescriptor* sparse, int is_sparse_a, int op,
                           const void* dense, void* compressed, void* buffer, void* stream);
};

// The loaded library, or nullptr with `*error` saying what was tried and what to install.
// Thread-safe; the library is opened once per process and never closed. Search order:
//   1. $TF_SPARSE24_CUSPARSELT (a full path to libcusparseLt.so.0),
//   2. libcusparseLt.so.0 on the loader's path (LD_LIBRARY_PATH, ldconfig, rpath),
//   3. the nvidia-cusparselt-cu12 / -cu13 wheel beside this binary's site-packages
//      (nvidia/cusparselt/lib, nvidia/cu13/lib, nvidia/cu12/lib).
const Api* load_cusparselt(std::string* error);

// "CUSPARSE_STATUS_NOT_SUPPORTED (10)" etc.
std::string status_string(Status status);

}  // namespace lt
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_CUSPARSELT_H_
