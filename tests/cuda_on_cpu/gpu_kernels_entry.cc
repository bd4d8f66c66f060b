// C entry points (for ctypes) to cc/sparse24/gpu_kernels.cu built for the CPU with cuda_on_cpu.h,
// and the two CUDA runtime calls it makes. Device memory is host memory here.
#include <cstring>

#include "cc/sparse24/gpu_kernels.h"

extern "C" {

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaGetLastError() { return cudaSuccess; }

}  // extern "C"

namespace {

sparse24::DType dtype_of(int code) { return static_cast<sparse24::DType>(code); }

}  // namespace

// The launchers, synchronous here; each returns its cudaError_t.
extern "C" {

int sim_reset_error_slots(unsigned long long* slots, int count) {
  return sparse24::gpu::reset_error_slots(slots, count, nullptr);
}

int sim_compress(int dtype, const void* w, int64_t K, int64_t N, void* values, uint8_t* meta,
                 unsigned long long* first_bad) {
  return sparse24::gpu::compress(dtype_of(dtype), w, K, N, values, meta, first_bad, nullptr);
}

int sim_check_meta(const uint8_t* meta, int64_t K, int64_t N, unsigned long long* slots) {
  return sparse24::gpu::check_meta(meta, K, N, slots, nullptr);
}

int sim_decompress(int dtype, const void* values, const uint8_t* meta, int64_t K, int64_t N,
                   int transposed, void* out) {
  return sparse24::gpu::decompress(dtype_of(dtype), values, meta, K, N, transposed != 0, out,
                                   nullptr);
}

int sim_spmm_simple_unless(int dtype, const void* x, const void* values, const uint8_t* meta,
                           int64_t M, int64_t K, int64_t N, void* y,
                           const unsigned long long* fingerprint, unsigned long long expected) {
  return sparse24::gpu::spmm_simple_unless(dtype_of(dtype), x, values, meta, M, K, N, y,
                                           fingerprint, expected, nullptr);
}

int sim_propagate_nonfinite(int dtype, const void* x, const void* values, const uint8_t* meta,
                            int64_t M, int64_t K, int64_t N, void* y) {
  return sparse24::gpu::propagate_nonfinite(dtype_of(dtype), x, values, meta, M, K, N, y,
                                            nullptr);
}

int sim_fingerprint_weight(const void* values, int64_t values_bytes, const uint8_t* meta,
                           int64_t meta_bytes, unsigned long long* out) {
  return sparse24::gpu::fingerprint_weight(values, values_bytes, meta, meta_bytes, out, nullptr);
}

}  // extern "C"
