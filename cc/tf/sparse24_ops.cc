// Registrations and shape functions of the sparse24 ops (device-agnostic; kernels live elsewhere).
// Format: docs/FORMAT.md. W [K, N] <-> values [N, K/2] + meta [N, ceil(K/8)] uint8.
#include "absl/strings/str_cat.h"
#include "cc/sparse24/format.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// absl::InvalidArgumentError from message pieces (errors::InvalidArgument is deprecated).
template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

// Checks the [N, K/2] values and [N, ceil(K/8)] meta shapes against K (when known); sets *n.
absl::Status MergeCompressed(InferenceContext* c, int values_index, int64_t k, DimensionHandle* n) {
  ShapeHandle values, meta;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(values_index), 2, &values));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(values_index + 1), 2, &meta));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(values, 0), c->Dim(meta, 0), n));
  if (k == InferenceContext::kUnknownDim) return absl::OkStatus();
  if (k % 4 != 0) {
    return InvalidArgument("K (the reduction size) must be a multiple of 4, got K=", k);
  }
  DimensionHandle unused;
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(values, 1), k / 2, &unused));
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(meta, 1), sparse24::meta_cols(k), &unused));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("Sparse24Compress")
    .Input("dense: T")
    .Output("values: T")
    .Output("meta: uint8")
    .Attr("T: {float, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle dense;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &dense));
      DimensionHandle k = c->Dim(dense, 0), n = c->Dim(dense, 1);
      if (!c->ValueKnown(k)) {
        c->set_output(0, c->MakeShape({n, c->UnknownDim()}));
        c->set_output(1, c->MakeShape({n, c->UnknownDim()}));
        return absl::OkStatus();
      }
      const int64_t kv = c->Value(k);
      if (kv % 4 != 0) {
        return InvalidArgument(
            "Sparse24Compress: K (rows of the [K, N] input) must be a multiple of 4, got shape ",
            c->DebugString(dense));
      }
      c->set_output(0, c->MakeShape({n, c->MakeDim(kv / 2)}));
      c->set_output(1, c->MakeShape({n, c->MakeDim(sparse24::meta_cols(kv))}));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Compresses a 2:4 sparse matrix dense [K, N] (2:4 along K) into the sparse24/v1 format:
values [N, K/2] and meta [N, ceil(K/8)] uint8. Fails with InvalidArgument naming the first group
with more than two non-zeros.
)doc");

REGISTER_OP("Sparse24Decompress")
    .Input("values: T")
    .Input("meta: uint8")
    .Attr("k: int >= 0")
    .Output("dense: T")
    .Attr("T: {float, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(MergeCompressed(c, 0, k, &n));
      c->set_output(0, c->MakeShape({c->MakeDim(k), n}));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Rebuilds dense [k, N] from sparse24/v1 values [N, k/2] and meta [N, ceil(k/8)]; validates meta.
)doc");

REGISTER_OP("Sparse24MatMul")
    .Input("x: T")
    .Input("values: T")
    .Input("meta: uint8")
    .Output("y: T")
    .Attr("T: {float, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
      DimensionHandle k_dim = c->Dim(x, -1);
      const int64_t k = c->ValueKnown(k_dim) ? c->Value(k_dim) : InferenceContext::kUnknownDim;
      DimensionHandle n;
      TF_RETURN_IF_ERROR(MergeCompressed(c, 1, k, &n));
      ShapeHandle batch, y;
      TF_RETURN_IF_ERROR(c->Subshape(x, 0, -1, &batch));
      TF_RETURN_IF_ERROR(c->Concatenate(batch, c->Vector(n), &y));
      c->set_output(0, y);
      return absl::OkStatus();
    })
    .Doc(R"doc(
y = x @ W for x [..., K] and W [K, N] given compressed (sparse24/v1 values [N, K/2], meta
[N, ceil(K/8)]); y is [..., N]. Accumulates in float32; NaN/inf in x or values propagate as in a dense
matmul. CPU SIMD variant: env var TF_SPARSE24_CPU_ISA=auto|scalar|avx2|avx512|avx512bf16, read on
every call.
)doc");

}  // namespace tensorflow
