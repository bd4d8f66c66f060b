// C entry points (for ctypes) to the GPU sources built for the CPU (cuda_on_cpu.h,
// cuda_runtime_on_cpu.cc): the launchers of gpu_kernels.cu, the checked ops and SparseMatMul of
// gpu_matmul.cu. Device memory is host memory here.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "cc/sparse24/gpu_kernels.h"
#include "cc/sparse24/gpu_matmul.h"

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

// -------------------------------------------------------------------------------------------------
// gpu_matmul.h: the checked ops and SparseMatMul, with an allocator that counts its buffers and
// refuses any above a limit (the tests' stand-in for TensorFlow's allocator running out).

namespace {

std::atomic<long long> live_buffers{0};

struct Session {
  std::unique_ptr<sparse24::gpu::SparseMatMul> matmul;
  std::mutex mu;
  std::string logs;  // "key\tmessage\n" per log call
  size_t max_alloc = ~size_t{0};
  sparse24::gpu::Allocator alloc = [this](size_t bytes, sparse24::gpu::DeviceBuffer* out) {
    if (bytes > max_alloc) {
      return sparse24::gpu::Status{sparse24::gpu::Status::kResourceExhausted,
                                   "emulated: no room for " + std::to_string(bytes) + " bytes"};
    }
    void* p = std::malloc(bytes);
    if (p == nullptr) {
      return sparse24::gpu::Status{sparse24::gpu::Status::kResourceExhausted, "malloc failed"};
    }
    ++live_buffers;
    *out = sparse24::gpu::DeviceBuffer(p, [](void* q) {
      std::free(q);
      --live_buffers;
    });
    return sparse24::gpu::Status{};
  };
};

// The status code, with its message copied (truncated) into message[size].
int report(const sparse24::gpu::Status& status, char* message, int64_t size) {
  if (size > 0) {
    std::strncpy(message, status.message.c_str(), size - 1);
    message[size - 1] = '\0';
  }
  return status.code;
}

}  // namespace

extern "C" {

long long sim_live_buffers() { return live_buffers; }

void* sim_session_new(int trust_weight_address, uint64_t max_weights, uint64_t max_bytes) {
  auto* s = new Session();
  sparse24::gpu::CacheLimits limits;
  limits.weights = max_weights;
  limits.bytes = max_bytes;
  s->matmul = std::make_unique<sparse24::gpu::SparseMatMul>(
      [s](const std::string& key, const std::string& message) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->logs += key + "\t" + message + "\n";
      },
      trust_weight_address != 0, limits);
  return s;
}

void sim_session_delete(void* session) { delete static_cast<Session*>(session); }

void sim_session_max_alloc(void* session, uint64_t bytes) {
  static_cast<Session*>(session)->max_alloc = bytes;
}

// SparseMatMul::run; returns the Status code (0 OK).
int sim_session_matmul(void* session, int dtype, const void* x, const void* values,
                       const uint8_t* meta, int64_t m, int64_t k, int64_t n, void* y,
                       char* message, int64_t message_size) {
  auto* s = static_cast<Session*>(session);
  const sparse24::gpu::MatMulArgs args{dtype_of(dtype), x, values, meta, m, k, n, y};
  return report(s->matmul->run(args, s->alloc, nullptr), message, message_size);
}

// cached_weights, cached_bytes, compressions, decompressions, plain_calls, dense_calls.
void sim_session_stats(void* session, int64_t* out) {
  const auto st = static_cast<Session*>(session)->matmul->stats();
  const int64_t values[] = {static_cast<int64_t>(st.cached_weights),
                            static_cast<int64_t>(st.cached_bytes), st.compressions,
                            st.decompressions, st.plain_calls, st.dense_calls};
  std::copy(std::begin(values), std::end(values), out);
}

// The log lines so far (truncated to size).
void sim_session_logs(void* session, char* out, int64_t size) {
  auto* s = static_cast<Session*>(session);
  std::lock_guard<std::mutex> lock(s->mu);
  report({sparse24::gpu::Status::kOk, s->logs}, out, size);
}

int sim_compress_checked(void* session, int dtype, const void* w, int64_t k, int64_t n,
                         void* values, uint8_t* meta, char* message, int64_t message_size) {
  auto* s = static_cast<Session*>(session);
  return report(sparse24::gpu::compress_checked(dtype_of(dtype), w, k, n, values, meta, s->alloc,
                                                nullptr),
                message, message_size);
}

int sim_decompress_checked(void* session, int dtype, const void* values, const uint8_t* meta,
                           int64_t k, int64_t n, void* w, char* message, int64_t message_size) {
  auto* s = static_cast<Session*>(session);
  return report(sparse24::gpu::decompress_checked(dtype_of(dtype), values, meta, k, n, w, s->alloc,
                                                  nullptr),
                message, message_size);
}

}  // extern "C"
