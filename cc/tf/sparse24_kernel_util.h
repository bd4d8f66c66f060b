// What the CPU and GPU kernels of the Sparse24 ops share, so both devices accept the same inputs
// and word their errors the same way: the input checks, the type mapping, and one base class per
// op whose Compute checks the inputs and allocates the outputs before handing them to the device's
// kernel (a subclass) for the work itself.
#ifndef TF_SPARSE24_CC_TF_SPARSE24_KERNEL_UTIL_H_
#define TF_SPARSE24_CC_TF_SPARSE24_KERNEL_UTIL_H_

#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cc/sparse24/dtype.h"
#include "cc/sparse24/format.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace sparse24_kernels {

// absl::InvalidArgumentError from message pieces (errors::InvalidArgument is deprecated).
template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

template <typename T>
constexpr sparse24::DType ToDType();
template <>
constexpr sparse24::DType ToDType<float>() {
  return sparse24::DType::kFloat32;
}
template <>
constexpr sparse24::DType ToDType<bfloat16>() {
  return sparse24::DType::kBFloat16;
}
template <>
constexpr sparse24::DType ToDType<Eigen::half>() {
  return sparse24::DType::kFloat16;
}

// Sparse24Compress input: a 2-D [K, N] matrix with K a multiple of 4.
inline absl::Status CheckDense(const Tensor& dense) {
  if (dense.dims() != 2) {
    return InvalidArgument("Sparse24Compress expects a 2-D [K, N] matrix, got shape ",
                           dense.shape().DebugString());
  }
  if (dense.dim_size(0) % 4 != 0) {
    return InvalidArgument("Sparse24Compress: K (rows) must be a multiple of 4, got shape ",
                           dense.shape().DebugString());
  }
  return absl::OkStatus();
}

// (values [N, K/2], meta [N, ceil(K/8)]) for a given K.
inline absl::Status CheckCompressed(const char* op, const Tensor& values, const Tensor& meta,
                                    int64_t k) {
  if (k % 4 != 0) {
    return InvalidArgument(op, ": K (the reduction size) must be a multiple of 4, got K=", k);
  }
  if (values.dims() != 2 || meta.dims() != 2) {
    return InvalidArgument(op, ": values and meta must be 2-D [N, K/2] and [N, ceil(K/8)], got ",
                           values.shape().DebugString(), " and ", meta.shape().DebugString());
  }
  if (values.dim_size(1) != k / 2 || meta.dim_size(0) != values.dim_size(0) ||
      meta.dim_size(1) != sparse24::meta_cols(k)) {
    return InvalidArgument(op, ": for K=", k, " values must be [N, ", k / 2, "] and meta [N, ",
                           sparse24::meta_cols(k), "] with the same N, got values ",
                           values.shape().DebugString(), " and meta ", meta.shape().DebugString());
  }
  return absl::OkStatus();
}

// Sparse24MatMul's inputs: x [..., K] and a weight stored for the same K. Where values and meta
// agree on another K, the message names x's last dimension, the input a caller gets wrong (a
// served model fed features of the wrong size), not the weights; else CheckCompressed's.
inline absl::Status CheckMatMul(const Tensor& x, const Tensor& values, const Tensor& meta) {
  if (x.dims() < 1) return InvalidArgument("Sparse24MatMul: x must be [..., K], got a scalar");
  const int64_t k = x.dim_size(x.dims() - 1);
  // (values' width at most INT64_MAX / 2, so that K = 2 * width does not overflow)
  if (values.dims() == 2 && meta.dims() == 2 &&
      values.dim_size(1) <= std::numeric_limits<int64_t>::max() / 2) {
    const int64_t stored_k = values.dim_size(1) * 2;
    if (stored_k != k && meta.dim_size(0) == values.dim_size(0) &&
        meta.dim_size(1) == sparse24::meta_cols(stored_k)) {
      return InvalidArgument("Sparse24MatMul: x ", x.shape().DebugString(), " has K=", k,
                             " in its last dimension, but the weight (values ",
                             values.shape().DebugString(), ") is stored for K=", stored_k,
                             ": x must be [..., ", stored_k, "]");
    }
  }
  return CheckCompressed("Sparse24MatMul", values, meta, k);
}

