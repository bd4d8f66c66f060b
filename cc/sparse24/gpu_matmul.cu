// Sparse24MatMul's GPU path and the checked compress / meta validation (see gpu_matmul.h). Host
// code only: the kernels are in gpu_kernels.cu, the cuSPARSELt calls in gpu_spmm.cu.
#include "cc/sparse24/gpu_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "cc/sparse24/gpu_blas.h"
#include "cc/sparse24/gpu_kernels.h"

namespace sparse24 {
namespace gpu {
namespace {

#define S24_RETURN_IF_ERROR(expr)   \
  do {                              \
    Status status_ = (expr);        \
    if (!status_.ok()) return status_; \
  } while (0)

Status invalid_argument(std::string message) {
  return {Status::kInvalidArgument, std::move(message)};
}

std::string str(int64_t v) { return std::to_string(v); }
std::string str(unsigned long long v) { return std::to_string(v); }

// At least one byte, so zero-size workspaces still get a valid address.
Status allocate(const Allocator& alloc, size_t bytes, DeviceBuffer* out) {
  return alloc(std::max<size_t>(bytes, 1), out);
}

unsigned long long* slots_of(const DeviceBuffer& buffer) {
  return static_cast<unsigned long long*>(buffer.get());
}

// Copies `count` uint64 slots from the device to the host and waits for the stream.
Status read_back(const unsigned long long* device, unsigned long long* host, int count,
                 cudaStream_t stream) {
  S24_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(host, device, count * sizeof(*host),
                                                  cudaMemcpyDeviceToHost, stream),
                                  "reading back a check result"));
  return cuda_status(cudaStreamSynchronize(stream), "waiting for a check result");
}

size_t values_bytes(const MatMulArgs& a) { return a.n * (a.k / 2) * dtype_size(a.dtype); }
size_t meta_bytes(const MatMulArgs& a) { return a.n * ((a.k + 7) / 8); }

// Launches the fingerprint of the call's weight into *slot.
Status launch_fingerprint(const MatMulArgs& a, unsigned long long* slot, cudaStream_t stream) {
  return cuda_status(fingerprint_weight(a.values, values_bytes(a), a.meta, meta_bytes(a), slot,
                                        stream),
                     "fingerprint");
}

// Launches the meta check into slots[0..1] (reset first).
Status launch_meta_check(const uint8_t* meta, int64_t k, int64_t n, unsigned long long* slots,
                         cudaStream_t stream) {
  S24_RETURN_IF_ERROR(cuda_status(reset_error_slots(slots, 2, stream), "meta check"));
  return cuda_status(check_meta(meta, k, n, slots, stream), "meta check");
}

// The meta check's verdict from its two slots (read back), prefixed by `op`.
Status meta_status(const char* op, const unsigned long long bad[2], int64_t k) {
  if (bad[0] != kNoError) {
    return invalid_argument(std::string(op) + ": invalid meta: row n=" + str(bad[0] / (k / 4)) +
                            ", group g=" + str(bad[0] % (k / 4)) +
                            " has positions that are not strictly ascending");
  }
  if (bad[1] != kNoError) {
    return invalid_argument(std::string(op) + ": invalid meta: row n=" + str(bad[1]) +
                            ", the last byte has a non-zero high nibble, which must be 0 when "
                            "K % 8 == 4 (K=" + str(k) + ")");
  }
  return {};
}

}  // namespace

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {Status::kInternal, std::string(what) + ": " + cudaGetErrorString(e)};
}

Status compress_checked(DType dtype, const void* w, int64_t k, int64_t n, void* values,
                        uint8_t* meta, const Allocator& alloc, cudaStream_t stream) {
  DeviceBuffer slot;
  S24_RETURN_IF_ERROR(allocate(alloc, sizeof(unsigned long long), &slot));
  S24_RETURN_IF_ERROR(cuda_status(reset_error_slots(slots_of(slot), 1, stream), "compress"));
  S24_RETURN_IF_ERROR(cuda_status(compress(dtype, w, k, n, values, meta, slots_of(slot), stream),
                                  "Sparse24Compress kernel"));
  unsigned long long bad;
  S24_RETURN_IF_ERROR(read_back(slots_of(slot), &bad, 1, stream));
  if (bad == kNoError) return {};
  const int64_t g = static_cast<int64_t>(bad) / n;
  return invalid_argument("Sparse24Compress: not 2:4 sparse: group g=" + str(g) + " (rows k=" +
                          str(4 * g) + ".." + str(4 * g + 3) + ") of column n=" +
                          str(static_cast<int64_t>(bad) % n) +
                          " has more than 2 non-zeros; at most 2 of every 4 consecutive "
                          "elements along K may be non-zero");
}

