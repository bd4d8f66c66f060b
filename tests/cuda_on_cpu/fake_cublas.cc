// A CPU stand-in for libcublas (the four entry points gpu_blas.cu binds), for running the GPU
// path's host code without a GPU (tests/test_gpu_on_cpu.py). From the cuBLAS documentation:
// column-major C = alpha op(A) op(B) + beta C, float32 accumulation. FAKE_CUBLAS_FAIL=1 makes
// cublasGemmEx fail (CUBLAS_STATUS_EXECUTION_FAILED, 13).
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cc/sparse24/dtype.h"
#include "cc/sparse24/half.h"

namespace {

constexpr int kSuccess = 0, kInvalidValue = 7, kExecutionFailed = 13;
constexpr int kR32F = 0, kR16F = 2, kR16BF = 14, kCompute32F = 68;
constexpr int kHandleMagic = 0x5e1fb1a5;

float load(int type, const void* p, int64_t i) {
  if (type == kR32F) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return type == kR16BF ? sparse24::bf16_to_f32(h) : sparse24::f16_to_f32(h);
}

void store(int type, void* p, int64_t i, float v) {
  if (type == kR32F) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = type == kR16BF ? sparse24::f32_to_bf16(v) : sparse24::f32_to_f16(v);
  }
}

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
  std::vector<float> out(static_cast<size_t>(m) * n);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int l = 0; l < k; ++l) {
        const float x = load(a_type, a, trans_a ? l + static_cast<int64_t>(i) * lda
                                                : i + static_cast<int64_t>(l) * lda);
        const float y = load(b_type, b, trans_b ? j + static_cast<int64_t>(l) * ldb
                                                : l + static_cast<int64_t>(j) * ldb);
        acc += x * y;
      }
      const int64_t at = i + static_cast<int64_t>(j) * ldc;
      out[i + static_cast<size_t>(j) * m] = al * acc + (be != 0.f ? be * load(c_type, c, at) : 0.f);
    }
  }
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) store(c_type, c, i + static_cast<int64_t>(j) * ldc, out[i + static_cast<size_t>(j) * m]);
  }
  return kSuccess;
}

}  // extern "C"
