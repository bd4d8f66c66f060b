// Test-only: with the AVX-512 kernels emulated (simde_avx512.h), every variant can run. Linked in
// place of cpu_features.cc's isa_supported, which tests/cc_build.py makes a weak symbol there.
#include "cc/sparse24/cpu_features.h"

namespace sparse24 {

bool isa_supported(Isa) { return true; }

}  // namespace sparse24