Status check_meta_now(const char* op, const uint8_t* meta, int64_t k, int64_t n,
                      const Allocator& alloc, cudaStream_t stream) {
  DeviceBuffer slots;
  S24_RETURN_IF_ERROR(allocate(alloc, 2 * sizeof(unsigned long long), &slots));
  S24_RETURN_IF_ERROR(launch_meta_check(meta, k, n, slots_of(slots), stream));
  unsigned long long bad[2];
  S24_RETURN_IF_ERROR(read_back(slots_of(slots), bad, 2, stream));
  return meta_status(op, bad, k);
}

Status decompress_checked(DType dtype, const void* values, const uint8_t* meta, int64_t k,
                          int64_t n, void* w, const Allocator& alloc, cudaStream_t stream) {
  S24_RETURN_IF_ERROR(check_meta_now("Sparse24Decompress", meta, k, n, alloc, stream));
  return cuda_status(decompress(dtype, values, meta, k, n, /*transposed=*/false, w, stream),
                     "Sparse24Decompress kernel");
}

bool trust_weight_address_from_env() {
  const char* v = std::getenv("TF_SPARSE24_GPU_TRUST_WEIGHT_ADDRESS");
  return v != nullptr && std::string(v) == "1";
}

CacheLimits CacheLimits::from_env() {
  CacheLimits limits;
  const char* v = std::getenv("TF_SPARSE24_GPU_CACHE_MB");
  char* end = nullptr;
  const unsigned long long mib = v != nullptr ? std::strtoull(v, &end, 10) : 0;
  if (mib > 0 && end != nullptr && *end == '\0') limits.bytes = static_cast<size_t>(mib) << 20;
  return limits;
}

// One cached weight in its form (cuSPARSELt's operand, or the dense W for cuBLAS), and what
// verifies it on later calls without a host round trip: each call fingerprints values+meta into
// `check` on the device; a kernel after the matmul recomputes y if that differs from
// `fingerprint`, and the value is copied to pinned `seen` so a later call drops the stale entry.
struct SparseMatMul::CachedWeight {
  CachedWeight() = default;
  CachedWeight(const CachedWeight&) = delete;
  CachedWeight& operator=(const CachedWeight&) = delete;
  ~CachedWeight() {
    if (seen_ready) {
      cudaEventSynchronize(seen_ready);  // a copy into `seen` may still be in flight
      cudaEventDestroy(seen_ready);
    }
    if (seen) cudaFreeHost(seen);
  }
  Form form = Form::kLtOperand;
  int device = -1;
  DType dtype = DType::kFloat32;
  const void* values = nullptr;
  const void* meta = nullptr;
  int64_t k = 0, n = 0;
  uint64_t fingerprint = 0;
  size_t bytes = 0;         // of `compressed` or `dense`, counted against the cache's limit
  DeviceBuffer compressed;  // kLtOperand: cuSPARSELt's operand
  std::unique_ptr<LtSparseOperand> operand;
  DeviceBuffer dense;                   // kDense: W [K, N], row-major
  DeviceBuffer check;                   // one uint64 on the device
  unsigned long long* seen = nullptr;   // pinned host copy of the last `check`
  cudaEvent_t seen_ready = nullptr;     // recorded after that copy
  bool seen_pending = false;
};

SparseMatMul::SparseMatMul(Logger log, bool trust_weight_address, CacheLimits limits)
    : log_(std::move(log)), trust_(trust_weight_address), limits_(limits) {}

SparseMatMul::~SparseMatMul() = default;

SparseMatMul::Stats SparseMatMul::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return {weights_.size(), cached_bytes_, compressions_, decompressions_, plain_calls_.load(),
          dense_calls_.load()};
}

void SparseMatMul::drop(std::list<CachedWeight>::iterator weight) {
  cached_bytes_ -= weight->bytes;
  weights_.erase(weight);
}