// Sparse24MatMul's x [..., K] (at least 1-D): the output shape [..., N] and the row count M, the
// product of the batch dims (NumElements / K would be 0 when K = 0). With K = 0, x is empty
// whatever its batch dims, so [..., N] can have more elements than int64 holds: InvalidArgument
// (TensorShape::set_dim would abort the process).
inline absl::Status MatMulShapes(const Tensor& x, int64_t n, TensorShape* y_shape, int64_t* m) {
  *m = 1;
  for (int d = 0; d + 1 < x.dims(); ++d) *m *= x.dim_size(d);
  *y_shape = x.shape();
  if (!y_shape->SetDimWithStatus(x.dims() - 1, n).ok()) {
    return InvalidArgument("Sparse24MatMul: the output [..., N] for x ", x.shape().DebugString(),
                           " and N=", n, " would have more elements than int64 holds");
  }
  return absl::OkStatus();
}

// Sparse24Compress: dense [K, N] -> values [N, K/2], meta [N, ceil(K/8)].
class CompressKernel : public OpKernel {
 public:
  explicit CompressKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) final {
    const Tensor& dense = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckDense(dense));
    const int64_t k = dense.dim_size(0), n = dense.dim_size(1);
    Tensor* values = nullptr;
    Tensor* meta = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, k / 2}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, sparse24::meta_cols(k)}), &meta));
    if (k == 0 || n == 0) return;
    Compress(ctx, dense, k, n, values, meta);
  }

 private:
  // Fills values and meta from dense (k, n > 0), or fails on ctx naming the first group that is
  // not 2:4.
  virtual void Compress(OpKernelContext* ctx, const Tensor& dense, int64_t k, int64_t n,
                        Tensor* values, Tensor* meta) = 0;
};

// Sparse24Decompress: values [N, k/2], meta [N, ceil(k/8)] -> dense [k, N], k an attribute.
class DecompressKernel : public OpKernel {
 public:
  explicit DecompressKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
  }

  void Compute(OpKernelContext* ctx) final {
    const Tensor& values = ctx->input(0);
    const Tensor& meta = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckCompressed("Sparse24Decompress", values, meta, k_));
    const int64_t n = values.dim_size(0);
    Tensor* dense = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k_, n}), &dense));
    if (k_ == 0 || n == 0) return;
    Decompress(ctx, values, meta, k_, n, dense);
  }

 private:
  // Fills dense from values and meta (k, n > 0), or fails on ctx naming the first bad meta entry.
  virtual void Decompress(OpKernelContext* ctx, const Tensor& values, const Tensor& meta, int64_t k,
                          int64_t n, Tensor* dense) = 0;

  int64_t k_;
};

// Sparse24MatMul: x [..., K] @ W -> y [..., N], W [K, N] given as values [N, K/2], meta
// [N, ceil(K/8)].
class MatMulKernel : public OpKernel {
 public:
  explicit MatMulKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) final {
    const Tensor& x = ctx->input(0);
    const Tensor& values = ctx->input(1);
    const Tensor& meta = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckMatMul(x, values, meta));
    const int64_t k = x.dim_size(x.dims() - 1);
    const int64_t n = values.dim_size(0);
    TensorShape y_shape;
    int64_t m;
    OP_REQUIRES_OK(ctx, MatMulShapes(x, n, &y_shape, &m));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y_shape, &y));
    MatMul(ctx, x, values, meta, m, k, n, y);
  }

 private:
  // y [M, N] = x [M, K] @ W. Any of m, k, n may be 0: meta is still validated where it has
  // entries, and y is zero where K is.
  virtual void MatMul(OpKernelContext* ctx, const Tensor& x, const Tensor& values,
                      const Tensor& meta, int64_t m, int64_t k, int64_t n, Tensor* y) = 0;
};

}  // namespace sparse24_kernels
}  // namespace tensorflow

#endif  // TF_SPARSE24_CC_TF_SPARSE24_KERNEL_UTIL_H_
