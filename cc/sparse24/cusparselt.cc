// dlopen glue for cuSPARSELt (see cusparselt.h). Plain C++: no CUDA headers, no link dependency.
#include "cc/sparse24/cusparselt.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace sparse24 {
namespace lt {
namespace {

constexpr char kSoname[] = "libcusparseLt.so.0";

// site-packages of the binary holding this code: .../site-packages/tf_sparse24/_ops.so -> ...
std::string site_packages_dir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&site_packages_dir), &info) == 0 || !info.dli_fname) return "";
  std::string path = info.dli_fname;
  for (int up = 0; up < 2; ++up) {
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return "";
    path.resize(slash);
  }
  return path;
}

template <typename Fn>
bool bind(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

struct Loaded {
  Api api{};
  std::string error;
  bool ok = false;
};

Loaded load() {
  Loaded out;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TF_SPARSE24_CUSPARSELT"); env && *env) {
    candidates.push_back(env);
  }
  candidates.push_back(kSoname);
  const std::string site = site_packages_dir();
  if (!site.empty()) {
    for (const char* sub : {"nvidia/cusparselt/lib/", "nvidia/cu13/lib/", "nvidia/cu12/lib/"}) {
      candidates.push_back(site + "/" + sub + kSoname);
    }
  }
  void* lib = nullptr;
  std::string tried;
  for (const std::string& path : candidates) {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* why = dlerror();
    tried += "\n  " + path + ": " + (why ? why : "not found");
  }
  if (!lib) {
    out.error = std::string("cuSPARSELt (") + kSoname +
                ") could not be loaded; the GPU 2:4 matmul needs it. Install it with "
                "`pip install tf_sparse24[gpu]` (the nvidia-cusparselt-cu12 wheel), or point "
                "TF_SPARSE24_CUSPARSELT at libcusparseLt.so.0. Tried:" + tried;
    return out;
  }
  Api& a = out.api;
  std::string missing;
  bind(lib, "cusparseLtInit", &a.Init, &missing);
  bind(lib, "cusparseLtDestroy", &a.Destroy, &missing);
  bind(lib, "cusparseLtGetVersion", &a.GetVersion, &missing);
  bind(lib, "cusparseLtDenseDescriptorInit", &a.DenseDescriptorInit, &missing);
  bind(lib, "cusparseLtStructuredDescriptorInit", &a.StructuredDescriptorInit, &missing);
  bind(lib, "cusparseLtMatDescriptorDestroy", &a.MatDescriptorDestroy, &missing);
  bind(lib, "cusparseLtMatmulDescriptorInit", &a.MatmulDescriptorInit, &missing);
  bind(lib, "cusparseLtMatmulAlgSelectionInit", &a.MatmulAlgSelectionInit, &missing);
  bind(lib, "cusparseLtMatmulAlgSelectionDestroy", &a.MatmulAlgSelectionDestroy, &missing);
  bind(lib, "cusparseLtMatmulAlgGetAttribute", &a.MatmulAlgGetAttribute, &missing);
  bind(lib, "cusparseLtMatmulGetWorkspace", &a.MatmulGetWorkspace, &missing);
  bind(lib, "cusparseLtMatmulPlanInit", &a.MatmulPlanInit, &missing);
  bind(lib, "cusparseLtMatmulPlanDestroy", &a.MatmulPlanDestroy, &missing);
  bind(lib, "cusparseLtMatmul", &a.Matmul, &missing);
  bind(lib, "cusparseLtMatmulSearch", &a.MatmulSearch, &missing);
  bind(lib, "cusparseLtSpMMACompressedSize2", &a.SpMMACompressedSize2, &missing);
  bind(lib, "cusparseLtSpMMACompress2", &a.SpMMACompress2, &missing);
  if (!missing.empty()) {
    out.error = std::string("the loaded cuSPARSELt lacks ") + missing +
                "; tf_sparse24 needs cuSPARSELt >= 0.6 (pip install -U nvidia-cusparselt-cu12)";
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
