// Run-time CPU feature detection (CPUID + XGETBV), read once; XNNPACK's hardware-config pattern.
#include "cc/sparse24/cpu_features.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define SPARSE24_X86 1
#endif

namespace sparse24 {
namespace {

struct Features {
  bool avx2 = false;
  bool avx512 = false;
  bool avx512_bf16 = false;
};

#ifdef SPARSE24_X86
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

Features detect() {
  Features f;
#ifdef SPARSE24_X86
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & (1u << 27), avx = ecx & (1u << 28);
  const bool fma = ecx & (1u << 12), f16c = ecx & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;              // SSE + AVX state saved by the OS
  const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;  // opmask + ZMM_Hi256 + Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  const bool avx2 = ebx & (1u << 5);
  const bool avx512f = ebx & (1u << 16), avx512dq = ebx & (1u << 17);
  const bool avx512bw = ebx & (1u << 30), avx512vl = ebx & (1u << 31);
  // The variants are compiled with exactly these flags (setup.py ISA_FLAGS).
  f.avx2 = os_ymm && avx2 && fma && f16c;
  f.avx512 = f.avx2 && os_zmm && avx512f && avx512dq && avx512bw && avx512vl;
  if (f.avx512 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    f.avx512_bf16 = eax & (1u << 5);
  }
#endif
  return f;
}

const Features& features() {
  static const Features f = detect();  // C++11 magic static: initialized once, thread-safe
  return f;
}

}  // namespace

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return features().avx2;
    case Isa::kAvx512:
      return features().avx512;
    case Isa::kAvx512Bf16:
      return features().avx512_bf16;
  }
  return false;
}

Isa best_isa() {
  if (features().avx512_bf16) return Isa::kAvx512Bf16;
  if (features().avx512) return Isa::kAvx512;
  if (features().avx2) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
      return "auto";
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

bool parse_isa(const char* name, Isa* isa) {
  for (Isa candidate : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (std::strcmp(name, isa_name(candidate)) == 0) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

}  // namespace sparse24