Status SparseMatMul::run(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream) {
  S24_RETURN_IF_ERROR(run_matmul(a, alloc, stream));
  // cuSPARSELt and the plain and repair kernels skip W's zeros: put back the NaN a dense matmul
  // gets from NaN/Inf in x times those zeros (docs/FORMAT.md). One read of x when it is finite.
  return cuda_status(propagate_nonfinite(a.dtype, a.x, a.values, a.meta, a.m, a.k, a.n, a.y,
                                         stream),
                     "Sparse24MatMul NaN/Inf kernel");
}

Status SparseMatMul::run_matmul(const MatMulArgs& a, const Allocator& alloc,
                                cudaStream_t stream) {
  const std::string unsupported = lt_unsupported_reason(a.dtype, a.k, a.n);
  if (!unsupported.empty()) {
    log_(unsupported, "Sparse24MatMul on GPU does not use the Sparse Tensor Cores for " +
                          unsupported + ": it runs a dense cuBLAS matmul on the decompressed "
                          "weight (more than " + str(kPlainMaxRows) + " rows of x) or a plain "
                          "CUDA kernel");
    return run_fallback(a, alloc, stream);
  }
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = run_lt(a, alloc, stream);
  }
  if (status.code == Status::kUnimplemented) return run_fallback(a, alloc, stream);
  return status;
}

Status SparseMatMul::run_fallback(const MatMulArgs& a, const Allocator& alloc,
                                  cudaStream_t stream) {
  if (a.m > kPlainMaxRows) {
    bool ran = false;
    std::string why_not;
    S24_RETURN_IF_ERROR(run_dense(a, alloc, stream, &ran, &why_not));
    if (ran) return {};
    log_("cuBLAS: " + why_not.substr(0, why_not.find(':')),
         "Sparse24MatMul on GPU runs its plain CUDA kernel instead of cuBLAS: " + why_not);
  }
  S24_RETURN_IF_ERROR(check_meta_now("Sparse24MatMul", a.meta, a.k, a.n, alloc, stream));
  ++plain_calls_;
  return cuda_status(spmm_simple(a.dtype, a.x, a.values, a.meta, a.m, a.k, a.n, a.y, stream),
                     "Sparse24MatMul plain kernel");
}

// cuBLAS on the cached decompressed weight: *ran when it computed y. When cuBLAS cannot run it
// (missing, failing, no memory for the dense weight, a dimension beyond its int range) *ran stays
// false, *why_not says why, and y is left to the caller's plain kernel; a returned error is final.
Status SparseMatMul::run_dense(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream,
                               bool* ran, std::string* why_not) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();  // cuBLAS takes int sizes
  if (a.m > kIntMax || a.k > kIntMax || a.n > kIntMax) {
    *why_not = "a dimension exceeds cuBLAS's int range";
    return {};
  }
  if (!load_cublas(why_not)) return {};
  std::lock_guard<std::mutex> lock(mu_);
  bool no_room = false;  // only the dense weight's allocation failing sends y to the plain kernel
  const MakeForm make = [&](CachedWeight* w) -> Status {
    w->bytes = a.k * a.n * dtype_size(a.dtype);
    const Status allocated = allocate(alloc, w->bytes, &w->dense);
    if (!allocated.ok()) {
      no_room = true;
      *why_not = "no memory for the decompressed weight: " + allocated.message;
      return allocated;
    }
    S24_RETURN_IF_ERROR(cuda_status(decompress(a.dtype, a.values, a.meta, a.k, a.n,
                                               /*transposed=*/false, w->dense.get(), stream),
                                    "decompressing the weight"));
    ++decompressions_;
    return {};
  };
  CachedWeight* weight = nullptr;
  bool verify = false;
  const Status status = cached(Form::kDense, a, alloc, stream, make, &weight, &verify);
  if (no_room) return {};
  S24_RETURN_IF_ERROR(status);
  *why_not = dense_gemm(a.dtype, a.x, weight->dense.get(), a.m, a.k, a.n, a.y, stream);
  if (!why_not->empty()) {  // cuBLAS queued nothing: drop the copy it cannot use
    drop(std::find_if(weights_.begin(), weights_.end(),
                      [&](const CachedWeight& w) { return &w == weight; }));
    return {};
  }
  *ran = true;
  ++dense_calls_;
  return verify ? queue_repair(weight, a, stream) : Status{};
}

