// The GPU ops' logic without TensorFlow: compress and meta validation that name the bad group, and
// Sparse24MatMul's GPU path (cuSPARSELt with a cache of compressed weights; for what cuSPARSELt
// does not take, the plain kernel or cuBLAS on the decompressed weight). The TF kernels
// (cc/tf/sparse24_gpu_kernels.cu.cc) only check shapes and hand over TensorFlow's allocator and
// stream; gpu_check drives the same code with stream-ordered cudaMallocAsync, so the cache is
// checked on a GPU without TensorFlow.
//
// How the cache works (docs/GPU.md): a weight is kept in the form its path needs (cuSPARSELt's
// compressed operand, or for the cuBLAS fallback the decompressed W), keyed on (form, device,
// dtype, values and meta addresses, K, N). Its first call fingerprints values+meta, validates meta
// (one wait for the stream, for both) and makes that form. Later calls fingerprint it again on the device
// and run the cached form; a kernel after the matmul recomputes y from values/meta if the
// fingerprint differs (the weight changed in place), and the fingerprint is copied to pinned
// memory so a later call drops the stale entry. No call after the first waits for the GPU (the
// plain kernel for up to kPlainMaxRows rows of x has no cache and validates meta every call).
#ifndef TF_SPARSE24_CC_SPARSE24_GPU_MATMUL_H_
#define TF_SPARSE24_CC_SPARSE24_GPU_MATMUL_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "cc/sparse24/dtype.h"
#include "cc/sparse24/gpu_spmm.h"

namespace sparse24 {
namespace gpu {

struct Status {
  enum Code { kOk, kInvalidArgument, kFailedPrecondition, kUnimplemented, kResourceExhausted,
              kInternal };
  Code code = kOk;
  std::string message;
  bool ok() const { return code == kOk; }
};

// Device memory from the caller's allocator, kept alive by the handle (TF: a Tensor's buffer).
// The allocator must be stream-ordered like TensorFlow's: memory freed after work was queued on
// the stream is only reused by work queued later on it (cudaMallocAsync/cudaFreeAsync are).
using DeviceBuffer = std::shared_ptr<void>;
using Allocator = std::function<Status(size_t bytes, DeviceBuffer* out)>;
// Where log lines go; `key` identifies the message, for callers that log each key once. Called
// from any thread that runs SparseMatMul, possibly at the same time.
using Logger = std::function<void(const std::string& key, const std::string& message)>;

// W [K, N] -> values, meta (format.compress), then waits for the stream: InvalidArgument naming the
// first group with more than two non-zeros. K % 4 == 0, K and N > 0.
Status compress_checked(DType dtype, const void* w, int64_t k, int64_t n, void* values,
                        uint8_t* meta, const Allocator& alloc, cudaStream_t stream);

// Validates meta [N, ceil(K/8)] on the device and waits: InvalidArgument naming row n and group g,
// prefixed by `op`. K and N > 0.
Status check_meta_now(const char* op, const uint8_t* meta, int64_t k, int64_t n,
                      const Allocator& alloc, cudaStream_t stream);

// values, meta -> W [K, N] (format.decompress) after check_meta_now("Sparse24Decompress", ...).
// K and N > 0.
Status decompress_checked(DType dtype, const void* values, const uint8_t* meta, int64_t k,
                          int64_t n, void* w, const Allocator& alloc, cudaStream_t stream);

// Internal (naming `what`) for a CUDA error, else OK.
Status cuda_status(cudaError_t e, const char* what);

// y [m, n] = x [m, k] @ W, W given as values [n, k/2] and meta [n, ceil(k/8)]; m, k, n > 0.
struct MatMulArgs {
  DType dtype;
  const void* x;
  const void* values;
  const uint8_t* meta;
  int64_t m, k, n;
  void* y;
};

// TF_SPARSE24_GPU_TRUST_WEIGHT_ADDRESS=1: see SparseMatMul.
bool trust_weight_address_from_env();

// How many prepared weights one SparseMatMul keeps, and how many bytes of them (cuSPARSELt
// operands and decompressed weights, from the caller's allocator), least recently used dropped
// first; the weight just prepared always stays. The count is high because in eager mode
// TensorFlow runs every layer's Sparse24MatMul of one dtype through one kernel instance: a whole
// model's weights share one cache.
struct CacheLimits {
  size_t weights = 1024;
  size_t bytes = size_t{2048} << 20;
  // The defaults, with `bytes` from TF_SPARSE24_GPU_CACHE_MB when set (MiB, > 0).
  static CacheLimits from_env();
};

// Sparse24MatMul's GPU state: cuSPARSELt plans and cached weights (either form) within `limits`,
// most recently used kept. Thread-safe (one mutex); one per TF kernel instance.
class SparseMatMul {
 public:
  static constexpr size_t kMaxPlans = 64;  // one per (device, dtype, padded M, K, N)

