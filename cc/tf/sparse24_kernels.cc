// CPU kernels of Sparse24Compress / Sparse24Decompress / Sparse24MatMul: the framework-free core
// (cc/sparse24/) on TensorFlow's intra-op thread pool, under the input checks and output allocation
// shared with the GPU kernels (sparse24_kernel_util.h).
#include <cstdlib>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "cc/sparse24/cpu_features.h"
#include "cc/sparse24/format.h"
#include "cc/sparse24/group_scores.h"
#include "cc/sparse24/spmm.h"
#include "cc/tf/sparse24_kernel_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace {

using sparse24_kernels::InvalidArgument;
using sparse24_kernels::ToDType;

constexpr char kIsaEnvVar[] = "TF_SPARSE24_CPU_ISA";

std::string SupportedIsas() {
  std::string names;
  for (auto isa : {sparse24::Isa::kScalar, sparse24::Isa::kAvx2, sparse24::Isa::kAvx512,
                   sparse24::Isa::kAvx512Bf16}) {
    if (!sparse24::isa_supported(isa)) continue;
    if (!names.empty()) names += ", ";
    names += sparse24::isa_name(isa);
  }
  return names;
}

// The variant asked for by TF_SPARSE24_CPU_ISA (unset or empty: auto), checked against this CPU.
absl::Status RequestedIsa(sparse24::Isa* isa) {
  const char* name = std::getenv(kIsaEnvVar);
  if (name == nullptr || name[0] == '\0') name = "auto";
  if (!sparse24::parse_isa(name, isa)) {
    return InvalidArgument(kIsaEnvVar, "='", name,
                           "' is not a CPU kernel variant; use auto, scalar, avx2, avx512 or avx512bf16");
  }
  if (!sparse24::isa_supported(*isa)) {
    return InvalidArgument(kIsaEnvVar, "=", name, " asks for a kernel variant this CPU ",
                           "cannot run; it supports: ", SupportedIsas());
  }
  return absl::OkStatus();
}

sparse24::ParallelFor PoolParallelFor(OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t total, int64_t cost_per_unit,
                   const std::function<void(int64_t, int64_t)>& fn) {
    workers->ParallelFor(total, tsl::thread::ThreadPool::SchedulingParams::Adaptive(cost_per_unit),
                         fn);
  };
}

template <typename T>
class Sparse24CompressOp : public sparse24_kernels::CompressKernel {
 public:
  using CompressKernel::CompressKernel;

 private:
  void Compress(OpKernelContext* ctx, const Tensor& dense, int64_t k, int64_t n, Tensor* values,
                Tensor* meta) override {
    const std::string error =
        sparse24::compress(ToDType<T>(), dense.flat<T>().data(), k, n, values->flat<T>().data(),
                           meta->flat<uint8_t>().data());
    OP_REQUIRES(ctx, error.empty(), InvalidArgument("Sparse24Compress: ", error));
  }
};

template <typename T>
class Sparse24DecompressOp : public sparse24_kernels::DecompressKernel {
 public:
  using DecompressKernel::DecompressKernel;

 private:
  void Decompress(OpKernelContext* ctx, const Tensor& values, const Tensor& meta, int64_t k,
                  int64_t n, Tensor* dense) override {
    const std::string error =
        sparse24::decompress(ToDType<T>(), values.flat<T>().data(), meta.flat<uint8_t>().data(), k,
                             n, dense->flat<T>().data());
    OP_REQUIRES(ctx, error.empty(), InvalidArgument("Sparse24Decompress: ", error));
  }
};

template <typename T>
class Sparse24MatMulOp : public sparse24_kernels::MatMulKernel {
 public:
  using MatMulKernel::MatMulKernel;

 private:
  void MatMul(OpKernelContext* ctx, const Tensor& x, const Tensor& values, const Tensor& meta,
              int64_t m, int64_t k, int64_t n, Tensor* y) override {
    sparse24::Isa isa;
    OP_REQUIRES_OK(ctx, RequestedIsa(&isa));
    sparse24::SpmmArgs args;
    args.dtype = ToDType<T>();
    args.x = x.flat<T>().data();
    args.ldx = k;
    args.values = values.flat<T>().data();
    args.meta = meta.flat<uint8_t>().data();
    args.M = m;
    args.K = k;
    args.N = n;
    args.y = y->flat<T>().data();
    args.ldy = n;
    // Validates meta as it goes (InvalidArgument naming the first bad row and group); NaN/inf in x
    // propagate as in a dense matmul. The core allocates x's float32 copy, packed panels or a
    // kernel's reordered rows with new and throws std::bad_alloc on this thread when that fails;
    // left to propagate, it unwinds through TensorFlow's executor and kills the process, so it
    // becomes ResourceExhausted.
    std::string error;
    bool out_of_memory = false;
    try {
      error = sparse24::spmm(args, isa, PoolParallelFor(ctx));
    } catch (const std::bad_alloc&) {
      out_of_memory = true;
    }
    OP_REQUIRES(ctx, !out_of_memory,
                absl::ResourceExhaustedError(absl::StrCat(
                    "Sparse24MatMul: out of memory for the working copies of x ",
                    x.shape().DebugString(),
                    " (its float32 copy, packed panels or a kernel's reordered rows)")));
    OP_REQUIRES(ctx, error.empty(), InvalidArgument("Sparse24MatMul: ", error));
  }
};

#define REGISTER_CPU(T)                                                                         \
  REGISTER_KERNEL_BUILDER(Name("Sparse24Compress").Device(DEVICE_CPU).TypeConstraint<T>("T"),   \
                          Sparse24CompressOp<T>);                                               \
  REGISTER_KERNEL_BUILDER(Name("Sparse24Decompress").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          Sparse24DecompressOp<T>);                                             \
  REGISTER_KERNEL_BUILDER(Name("Sparse24MatMul").Device(DEVICE_CPU).TypeConstraint<T>("T"),     \
                          Sparse24MatMulOp<T>);

REGISTER_CPU(float);
REGISTER_CPU(bfloat16);
REGISTER_CPU(Eigen::half);
#undef REGISTER_CPU

}  // namespace
}  // namespace tensorflow

// Plain C entry points for tf_sparse24.ops (ctypes): the TensorFlow version this library was built
// against, and which CPU kernel variants this machine runs.
extern "C" {

// setup.py defines TF_SPARSE24_TF_VERSION from tf.__version__ (TF's headers have no such macro).
#ifndef TF_SPARSE24_TF_VERSION
#define TF_SPARSE24_TF_VERSION "unknown"
#endif
const char* tf_sparse24_tf_version() { return TF_SPARSE24_TF_VERSION; }

// The variant `auto` resolves to: "scalar", "avx2", "avx512" or "avx512bf16".
const char* tf_sparse24_best_cpu_isa() { return sparse24::isa_name(sparse24::best_isa()); }

// 1 if `name` is a variant this CPU can run, 0 if not, -1 if `name` is not a variant.
int tf_sparse24_cpu_isa_supported(const char* name) {
  sparse24::Isa isa;
  if (!sparse24::parse_isa(name, &isa)) return -1;
  return sparse24::isa_supported(isa) ? 1 : 0;
}

// For tf_sparse24/permute_search.py (ctypes): see sparse24::top2_group_sums.
void tf_sparse24_top2_group_sums(const float* magnitudes, int64_t rows, const int64_t* groups,
                                 int64_t count, double* out, int threads) {
  sparse24::top2_group_sums(magnitudes, rows, groups, count, out, threads);
}

}  // extern "C"
