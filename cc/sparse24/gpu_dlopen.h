// Finding NVIDIA libraries (cuSPARSELt, cuBLAS) at run time: dlopen, never linked, so the op
// library builds and loads without them. Plain C++: no CUDA headers.
#ifndef TF_SPARSE24_CC_SPARSE24_GPU_DLOPEN_H_
#define TF_SPARSE24_CC_SPARSE24_GPU_DLOPEN_H_

#include <dlfcn.h>

#include <string>
#include <vector>

namespace sparse24 {

// dlopen()s the first of: $env_var (a path, if set), each soname on the loader path, then each
// soname in the nvidia-* wheels beside this package (site-packages/nvidia/<dir>/lib for each of
// wheel_dirs). On success *where is the candidate that loaded; on failure nullptr, and *where
// lists every candidate with the loader's reason.
void* open_nvidia_library(const char* env_var, const std::vector<std::string>& sonames,
                          const std::vector<std::string>& wheel_dirs, std::string* where);

// *fn = the symbol `name` of `lib`; if it is absent, appends the name to *missing.
template <typename Fn>
bool bind_symbol(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_GPU_DLOPEN_H_
