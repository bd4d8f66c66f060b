// GPU kernels of Sparse24Compress / Sparse24Decompress / Sparse24MatMul (built with
// TF_SPARSE24_CUDA=1; see docs/GPU.md). Thin: shape checks and TensorFlow memory and stream here,
// the CUDA kernels and cuSPARSELt calls in the framework-free core (cc/sparse24/gpu_*).
//
// Sparse24MatMul, float16/bfloat16: the sparse24/v1 weight is turned into cuSPARSELt's compressed
// operand once and cached in the kernel (keyed on the values/meta buffers, shapes and device),
// then cusparseLtMatmul runs on TensorFlow's stream. Every call also fingerprints values+meta on
// the device; if that differs from the cached one (weight changed in place), a repair kernel
// recomputes y on the device and a later call recompresses: exact, with no per-call host sync.
// float32 and shapes cuSPARSELt does not take run a plain CUDA kernel instead (logged once).
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "cc/sparse24/gpu_kernels.h"
#include "cc/sparse24/gpu_spmm.h"
#include "cc/tf/sparse24_kernel_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/logging.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace {

namespace gpu = ::sparse24::gpu;

using sparse24_kernels::CheckCompressed;
using sparse24_kernels::CheckDense;
using sparse24_kernels::InvalidArgument;
using sparse24_kernels::MatMulShapes;
using sparse24_kernels::ToDType;

cudaStream_t StreamOf(OpKernelContext* ctx) {
  return reinterpret_cast<cudaStream_t>(
      ctx->op_device_context()->stream()->platform_specific_handle().stream);
}

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// Logs `message` once per process for each distinct `key`.
void LogOnce(const std::string& key, const std::string& message) {
  static std::mutex mu;
  static auto* seen = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (seen->insert(key).second) LOG(WARNING) << "tf_sparse24: " << message;
}

// Copies `count` uint64 slots from the device to the host and waits for the stream.
absl::Status ReadBack(const unsigned long long* device, unsigned long long* host, int count,
                      cudaStream_t stream) {
  TF_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host, device, count * sizeof(*host),
                                                cudaMemcpyDeviceToHost, stream),
                                "reading back a check result"));
  return CudaStatus(cudaStreamSynchronize(stream), "waiting for a check result");
}

absl::Status AllocateSlots(OpKernelContext* ctx, int count, Tensor* slots) {
  return ctx->allocate_temp(DT_UINT64, TensorShape({count}), slots);
}

void* RawData(const Tensor& t) { return const_cast<char*>(t.tensor_data().data()); }

unsigned long long* SlotData(const Tensor& slots) {
  return static_cast<unsigned long long*>(RawData(slots));
}

// Validates meta on the device; names the first bad row n and group g like format.check_meta.
absl::Status CheckMeta(OpKernelContext* ctx, const char* op, const uint8_t* meta, int64_t k,
                       int64_t n, cudaStream_t stream) {
  Tensor slots;
  TF_RETURN_IF_ERROR(AllocateSlots(ctx, 2, &slots));
  TF_RETURN_IF_ERROR(CudaStatus(gpu::reset_error_slots(SlotData(slots), 2, stream), "meta check"));
  TF_RETURN_IF_ERROR(CudaStatus(gpu::check_meta(meta, k, n, SlotData(slots), stream), "meta check"));
  unsigned long long bad[2];
  TF_RETURN_IF_ERROR(ReadBack(SlotData(slots), bad, 2, stream));
  if (bad[0] != gpu::kNoError) {
    return InvalidArgument(op, ": invalid meta: row n=", bad[0] / (k / 4), ", group g=",
                           bad[0] % (k / 4),
                           " has positions that are not strictly ascending");
  }
  if (bad[1] != gpu::kNoError) {
    return InvalidArgument(op, ": invalid meta: row n=", bad[1],
                           ", the last byte has a non-zero high nibble, which must be 0 when "
                           "K % 8 == 4 (K=", k, ")");
  }
  return absl::OkStatus();
}

