// GPU kernels of Sparse24Compress / Sparse24Decompress / Sparse24MatMul (built with
// TF_SPARSE24_CUDA=1; see docs/GPU.md). Thin: TensorFlow's allocator and stream here, under the
// input checks and output allocation shared with the CPU kernels (sparse24_kernel_util.h); the
// logic (checked compress and decompress, Sparse24MatMul's cuSPARSELt path and its cuBLAS /
// plain-kernel fallback, with the weight cache) is in the framework-free core
// (cc/sparse24/gpu_matmul.h), which gpu_check tests on a GPU without TensorFlow.
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "cc/sparse24/gpu_matmul.h"
#include "cc/tf/sparse24_kernel_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/logging.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace {

namespace gpu = ::sparse24::gpu;

using sparse24_kernels::ToDType;

cudaStream_t StreamOf(OpKernelContext* ctx) {
  return reinterpret_cast<cudaStream_t>(
      ctx->op_device_context()->stream()->platform_specific_handle().stream);
}

absl::Status ToAbsl(const gpu::Status& s) {
  switch (s.code) {
    case gpu::Status::kOk: return absl::OkStatus();
    case gpu::Status::kInvalidArgument: return absl::InvalidArgumentError(s.message);
    case gpu::Status::kFailedPrecondition: return absl::FailedPreconditionError(s.message);
    case gpu::Status::kUnimplemented: return absl::UnimplementedError(s.message);
    case gpu::Status::kResourceExhausted: return absl::ResourceExhaustedError(s.message);
    case gpu::Status::kInternal: break;
  }
  return absl::InternalError(s.message);
}

// TensorFlow's allocator for the core: temporaries (and the weight cache's buffers, which keep
// their Tensor alive) in the op's device memory, ordered on its stream.
gpu::Allocator TfAllocator(OpKernelContext* ctx) {
  return [ctx](size_t bytes, gpu::DeviceBuffer* out) -> gpu::Status {
    auto tensor = std::make_shared<Tensor>();
    const absl::Status s =
        ctx->allocate_temp(DT_INT8, TensorShape({static_cast<int64_t>(bytes)}), tensor.get());
    if (!s.ok()) {
      return {absl::IsResourceExhausted(s) ? gpu::Status::kResourceExhausted
                                           : gpu::Status::kInternal,
              std::string(s.message())};
    }
    void* data = const_cast<char*>(tensor->tensor_data().data());
    *out = gpu::DeviceBuffer(tensor, data);
    return {};
  };
}

// Logs `message` once per process for each distinct `key`.
void LogOnce(const std::string& key, const std::string& message) {
  static std::mutex mu;
  static auto* seen = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (seen->insert(key).second) LOG(WARNING) << "tf_sparse24: " << message;
}

template <typename T>
class Sparse24CompressGpuOp : public sparse24_kernels::CompressKernel {
 public:
  using CompressKernel::CompressKernel;

 private:
  void Compress(OpKernelContext* ctx, const Tensor& dense, int64_t k, int64_t n, Tensor* values,
                Tensor* meta) override {
    OP_REQUIRES_OK(ctx, ToAbsl(gpu::compress_checked(
                            ToDType<T>(), dense.flat<T>().data(), k, n, values->flat<T>().data(),
                            meta->flat<uint8_t>().data(), TfAllocator(ctx), StreamOf(ctx))));
  }
};

template <typename T>
class Sparse24DecompressGpuOp : public sparse24_kernels::DecompressKernel {
 public:
  using DecompressKernel::DecompressKernel;

 private:
  void Decompress(OpKernelContext* ctx, const Tensor& values, const Tensor& meta, int64_t k,
                  int64_t n, Tensor* dense) override {
    OP_REQUIRES_OK(ctx, ToAbsl(gpu::decompress_checked(
                            ToDType<T>(), values.flat<T>().data(), meta.flat<uint8_t>().data(),
                            k, n, dense->flat<T>().data(), TfAllocator(ctx), StreamOf(ctx))));
  }
};

template <typename T>
class Sparse24MatMulGpuOp : public sparse24_kernels::MatMulKernel {
 public:
  explicit Sparse24MatMulGpuOp(OpKernelConstruction* ctx)
      : MatMulKernel(ctx), matmul_(LogOnce, gpu::trust_weight_address_from_env()) {}

 private:
  void MatMul(OpKernelContext* ctx, const Tensor& x, const Tensor& values, const Tensor& meta,
              int64_t m, int64_t k, int64_t n, Tensor* y) override {
    const cudaStream_t stream = StreamOf(ctx);
    if (y->NumElements() == 0) {  // no rows: meta is still validated, as on the CPU
      if (k > 0 && n > 0) {
        OP_REQUIRES_OK(ctx, ToAbsl(gpu::check_meta_now("Sparse24MatMul",
                                                       meta.flat<uint8_t>().data(), k, n,
                                                       TfAllocator(ctx), stream)));
      }
      return;
    }
    if (k == 0) {  // empty sum
      OP_REQUIRES_OK(ctx, ToAbsl(gpu::cuda_status(
                              cudaMemsetAsync(y->flat<T>().data(), 0,
                                              y->NumElements() * sizeof(T), stream),
                              "zeroing y")));
      return;
    }
    const gpu::MatMulArgs args{ToDType<T>(), x.flat<T>().data(), values.flat<T>().data(),
                               meta.flat<uint8_t>().data(), m, k, n, y->flat<T>().data()};
    OP_REQUIRES_OK(ctx, ToAbsl(matmul_.run(args, TfAllocator(ctx), stream)));
  }

  gpu::SparseMatMul matmul_;  // cuSPARSELt plans and the cache of prepared weights
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
