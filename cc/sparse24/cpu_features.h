// Instruction-set variants of the CPU kernels and the run-time check that picks one (framework-free).
#ifndef TF_SPARSE24_CC_SPARSE24_CPU_FEATURES_H_
#define TF_SPARSE24_CC_SPARSE24_CPU_FEATURES_H_

namespace sparse24 {

// kAvx512Bf16: the AVX-512 kernels plus, for bfloat16, a panel kernel on AVX512_BF16's vdpbf16ps.
enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Bf16 };

// True if this CPU and OS can run `isa` (CPUID + XGETBV, read once, thread-safe). kAuto: always.
bool isa_supported(Isa isa);

// The fastest variant this CPU supports; kAuto resolves to it.
Isa best_isa();

const char* isa_name(Isa isa);

// Parses "auto", "scalar", "avx2", "avx512" or "avx512bf16" (isa_name's spellings); false for
// anything else.
bool parse_isa(const char* name, Isa* isa);

}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_CPU_FEATURES_H_