  // trust_weight_address: a weight seen before at the same buffers is trusted unchanged (no
  // per-call fingerprint): only for weights that never change in place and are never freed while
  // in use (served constants).
  SparseMatMul(Logger log, bool trust_weight_address,
               CacheLimits limits = CacheLimits::from_env());
  ~SparseMatMul();
  SparseMatMul(const SparseMatMul&) = delete;
  SparseMatMul& operator=(const SparseMatMul&) = delete;

  // Up to this many rows of x, the fallback runs the plain kernel (it reads the compressed
  // weight: memory-bound work); above, a dense cuBLAS matmul on the decompressed weight.
  static constexpr int64_t kPlainMaxRows = 8;

  // y = x @ W on `stream`: cuSPARSELt (float16/bfloat16, K and N multiples of 16, accepted by the
  // library) with the cached operand; anything else is the fallback: cuBLAS on the cached
  // decompressed weight above kPlainMaxRows rows of x, else the plain kernel, which validates meta
  // on every call (also when cuBLAS is missing or fails, or the dense weight does not fit). Then
  // NaN/Inf in x propagate as in a dense matmul (gpu_kernels.h propagate_nonfinite).
  Status run(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream);

  struct Stats {
    size_t cached_weights = 0;
    size_t cached_bytes = 0;  // their buffers (cuSPARSELt operands, decompressed weights)
    int compressions = 0;    // weights (re)compressed into cuSPARSELt's operand
    int decompressions = 0;  // weights (re)decompressed into the cuBLAS fallback's dense copy
    int plain_calls = 0;     // fallback calls run by the plain kernel
    int dense_calls = 0;     // fallback calls run by cuBLAS on the decompressed weight
  };
  Stats stats();

 private:
  struct CachedWeight;
  enum class Form { kLtOperand, kDense };
  using PlanKey = std::tuple<int, DType, int64_t, int64_t, int64_t>;  // device, dtype, M pad, K, N
  // Makes a new entry's form (its buffers) once the weight has been fingerprinted and validated.
  using MakeForm = std::function<Status(CachedWeight*)>;

  Status run_matmul(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream);
  Status run_fallback(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream);
  Status run_dense(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream, bool* ran,
                   std::string* why_not);
  Status run_lt(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream);
  Status cached(Form form, const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream,
                const MakeForm& make, CachedWeight** out, bool* verify);
  Status queue_repair(CachedWeight* weight, const MatMulArgs& a, cudaStream_t stream);
  void drop(std::list<CachedWeight>::iterator weight);  // holds mu_

  Logger log_;
  bool trust_;
  CacheLimits limits_;
  std::mutex mu_;
  std::list<CachedWeight> weights_;  // most recently used first
  size_t cached_bytes_ = 0;
  std::map<PlanKey, std::unique_ptr<LtMatmulPlan>> plans_;
  std::set<PlanKey> refused_;
  int compressions_ = 0, decompressions_ = 0;
  std::atomic<int> plain_calls_{0}, dense_calls_{0};
};

}  // namespace gpu
}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_GPU_MATMUL_H_