// This weight's cached `form`, made by `make` if new or known to have changed in place, after the
// weight is fingerprinted and its meta validated (one wait for the stream, for both). On a hit
// (unless trusted) this call's fingerprint is launched into (*out)->check and *verify is set: the
// caller must then queue_repair after its matmul. Holds mu_.
Status SparseMatMul::cached(Form form, const MatMulArgs& a, const Allocator& alloc,
                            cudaStream_t stream, const MakeForm& make, CachedWeight** out,
                            bool* verify) {
  int device = 0;
  S24_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  auto it = std::find_if(weights_.begin(), weights_.end(), [&](const CachedWeight& w) {
    return w.form == form && w.device == device && w.dtype == a.dtype &&
           w.values == a.values && w.meta == a.meta && w.k == a.k && w.n == a.n;
  });
  *verify = false;
  if (it != weights_.end() && !trust_ && it->seen_pending) {
    const cudaError_t state = cudaEventQuery(it->seen_ready);
    if (state == cudaErrorNotReady) {
      // Not an error, but the runtime records it as this thread's last error, which the next
      // launch's cudaGetLastError() would then report as its own failure.
      (void)cudaGetLastError();
    } else {
      S24_RETURN_IF_ERROR(cuda_status(state, "checking a cached weight"));
      it->seen_pending = false;
      if (*it->seen != it->fingerprint) {  // changed in place since it was cached
        drop(it);
        it = weights_.end();
      }
    }
  }
  if (it != weights_.end()) {
    weights_.splice(weights_.begin(), weights_, it);  // most recently used first
    CachedWeight& hit = weights_.front();
    *out = &hit;
    if (trust_) return {};
    S24_RETURN_IF_ERROR(launch_fingerprint(a, slots_of(hit.check), stream));
    *verify = true;
    return {};
  }
  DeviceBuffer slots;  // the fingerprint, then the meta check's two
  S24_RETURN_IF_ERROR(allocate(alloc, 3 * sizeof(unsigned long long), &slots));
  S24_RETURN_IF_ERROR(launch_fingerprint(a, slots_of(slots), stream));
  S24_RETURN_IF_ERROR(launch_meta_check(a.meta, a.k, a.n, slots_of(slots) + 1, stream));
  unsigned long long found[3];
  S24_RETURN_IF_ERROR(read_back(slots_of(slots), found, 3, stream));
  S24_RETURN_IF_ERROR(meta_status("Sparse24MatMul", found + 1, a.k));
  const unsigned long long fingerprint = found[0];
  std::list<CachedWeight> fresh(1);  // joins weights_ once complete
  CachedWeight& entry = fresh.front();
  entry.form = form;
  entry.device = device;
  entry.dtype = a.dtype;
  entry.values = a.values;
  entry.meta = a.meta;
  entry.k = a.k;
  entry.n = a.n;
  entry.fingerprint = fingerprint;
  S24_RETURN_IF_ERROR(make(&entry));
  S24_RETURN_IF_ERROR(allocate(alloc, sizeof(unsigned long long), &entry.check));
  S24_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&entry.seen),
                                                sizeof(*entry.seen), cudaHostAllocDefault),
                                  "allocating a pinned fingerprint slot"));
  S24_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(&entry.seen_ready,
                                                           cudaEventDisableTiming),
                                  "creating a fingerprint event"));
  weights_.splice(weights_.begin(), fresh);
  cached_bytes_ += entry.bytes;
  while (weights_.size() > 1 &&
         (weights_.size() > limits_.weights || cached_bytes_ > limits_.bytes)) {
    drop(std::prev(weights_.end()));  // least recently used
  }
  *out = &weights_.front();
  return {};
}

// After a cached weight's matmul: recomputes y from values/meta on the device if this call's
// fingerprint differs from the cached one, and copies the fingerprint to `seen`. Holds mu_.
Status SparseMatMul::queue_repair(CachedWeight* weight, const MatMulArgs& a,
                                  cudaStream_t stream) {
  unsigned long long* check = slots_of(weight->check);
  S24_RETURN_IF_ERROR(cuda_status(
      spmm_simple_unless(a.dtype, a.x, a.values, a.meta, a.m, a.k, a.n, a.y, check,
                         weight->fingerprint, stream),
      "Sparse24MatMul repair kernel"));
  S24_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(weight->seen, check, sizeof(*weight->seen),
                                                  cudaMemcpyDeviceToHost, stream),
                                  "reading the fingerprint"));
  S24_RETURN_IF_ERROR(cuda_status(cudaEventRecord(weight->seen_ready, stream),
                                  "recording the fingerprint event"));
  weight->seen_pending = true;
  return {};
}

