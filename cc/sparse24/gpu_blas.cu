// cuBLAS through dlopen (see gpu_blas.h). Host code only. Declarations from the cuBLAS
// documentation; values as in cublas_api.h / library_types.h: CUBLAS_OP_N = 0,
// CUBLAS_COMPUTE_32F = 68, CUBLAS_GEMM_DEFAULT = -1, CUDA_R_32F = 0, CUDA_R_16F = 2,
// CUDA_R_16BF = 14, CUBLAS_DEFAULT_MATH = 0, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16.
#include "cc/sparse24/gpu_blas.h"

#include <map>
#include <mutex>

#include "cc/sparse24/gpu_dlopen.h"

namespace sparse24 {
namespace gpu {
namespace {

using Handle = void*;
constexpr int kDefaultMath = 0;  // CUBLAS_DEFAULT_MATH: no TF32
constexpr int kDisallowReducedPrecisionReduction = 16;

struct Cublas {
  int (*Create)(Handle*) = nullptr;
  int (*SetStream)(Handle, cudaStream_t) = nullptr;
  int (*SetMathMode)(Handle, int) = nullptr;
  int (*GemmEx)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*,
                int, int, const void*, void*, int, int, int, int) = nullptr;
  std::string where;  // the file loaded, or why none was
  bool ok = false;
};

const Cublas& cublas() {
  static const Cublas* loaded = [] {
    auto* c = new Cublas();  // never freed, like the library
    void* lib = open_nvidia_library("TF_SPARSE24_CUBLAS",
                                    {"libcublas.so.13", "libcublas.so.12", "libcublas.so"},
                                    {"cu13", "cublas", "cu12"}, &c->where);
    if (lib == nullptr) {
      c->where = "cuBLAS could not be loaded (pip install nvidia-cublas-cu12 or -cu13, or point "
                 "TF_SPARSE24_CUBLAS at libcublas.so). Tried:" + c->where;
      return c;
    }
    std::string missing;
    bind_symbol(lib, "cublasCreate_v2", &c->Create, &missing);
    bind_symbol(lib, "cublasSetStream_v2", &c->SetStream, &missing);
    bind_symbol(lib, "cublasSetMathMode", &c->SetMathMode, &missing);
    bind_symbol(lib, "cublasGemmEx", &c->GemmEx, &missing);
    if (!missing.empty()) {
      c->where = c->where + " lacks " + missing;
      return c;
    }
    c->ok = true;
    return c;
  }();
  return *loaded;
}

int cuda_data_type(DType t) {
  return t == DType::kFloat32 ? 0 : t == DType::kFloat16 ? 2 : 14;
}

}  // namespace

bool load_cublas(std::string* where) {
  *where = cublas().where;
  return cublas().ok;
}

std::string dense_gemm(DType dtype, const void* x, const void* w, int64_t m, int64_t k, int64_t n,
                       void* y, cudaStream_t stream, bool exact_reduction) {
  const Cublas& c = cublas();
  if (!c.ok) return c.where;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return std::string("cudaGetDevice: ") + cudaGetErrorString(e);
  }
  static std::mutex mu;  // a handle is not safe to share between threads: one call at a time
  static auto* handles = new std::map<int, Handle>();
  std::lock_guard<std::mutex> lock(mu);
  Handle& handle = (*handles)[device];
  if (handle == nullptr) {
    if (const int status = c.Create(&handle); status != 0) {
      handle = nullptr;
      return "cublasCreate returned " + std::to_string(status);
    }
  }
  if (const int status = c.SetStream(handle, stream); status != 0) {
    return "cublasSetStream returned " + std::to_string(status);
  }
  const int mode = kDefaultMath | (exact_reduction ? kDisallowReducedPrecisionReduction : 0);
  if (const int status = c.SetMathMode(handle, mode); status != 0) {
    return "cublasSetMathMode returned " + std::to_string(status);
  }
  // Column-major view: y^T [n, m] = w^T [n, k] (w row-major, ld n) @ x^T [k, m] (ld k).
  const float alpha = 1.f, beta = 0.f;
  const int type = cuda_data_type(dtype);
  const int status = c.GemmEx(handle, 0, 0, static_cast<int>(n), static_cast<int>(m),
                              static_cast<int>(k), &alpha, w, type, static_cast<int>(n), x, type,
                              static_cast<int>(k), &beta, y, type, static_cast<int>(n),
                              /*CUBLAS_COMPUTE_32F*/ 68, /*CUBLAS_GEMM_DEFAULT*/ -1);
  if (status != 0) {
    return "cublasGemmEx(M=" + std::to_string(m) + " K=" + std::to_string(k) +
           " N=" + std::to_string(n) + ") returned " + std::to_string(status);
  }
  return "";
}

}  // namespace gpu
}  // namespace sparse24
