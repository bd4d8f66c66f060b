// dlopen glue for cuSPARSELt (see cusparselt.h). Plain C++: no CUDA headers, no link dependency.
#include "cc/sparse24/cusparselt.h"

#include <string>

#include "cc/sparse24/gpu_dlopen.h"

namespace sparse24 {
namespace lt {
namespace {

constexpr char kSoname[] = "libcusparseLt.so.0";

struct Loaded {
  Api api{};
  std::string error;
  bool ok = false;
};

Loaded load() {
  Loaded out;
  std::string where;
  void* lib = open_nvidia_library("TF_SPARSE24_CUSPARSELT", {kSoname},
                                  {"cusparselt", "cu13", "cu12"}, &where);
  if (!lib) {
    out.error = std::string("cuSPARSELt (") + kSoname +
                ") could not be loaded; the GPU 2:4 matmul needs it. Install it with "
                "`pip install tf_sparse24[gpu]` (the nvidia-cusparselt-cu12 wheel; -cu13 with "
                "CUDA 13), or point TF_SPARSE24_CUSPARSELT at libcusparseLt.so.0. Tried:" + where;
    return out;
  }
  Api& a = out.api;
  std::string missing;
  bind_symbol(lib, "cusparseLtInit", &a.Init, &missing);
  bind_symbol(lib, "cusparseLtDestroy", &a.Destroy, &missing);
  bind_symbol(lib, "cusparseLtGetVersion", &a.GetVersion, &missing);
  bind_symbol(lib, "cusparseLtDenseDescriptorInit", &a.DenseDescriptorInit, &missing);
  bind_symbol(lib, "cusparseLtStructuredDescriptorInit", &a.StructuredDescriptorInit, &missing);
  bind_symbol(lib, "cusparseLtMatDescriptorDestroy", &a.MatDescriptorDestroy, &missing);
  bind_symbol(lib, "cusparseLtMatmulDescriptorInit", &a.MatmulDescriptorInit, &missing);
  bind_symbol(lib, "cusparseLtMatmulAlgSelectionInit", &a.MatmulAlgSelectionInit, &missing);
  // Added in 0.8.0 (which must then be called); 0.6 and 0.7 have no such call.
  std::string optional;
  bind_symbol(lib, "cusparseLtMatmulAlgSelectionDestroy", &a.MatmulAlgSelectionDestroy, &optional);
  bind_symbol(lib, "cusparseLtMatmulAlgGetAttribute", &a.MatmulAlgGetAttribute, &missing);
  bind_symbol(lib, "cusparseLtMatmulGetWorkspace", &a.MatmulGetWorkspace, &missing);
  bind_symbol(lib, "cusparseLtMatmulPlanInit", &a.MatmulPlanInit, &missing);
  bind_symbol(lib, "cusparseLtMatmulPlanDestroy", &a.MatmulPlanDestroy, &missing);
  bind_symbol(lib, "cusparseLtMatmul", &a.Matmul, &missing);
  bind_symbol(lib, "cusparseLtMatmulSearch", &a.MatmulSearch, &missing);
  bind_symbol(lib, "cusparseLtSpMMACompressedSize2", &a.SpMMACompressedSize2, &missing);
  bind_symbol(lib, "cusparseLtSpMMACompress2", &a.SpMMACompress2, &missing);
  if (!missing.empty()) {
    out.error = std::string("the loaded cuSPARSELt lacks ") + missing +
                "; tf_sparse24 needs cuSPARSELt >= 0.6 (pip install -U nvidia-cusparselt-cu12, or "
                "-cu13 with CUDA 13)";
    return out;
  }
  out.ok = true;
  return out;
}

}  // namespace

const Api* load_cusparselt(std::string* error) {
  static const Loaded* loaded = new Loaded(load());  // thread-safe static init, never freed
  if (!loaded->ok) {
    if (error) *error = loaded->error;
    return nullptr;
  }
  return &loaded->api;
}

std::string status_string(Status status) {
  static const char* const kNames[] = {
      "SUCCESS",         "NOT_INITIALIZED", "ALLOC_FAILED",     "INVALID_VALUE",
      "ARCH_MISMATCH",   "MAPPING_ERROR",   "EXECUTION_FAILED", "INTERNAL_ERROR",
      "MATRIX_TYPE_NOT_SUPPORTED", "ZERO_PIVOT", "NOT_SUPPORTED", "INSUFFICIENT_RESOURCES"};
  const bool known = status >= 0 && status < static_cast<int>(sizeof(kNames) / sizeof(kNames[0]));
  return std::string("CUSPARSE_STATUS_") + (known ? kNames[status] : "UNKNOWN") + " (" +
         std::to_string(status) + ")";
}

}  // namespace lt
}  // namespace sparse24