template <typename T>
class Sparse24CompressGpuOp : public OpKernel {
 public:
  explicit Sparse24CompressGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dense = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckDense(dense));
    const int64_t k = dense.dim_size(0), n = dense.dim_size(1);
    Tensor* values = nullptr;
    Tensor* meta = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, k / 2}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, sparse24::meta_cols(k)}), &meta));
    if (k == 0 || n == 0) return;
    const cudaStream_t stream = StreamOf(ctx);
    Tensor slots;
    OP_REQUIRES_OK(ctx, AllocateSlots(ctx, 1, &slots));
    OP_REQUIRES_OK(ctx, CudaStatus(gpu::reset_error_slots(SlotData(slots), 1, stream), "compress"));
    OP_REQUIRES_OK(ctx, CudaStatus(gpu::compress(ToDType<T>(), dense.flat<T>().data(), k, n,
                                                 values->flat<T>().data(),
                                                 meta->flat<uint8_t>().data(), SlotData(slots),
                                                 stream),
                                   "Sparse24Compress kernel"));
    unsigned long long bad;
    OP_REQUIRES_OK(ctx, ReadBack(SlotData(slots), &bad, 1, stream));
    OP_REQUIRES(ctx, bad == gpu::kNoError,
                InvalidArgument("Sparse24Compress: not 2:4 sparse: group g=", bad / n, " (rows k=",
                                4 * (bad / n), "..", 4 * (bad / n) + 3, ") of column n=", bad % n,
                                " has more than 2 non-zeros; at most 2 of every 4 consecutive "
                                "elements along K may be non-zero"));
  }
};

template <typename T>
class Sparse24DecompressGpuOp : public OpKernel {
 public:
  explicit Sparse24DecompressGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& meta = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckCompressed("Sparse24Decompress", values, meta, k_));
    const int64_t n = values.dim_size(0);
    Tensor* dense = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k_, n}), &dense));
    if (k_ == 0 || n == 0) return;
    const cudaStream_t stream = StreamOf(ctx);
    OP_REQUIRES_OK(ctx, CheckMeta(ctx, "Sparse24Decompress", meta.flat<uint8_t>().data(), k_, n,
                                  stream));
    OP_REQUIRES_OK(ctx, CudaStatus(gpu::decompress(ToDType<T>(), values.flat<T>().data(),
                                                   meta.flat<uint8_t>().data(), k_, n,
                                                   /*transposed=*/false, dense->flat<T>().data(),
                                                   stream),
                                   "Sparse24Decompress kernel"));
  }

 private:
  int64_t k_;
};

// When set to 1, a weight seen before at the same buffers is trusted unchanged (no per-call
// fingerprint, no stream sync). Only for weights that never change in place (served constants).
bool TrustWeightAddress() {
  const char* v = std::getenv("TF_SPARSE24_GPU_TRUST_WEIGHT_ADDRESS");
  return v != nullptr && std::string(v) == "1";
}

constexpr size_t kMaxCachedWeights = 8;
constexpr size_t kMaxPlans = 64;  // one per (padded batch size, K, N, device)

