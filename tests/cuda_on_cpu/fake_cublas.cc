// A CPU stand-in for libcublas (the four entry points gpu_blas.cu binds), for running the GPU
// path's host code without a GPU (tests/test_gpu_on_cpu.py). From the cuBLAS documentation:
// column-major C = alpha op(A) op(B) + beta C, float32 accumulation. FAKE_CUBLAS_FAIL=1 makes
// cublasGemmEx fail (CUBLAS_STATUS_EXECUTION_FAILED, 13).
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "tests/cuda_on_cpu/cuda_elements.h"

namespace {

constexpr int kSuccess = 0, kInvalidValue = 7, kExecutionFailed = 13;
constexpr int kCompute32F = 68;
constexpr int kHandleMagic = 0x5e1fb1a5;

using cuda_on_cpu::load_element;
using cuda_on_cpu::store_element;

bool live(void* handle) { return handle != nullptr && *static_cast<int*>(handle) == kHandleMagic; }

}  // namespace

extern "C" {

int cublasCreate_v2(void** handle) {
  *handle = new int(kHandleMagic);
  return kSuccess;
}

int cublasSetStream_v2(void* handle, void*) { return live(handle) ? kSuccess : kInvalidValue; }

int cublasSetMathMode(void* handle, int mode) {
  return live(handle) && (mode & ~16) == 0 ? kSuccess : kInvalidValue;
}

int cublasGemmEx(void* handle, int trans_a, int trans_b, int m, int n, int k, const void* alpha,
                 const void* a, int a_type, int lda, const void* b, int b_type, int ldb,
                 const void* beta, void* c, int c_type, int ldc, int compute, int algo) {
  if (!live(handle) || compute != kCompute32F || algo != -1 || a_type != b_type) {
    return kInvalidValue;
  }
  if (m < 0 || n < 0 || k < 0 || (trans_a | trans_b) & ~1 || ldc < m ||
      lda < (trans_a ? k : m) || ldb < (trans_b ? n : k)) {
    return kInvalidValue;
  }
  const char* fail = std::getenv("FAKE_CUBLAS_FAIL");
  if (fail && fail[0] == '1') return kExecutionFailed;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  // Column-major: X(r, c) at X[r + c * ldx]; op(X) = X or its transpose.
  auto at = [](int r, int c, int ld) { return r + static_cast<int64_t>(c) * ld; };
  std::vector<float> out(static_cast<size_t>(m) * n);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int l = 0; l < k; ++l) {
        const float x = load_element(a_type, a, trans_a ? at(l, i, lda) : at(i, l, lda));
        const float y = load_element(b_type, b, trans_b ? at(j, l, ldb) : at(l, j, ldb));
        acc += x * y;
      }
      const float old = be != 0.f ? be * load_element(c_type, c, at(i, j, ldc)) : 0.f;
      out[at(i, j, m)] = al * acc + old;
    }
  }
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) store_element(c_type, c, at(i, j, ldc), out[at(i, j, m)]);
  }
  return kSuccess;
}

}  // extern "C"
