// Host code only (nvcc, like the other gpu_* files of the GPU build).
#include "cc/sparse24/gpu_dlopen.h"

#include <dlfcn.h>

#include <cstdlib>

namespace sparse24 {
namespace {

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

}  // namespace

void* open_nvidia_library(const char* env_var, const std::vector<std::string>& sonames,
                          const std::vector<std::string>& wheel_dirs, std::string* where) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env && *env) candidates.push_back(env);
  candidates.insert(candidates.end(), sonames.begin(), sonames.end());
  const std::string site = site_packages_dir();
  if (!site.empty()) {
    for (const std::string& dir : wheel_dirs) {
      for (const std::string& soname : sonames) {
        candidates.push_back(site + "/nvidia/" + dir + "/lib/" + soname);
      }
    }
  }
  std::string tried;
  for (const std::string& path : candidates) {
    if (void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *where = path;
      return lib;
    }
    const char* why = dlerror();
    tried += "\n  " + path + ": " + (why ? why : "not found");
  }
  *where = tried;
  return nullptr;
}

}  // namespace sparse24