template <typename T>
class Sparse24MatMulGpuOp : public OpKernel {
 public:
  explicit Sparse24MatMulGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& values = ctx->input(1);
    const Tensor& meta = ctx->input(2);
    OP_REQUIRES(ctx, x.dims() >= 1,
                InvalidArgument("Sparse24MatMul: x must be [..., K], got a scalar"));
    const int64_t k = x.dim_size(x.dims() - 1);
    OP_REQUIRES_OK(ctx, CheckCompressed("Sparse24MatMul", values, meta, k));
    const int64_t n = values.dim_size(0);
    TensorShape y_shape;
    int64_t m;
    MatMulShapes(x, n, &y_shape, &m);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y_shape, &y));
    const cudaStream_t stream = StreamOf(ctx);
    if (y->NumElements() == 0) {  // no rows: meta is still validated, as on the CPU
      if (k > 0 && n > 0) {
        OP_REQUIRES_OK(ctx, CheckMeta(ctx, "Sparse24MatMul", meta.flat<uint8_t>().data(), k, n,
                                      stream));
      }
      return;
    }
    if (k == 0) {  // empty sum
      OP_REQUIRES_OK(ctx, CudaStatus(cudaMemsetAsync(y->flat<T>().data(), 0,
                                                     y->NumElements() * sizeof(T), stream),
                                     "zeroing y"));
      return;
    }
    const std::string unsupported = gpu::lt_unsupported_reason(ToDType<T>(), k, n);
    if (!unsupported.empty()) {
      LogOnce(unsupported, "Sparse24MatMul on GPU runs a plain CUDA kernel (no Sparse Tensor "
                           "Cores) for " + unsupported);
      OP_REQUIRES_OK(ctx, Fallback(ctx, x, values, meta, m, k, n, y, stream));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Status status = RunLt(ctx, x, values, meta, m, k, n, y, stream);
    if (absl::IsUnimplemented(status)) {  // cuSPARSELt refused this shape: plain kernel
      OP_REQUIRES_OK(ctx, Fallback(ctx, x, values, meta, m, k, n, y, stream));
      return;
    }
    OP_REQUIRES_OK(ctx, status);
  }

 private:
  // One weight's cuSPARSELt operand, and what is needed to verify it on later calls without a
  // host round trip: each call fingerprints values+meta into `check` on the device; a kernel
  // after the matmul recomputes y if that differs from `fingerprint` (the weight changed in
  // place), and the value is copied to pinned `seen` so a later call drops the stale entry.
  struct CachedWeight {
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
    int device = -1;
    const void* values = nullptr;
    const void* meta = nullptr;
    int64_t k = 0, n = 0;
    uint64_t fingerprint = 0;
    Tensor compressed;  // keeps cuSPARSELt's operand alive in TensorFlow's allocator
    std::unique_ptr<gpu::LtSparseOperand> operand;
    Tensor check;                         // DT_UINT64 [1] on the device
    unsigned long long* seen = nullptr;   // pinned host copy of the last `check`
    cudaEvent_t seen_ready = nullptr;     // recorded after that copy
    bool seen_pending = false;
  };
  using PlanKey = std::tuple<int, int64_t, int64_t, int64_t>;  // device, M padded, K, N

  absl::Status Fallback(OpKernelContext* ctx, const Tensor& x, const Tensor& values,
                        const Tensor& meta, int64_t m, int64_t k, int64_t n, Tensor* y,
                        cudaStream_t stream) {
    TF_RETURN_IF_ERROR(
        CheckMeta(ctx, "Sparse24MatMul", meta.flat<uint8_t>().data(), k, n, stream));
    return CudaStatus(gpu::spmm_simple(ToDType<T>(), x.flat<T>().data(), values.flat<T>().data(),
                                       meta.flat<uint8_t>().data(), m, k, n, y->flat<T>().data(),
                                       stream),
                      "Sparse24MatMul fallback kernel");
  }

  // Fingerprint of values and meta (one pass over the weight's bytes, then a stream sync).
  absl::Status Fingerprint(OpKernelContext* ctx, const Tensor& values, const Tensor& meta,
                           cudaStream_t stream, uint64_t* out) {
    Tensor slot;
    TF_RETURN_IF_ERROR(AllocateSlots(ctx, 1, &slot));
    TF_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(SlotData(slot), 0, sizeof(uint64_t), stream),
                                  "fingerprint"));
    TF_RETURN_IF_ERROR(CudaStatus(gpu::fingerprint_add(values.tensor_data().data(),
                                                       values.TotalBytes(), 1, SlotData(slot),
                                                       stream),
                                  "fingerprint"));
    TF_RETURN_IF_ERROR(CudaStatus(gpu::fingerprint_add(meta.tensor_data().data(),
                                                       meta.TotalBytes(), 2, SlotData(slot),
                                                       stream),
                                  "fingerprint"));
    unsigned long long host;
    TF_RETURN_IF_ERROR(ReadBack(SlotData(slot), &host, 1, stream));
    *out = host;
    return absl::OkStatus();
  }

  // The cached operand for this weight, (re)compressed if new or known to have changed. On a hit
  // (unless trusted) the fingerprint of this call's values+meta is launched into (*out)->check
  // and *verify is set: the caller must then run the repair kernel after the matmul. Holds mu_.
  absl::Status Operand(OpKernelContext* ctx, gpu::LtContext* lt, int device, const Tensor& values,
                       const Tensor& meta, int64_t k, int64_t n, cudaStream_t stream,
                       CachedWeight** out, bool* verify) {
    const void* vp = values.tensor_data().data();
    const void* mp = meta.tensor_data().data();
    auto it = weights_.begin();
    for (; it != weights_.end(); ++it) {
      if (it->device == device && it->values == vp && it->meta == mp && it->k == k && it->n == n) {
        break;
      }
    }
    const bool trust = TrustWeightAddress();
    *verify = false;
    if (it != weights_.end() && !trust && it->seen_pending) {
      const cudaError_t state = cudaEventQuery(it->seen_ready);
      if (state == cudaErrorNotReady) {
        // Not an error, but the runtime records it as this thread's last error, which the next
        // launch's cudaGetLastError() would then report as its own failure.
        (void)cudaGetLastError();
      } else {
        TF_RETURN_IF_ERROR(CudaStatus(state, "checking a cached weight"));
        it->seen_pending = false;
        if (*it->seen != it->fingerprint) {  // changed in place since it was compressed
          weights_.erase(it);
          it = weights_.end();
        }
      }
    }
    if (it != weights_.end()) {
      weights_.splice(weights_.begin(), weights_, it);  // most recently used first
      CachedWeight& hit = weights_.front();
      *out = &hit;
      if (trust) return absl::OkStatus();
      unsigned long long* check = SlotData(hit.check);
      TF_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(check, 0, sizeof(*check), stream), "fingerprint"));
      TF_RETURN_IF_ERROR(CudaStatus(gpu::fingerprint_add(vp, values.TotalBytes(), 1, check, stream),
                                    "fingerprint"));
      TF_RETURN_IF_ERROR(CudaStatus(gpu::fingerprint_add(mp, meta.TotalBytes(), 2, check, stream),
                                    "fingerprint"));
      *verify = true;
      return absl::OkStatus();
    }
    // New weight (or changed): fingerprint it synchronously, validate meta, compress.
    uint64_t fingerprint = 0;
    TF_RETURN_IF_ERROR(Fingerprint(ctx, values, meta, stream, &fingerprint));
    TF_RETURN_IF_ERROR(CheckMeta(ctx, "Sparse24MatMul", static_cast<const uint8_t*>(mp), k, n,
                                 stream));
    auto operand = std::make_unique<gpu::LtSparseOperand>();
    std::string error = operand->init(lt, ToDType<T>(), k, n);
    if (!error.empty()) return absl::UnimplementedError(error);
    Tensor wt, scratch, compressed, check;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DataTypeToEnum<T>::value, TensorShape({n, k}), &wt));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        DT_INT8, TensorShape({static_cast<int64_t>(operand->scratch_bytes()) + 1}), &scratch));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        DT_INT8, TensorShape({static_cast<int64_t>(operand->compressed_bytes())}), &compressed));
    TF_RETURN_IF_ERROR(AllocateSlots(ctx, 1, &check));
    TF_RETURN_IF_ERROR(CudaStatus(
        gpu::decompress(ToDType<T>(), vp, static_cast<const uint8_t*>(mp), k, n,
                        /*transposed=*/true, wt.flat<T>().data(), stream),
        "expanding the weight for cuSPARSELt"));
    error = operand->compress(wt.flat<T>().data(), RawData(compressed), RawData(scratch), stream);
    if (!error.empty()) return absl::InternalError(absl::StrCat("Sparse24MatMul: ", error));
    weights_.emplace_front();
    CachedWeight& entry = weights_.front();
    entry.device = device;
    entry.values = vp;
    entry.meta = mp;
    entry.k = k;
    entry.n = n;
    entry.fingerprint = fingerprint;
    entry.compressed = std::move(compressed);
    entry.operand = std::move(operand);
    entry.check = std::move(check);
    absl::Status status = CudaStatus(
        cudaHostAlloc(reinterpret_cast<void**>(&entry.seen), sizeof(*entry.seen),
                      cudaHostAllocDefault),
        "allocating a pinned fingerprint slot");
    if (status.ok()) {
      status = CudaStatus(cudaEventCreateWithFlags(&entry.seen_ready, cudaEventDisableTiming),
                          "creating a fingerprint event");
    }
    if (!status.ok()) {
      weights_.pop_front();
      return status;
    }
    if (weights_.size() > kMaxCachedWeights) weights_.pop_back();
    *out = &weights_.front();
    return absl::OkStatus();
  }

  absl::Status RunLt(OpKernelContext* ctx, const Tensor& x, const Tensor& values,
                     const Tensor& meta, int64_t m, int64_t k, int64_t n, Tensor* y,
                     cudaStream_t stream) {
    std::string error;
    gpu::LtContext* lt = gpu::LtContext::get(&error);
    if (lt == nullptr) return absl::FailedPreconditionError(error);
    int device = 0;
    TF_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
    const int64_t m_pad = gpu::lt_padded_rows(m);
    const PlanKey key{device, m_pad, k, n};
    if (refused_.count(key)) return absl::UnimplementedError("refused before");
    auto plan_it = plans_.find(key);
    if (plan_it == plans_.end()) {
      auto plan = std::make_unique<gpu::LtMatmulPlan>();
      error = plan->init(lt, ToDType<T>(), m_pad, k, n);
      if (!error.empty()) {
        refused_.insert(key);
        LogOnce(absl::StrCat("plan", m_pad, "x", k, "x", n),
                absl::StrCat("cuSPARSELt does not take M=", m_pad, " K=", k, " N=", n, " (",
                             error, "); Sparse24MatMul runs a plain CUDA kernel for it"));
        return absl::UnimplementedError(error);
      }
      if (plans_.size() >= kMaxPlans) plans_.clear();  // many batch sizes: start over
      plan_it = plans_.emplace(key, std::move(plan)).first;
    }
    CachedWeight* weight = nullptr;
    bool verify = false;
    TF_RETURN_IF_ERROR(Operand(ctx, lt, device, values, meta, k, n, stream, &weight, &verify));

    const T* x_data = x.flat<T>().data();
    T* y_data = y->flat<T>().data();
    Tensor x_pad, y_pad, workspace;
    if (m_pad != m) {  // cuSPARSELt sees m_pad rows: copy x, zero the extra rows
      TF_RETURN_IF_ERROR(
          ctx->allocate_temp(DataTypeToEnum<T>::value, TensorShape({m_pad, k}), &x_pad));
      TF_RETURN_IF_ERROR(
          ctx->allocate_temp(DataTypeToEnum<T>::value, TensorShape({m_pad, n}), &y_pad));
      T* xp = x_pad.flat<T>().data();
      TF_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(xp, x_data, m * k * sizeof(T), cudaMemcpyDeviceToDevice, stream),
          "padding x"));
      TF_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(xp + m * k, 0, (m_pad - m) * k * sizeof(T), stream), "padding x"));
      x_data = xp;
      y_data = y_pad.flat<T>().data();
    }
    const gpu::LtMatmulPlan& plan = *plan_it->second;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        DT_INT8, TensorShape({static_cast<int64_t>(plan.workspace_bytes()) + 1}), &workspace));
    error = plan.run(RawData(weight->compressed), x_data, y_data, RawData(workspace), stream);
    if (!error.empty()) return absl::InternalError(absl::StrCat("Sparse24MatMul: ", error));
    if (m_pad != m) {
      TF_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(y->flat<T>().data(), y_data,
                                                    m * n * sizeof(T), cudaMemcpyDeviceToDevice,
                                                    stream),
                                    "unpadding y"));
    }
    if (verify) {  // the weight changed in place since it was compressed: recompute y here
      unsigned long long* check = SlotData(weight->check);
      TF_RETURN_IF_ERROR(CudaStatus(
          gpu::spmm_simple_unless(ToDType<T>(), x.flat<T>().data(), values.flat<T>().data(),
                                  meta.flat<uint8_t>().data(), m, k, n, y->flat<T>().data(), check,
                                  weight->fingerprint, stream),
          "Sparse24MatMul repair kernel"));
      TF_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(weight->seen, check, sizeof(*weight->seen),
                                                    cudaMemcpyDeviceToHost, stream),
                                    "reading the fingerprint"));
      TF_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(weight->seen_ready, stream),
                                    "recording the fingerprint event"));
      weight->seen_pending = true;
    }
    return absl::OkStatus();
  }

  std::mutex mu_;
  std::list<CachedWeight> weights_;  // most recently used first, at most kMaxCachedWeights
  std::map<PlanKey, std::unique_ptr<gpu::LtMatmulPlan>> plans_;
  std::set<PlanKey> refused_;
};

#define REGISTER_GPU(T)                                                                       \
  REGISTER_KERNEL_BUILDER(Name("Sparse24Compress").Device(DEVICE_GPU).TypeConstraint<T>("T"), \
                          Sparse24CompressGpuOp<T>);                                          \
  REGISTER_KERNEL_BUILDER(                                                                    \
      Name("Sparse24Decompress").Device(DEVICE_GPU).TypeConstraint<T>("T"),                   \
      Sparse24DecompressGpuOp<T>);                                                            \
  REGISTER_KERNEL_BUILDER(Name("Sparse24MatMul").Device(DEVICE_GPU).TypeConstraint<T>("T"),   \
                          Sparse24MatMulGpuOp<T>);

REGISTER_GPU(float);
REGISTER_GPU(bfloat16);
REGISTER_GPU(Eigen::half);
#undef REGISTER_GPU

}  // namespace
}  // namespace tensorflow

#endif  // GOOGLE_CUDA