// Holds mu_.
Status SparseMatMul::run_lt(const MatMulArgs& a, const Allocator& alloc, cudaStream_t stream) {
  std::string error;
  LtContext* lt = LtContext::get(&error);
  if (lt == nullptr) return {Status::kFailedPrecondition, error};
  int device = 0;
  S24_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  const int64_t m_pad = lt_padded_rows(a.m);
  const PlanKey key{device, a.dtype, m_pad, a.k, a.n};
  if (refused_.count(key)) return {Status::kUnimplemented, "refused before"};
  auto plan_it = plans_.find(key);
  if (plan_it == plans_.end()) {
    auto plan = std::make_unique<LtMatmulPlan>();
    error = plan->init(lt, a.dtype, m_pad, a.k, a.n);
    if (!error.empty()) {
      refused_.insert(key);
      const std::string shape = "M=" + str(m_pad) + " K=" + str(a.k) + " N=" + str(a.n);
      log_("plan " + shape, "cuSPARSELt does not take " + shape + " (" + error +
                                "); Sparse24MatMul runs its fallback for it (docs/GPU.md)");
      return {Status::kUnimplemented, error};
    }
    if (plans_.size() >= kMaxPlans) plans_.clear();  // many batch sizes: start over
    plan_it = plans_.emplace(key, std::move(plan)).first;
  }
  const MakeForm make = [&](CachedWeight* w) -> Status {
    auto lt_operand = std::make_unique<LtSparseOperand>();
    std::string init_error = lt_operand->init(lt, a.dtype, a.k, a.n);
    if (!init_error.empty()) return {Status::kUnimplemented, init_error};
    DeviceBuffer wt, scratch;
    S24_RETURN_IF_ERROR(allocate(alloc, a.n * a.k * dtype_size(a.dtype), &wt));
    S24_RETURN_IF_ERROR(allocate(alloc, lt_operand->scratch_bytes(), &scratch));
    w->bytes = lt_operand->compressed_bytes();
    S24_RETURN_IF_ERROR(allocate(alloc, w->bytes, &w->compressed));
    S24_RETURN_IF_ERROR(cuda_status(decompress(a.dtype, a.values, a.meta, a.k, a.n,
                                               /*transposed=*/true, wt.get(), stream),
                                    "expanding the weight for cuSPARSELt"));
    const std::string compress_error =
        lt_operand->compress(wt.get(), w->compressed.get(), scratch.get(), stream);
    if (!compress_error.empty()) return {Status::kInternal, "Sparse24MatMul: " + compress_error};
    w->operand = std::move(lt_operand);
    ++compressions_;
    return {};
  };
  CachedWeight* weight = nullptr;
  bool verify = false;
  S24_RETURN_IF_ERROR(cached(Form::kLtOperand, a, alloc, stream, make, &weight, &verify));

  const size_t es = dtype_size(a.dtype);
  const void* x = a.x;
  void* y = a.y;
  DeviceBuffer x_pad, y_pad, workspace;
  if (m_pad != a.m) {  // cuSPARSELt sees m_pad rows: copy x, zero the extra rows
    S24_RETURN_IF_ERROR(allocate(alloc, m_pad * a.k * es, &x_pad));
    S24_RETURN_IF_ERROR(allocate(alloc, m_pad * a.n * es, &y_pad));
    char* xp = static_cast<char*>(x_pad.get());
    S24_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(xp, a.x, a.m * a.k * es, cudaMemcpyDeviceToDevice, stream), "padding x"));
    S24_RETURN_IF_ERROR(cuda_status(
        cudaMemsetAsync(xp + a.m * a.k * es, 0, (m_pad - a.m) * a.k * es, stream), "padding x"));
    x = xp;
    y = y_pad.get();
  }
  const LtMatmulPlan& plan = *plan_it->second;
  S24_RETURN_IF_ERROR(allocate(alloc, plan.workspace_bytes(), &workspace));
  error = plan.run(weight->compressed.get(), x, y, workspace.get(), stream);
  if (!error.empty()) return {Status::kInternal, "Sparse24MatMul: " + error};
  if (m_pad != a.m) {
    S24_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(a.y, y, a.m * a.n * es, cudaMemcpyDeviceToDevice, stream), "unpadding y"));
  }
  // The weight may have changed in place since it was compressed: repair y on the device.
  return verify ? queue_repair(weight, a, stream) : Status{};
}

}  // namespace gpu
}  // namespace sparse24
