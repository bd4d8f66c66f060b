// AVX512_BF16 panel SpMM for bfloat16 x and W: `vdpbf16ps` multiplies a group's two kept values
// (adjacent in the stored values row, so one 32-bit broadcast) with the matching two x elements of
// 16 rows and adds both products to float32 accumulators (bf16 products are exact in float32). One
// instruction and one x load do what two FMAs and two loads do in the float32 panel kernel.
//
// The pair pack (per call, from the activation x) holds, for each group of 4 k and each of the 6
// ascending position pairs a group can keep, the two x elements of every panel row side by side:
// [K/4][6][width] uint32 (low half: the lower k), 1.5x the float32 panel's bytes. The kernel then
// reads the pair a column keeps at the address its meta nibble selects, as the float32 kernel
// reads a row. Tiles, K blocks and the output store follow spmm_panel_impl.h. See docs/KERNELS.md.
//
// vdpbf16ps rounds to nearest even, reads bf16 subnormals (below 2^-126) as zero and flushes
// subnormal float32 results, whatever MXCSR says; the other kernels follow MXCSR. Inside
// TensorFlow, which runs kernels with denormals flushed, all agree: a 1e-39 bf16 x gives 0 from
// this kernel, from the avx512 one and from tf.matmul.
//
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on their own _mm512_undefined_*.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "cc/sparse24/spmm_panel_impl.h"

namespace sparse24 {
namespace spmm_internal {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kPairs = 6;  // ascending position pairs of a group: (0,1) (0,2) (0,3) (1,2) ...

// Slot of the pair a meta nibble (p0 | p1 << 2, p0 < p1) keeps, as 4-bit fields of one constant:
// 0x4 (0,1) -> 0, 0x8 (0,2) -> 1, 0xc (0,3) -> 2, 0x9 (1,2) -> 3, 0xd (1,3) -> 4, 0xe (2,3) -> 5.
// Other nibbles break the format (slot 0 here); meta_rows_valid rejects them before a kernel runs.
constexpr uint64_t kSlotOfNibble =
    (uint64_t{1} << 4 * 0x8) | (uint64_t{2} << 4 * 0xc) | (uint64_t{3} << 4 * 0x9) |
    (uint64_t{4} << 4 * 0xd) | (uint64_t{5} << 4 * 0xe);
constexpr int kPairLow[kPairs] = {0, 0, 0, 1, 1, 2}, kPairHigh[kPairs] = {1, 2, 3, 2, 3, 3};

constexpr int64_t slot(uint32_t nibble) { return (kSlotOfNibble >> (4 * nibble)) & 15; }

// vpermt2w indices building the pair panel row of slot p from two gathers A (rows 0-7) and B (rows
// 8-15) that hold each row's 4 elements of a group as one 64-bit lane: word 2i of the result is row
// i's element kPairLow[p], word 2i + 1 its element kPairHigh[p] (index bit 5 picks B).
struct PairIndices {
  __m512i slot[kPairs];
  PairIndices() {
    for (int p = 0; p < kPairs; ++p) {
      alignas(64) uint16_t words[32];
      for (int i = 0; i < 16; ++i) {
        const int base = 4 * (i % 8) + (i >= 8 ? 32 : 0);
        words[2 * i] = static_cast<uint16_t>(base + kPairLow[p]);
        words[2 * i + 1] = static_cast<uint16_t>(base + kPairHigh[p]);
      }
      slot[p] = _mm512_load_si512(words);
    }
  }
};

// Packs `rows` bf16 rows of x (stride ldx) into the pair panel of `width` rows (rows past `rows`
// zero) and sets bad[r] = row r holds NaN/Inf. 16 rows at a time: per group, two 8-lane gathers
// fetch the rows' 4 elements, six permutes make the six slots' rows.
void pack_pairs(const uint16_t* x, int64_t ldx, int64_t rows, int64_t K, int64_t width,
                uint32_t* xp, uint8_t* bad) {
  static const PairIndices indices;
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i row_bytes = _mm512_set1_epi64(ldx * 2);
  for (int64_t r0 = 0; r0 < width; r0 += 16) {
    const int64_t live = std::clamp<int64_t>(rows - r0, 0, 16);
    const __mmask8 live_a = static_cast<__mmask8>((1u << std::min<int64_t>(live, 8)) - 1);
    const __mmask8 live_b = static_cast<__mmask8>((1u << std::max<int64_t>(live - 8, 0)) - 1);
    const __m512i offsets_a = _mm512_mullo_epi64(lane, row_bytes);
    const __m512i offsets_b = _mm512_mullo_epi64(_mm512_add_epi64(lane, _mm512_set1_epi64(8)),
                                                 row_bytes);
    const char* rows16 = reinterpret_cast<const char*>(x + r0 * ldx);
    __mmask32 nonfinite_a = 0, nonfinite_b = 0;
    for (int64_t g = 0; g < K / 4; ++g) {
      const char* at = rows16 + 8 * g;
      const __m512i zero = _mm512_setzero_si512();
      const __m512i a = _mm512_mask_i64gather_epi64(zero, live_a, offsets_a, at, 1);
      const __m512i b = _mm512_mask_i64gather_epi64(zero, live_b, offsets_b, at, 1);
      nonfinite_a |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, exponent), exponent);
      nonfinite_b |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, exponent), exponent);
      uint32_t* out = xp + g * kPairs * width + r0;
      for (int p = 0; p < kPairs; ++p) {
        _mm512_storeu_si512(out + p * width, _mm512_permutex2var_epi16(a, indices.slot[p], b));
      }
    }
    for (int64_t i = 0; i < live; ++i) {
      bad[r0 + i] = ((i < 8 ? nonfinite_a >> (4 * i) : nonfinite_b >> (4 * (i - 8))) & 15) != 0;
    }
  }
}

// Word offsets, from a byte's first group, of the pair rows the byte's two nibbles select (low 16
// bits: group 2b's, high: group 2b + 1's) for a panel `width` words wide: one table load per meta
// byte instead of shifts and multiplies per group (5-10% faster on Zen 5, single thread).
struct ByteOffsets {
  uint32_t of[256] = {};
  constexpr explicit ByteOffsets(int64_t width) {
    for (uint32_t b = 0; b < 256; ++b) {
      of[b] = static_cast<uint32_t>(slot(b & 15) * width) |
              static_cast<uint32_t>((kPairs + slot(b >> 4)) * width) << 16;
    }
  }
};

// Accumulator sets for R registers per panel row: each set takes every S-th group, so R * S
// vdpbf16ps chains are in flight. Four for narrow panels (2 ran up to 25% slower at width 16, 6 at
// width 32 30% slower); two from R = 5 on, where four would take more than the 32 registers
// (R = 6 with 4 sets: 3% slower than with 2). Measured on Zen 5, single thread.
constexpr int sets_for(int R) { return R <= 4 ? 4 : 2; }

// Groups per K block: the pair panel's block near 24 KiB of L1 for the 4-set kernels (20 groups at
// width 48, 32 at 32, 64 at 16), near 36 KiB for the 2-set ones (16 groups at width 96), even, so a
// block starts at a whole meta byte. Measured on Zen 5 (single thread): at width 48, blocks of
// 16 KiB 5-11% slower, 32 KiB 0-10% slower, a fixed 16 groups 5-30% slower; at width 96, 24 KiB
// 3-4% slower, 48 KiB 1% slower (12 or 20 groups within 1% once a block served all columns).
constexpr int64_t block_groups(int64_t width, int sets) {
  return (sets == 2 ? 9216 : 6144) / (kPairs * width) / 2 * 2;
}

template <int R, int S>
struct PairKernel {
  static constexpr int64_t kWidth = R * kLanes;
  static constexpr ByteOffsets kOffsets{kWidth};
  static constexpr int64_t kBlockGroups = block_groups(kWidth, S);
  static_assert(S % 2 == 0, "accumulator sets are taken two groups (one meta byte) at a time");

  // acc += the x pairs of R registers at xr times the value pair at vals.
  static inline void step(const uint32_t* xr, const uint16_t* vals, __m512 (&acc)[R]) {
    uint32_t pair;
    std::memcpy(&pair, vals, sizeof(pair));
    const __m512bh v = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + r * kLanes));
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, v);
    }
  }

  // Both groups of meta byte j (the second only if `both`) into sets s and s + 1.
  static inline void byte(const uint32_t* xg, const uint16_t* vals, const uint8_t* meta,
                          const uint32_t* offsets, int64_t j, int s, bool both,
                          __m512 (&acc)[S][R]) {
    const uint32_t at = offsets[meta[j]];
    const uint32_t* x0 = xg + j * 2 * kPairs * kWidth;
    step(x0 + (at & 0xffff), vals + 4 * j, acc[s]);
    if (both) step(x0 + (at >> 16), vals + 4 * j + 2, acc[s + 1]);
  }

  // acc[s][r] accumulates one column over groups [g0, g0 + groups): xg is the pair panel at group
  // g0, vals the column's values from g0, meta its meta from the byte holding g0 (g0 even). Inlined
  // so a block's constant group count unrolls it completely (5-8% faster than a loop).
  static inline __attribute__((always_inline)) void run(const uint32_t* xg, const uint16_t* vals,
                                                        const uint8_t* meta, int64_t groups,
                                                        __m512 (&acc)[S][R]) {
    const int64_t bytes = groups / 2;
    int64_t j = 0;
#pragma GCC unroll 16
    for (; j + S / 2 <= bytes; j += S / 2) {
#pragma GCC unroll 8
      for (int s = 0; s < S; s += 2) byte(xg, vals, meta, kOffsets.of, j + s / 2, s, true, acc);
    }
    for (; j < bytes; ++j) byte(xg, vals, meta, kOffsets.of, j, 0, true, acc);
    if (groups & 1) byte(xg, vals, meta, kOffsets.of, bytes, 0, false, acc);
  }

  // One panel (rows m0 .. m0 + rows) times columns [n0, n1) (at most kMaxCols), written to y:
  // each K block of pair rows, in L1, serves all the columns before the next, as in
  // spmm_panel_impl.h's kernel; the columns' partial sums live in `sums` between blocks.
  static void columns(const SpmmWork& w, const uint32_t* xp, int64_t m0, int64_t rows,
                      int64_t n0, int64_t n1) {
    const int64_t half_k = w.K / 2, meta_row = (w.K + 7) / 8, groups = w.K / 4;
    const auto* values = static_cast<const uint16_t*>(w.values);
    alignas(64) float sums[panel::kMaxCols * kWidth];  // 96 KiB of stack at width 96
    for (int64_t gb = 0; gb < groups; gb += kBlockGroups) {
      const int64_t count = std::min(groups - gb, kBlockGroups);
      const uint32_t* xg = xp + gb * kPairs * kWidth;
      for (int64_t n = n0; n < n1; ++n) {
        __m512 acc[S][R];
        float* sum = sums + (n - n0) * kWidth;
        for (int s = 0; s < S; ++s) {
          for (int r = 0; r < R; ++r) {
            acc[s][r] = (s == 0 && gb > 0) ? _mm512_loadu_ps(sum + r * kLanes)
                                           : _mm512_setzero_ps();
          }
        }
        const uint16_t* vals = values + n * half_k + 2 * gb;
        if (n + panel::kPrefetchCols < n1) {
          const char* next = reinterpret_cast<const char*>(vals + panel::kPrefetchCols * half_k);
          for (int64_t i = 0; i < 4 * count; i += 64) __builtin_prefetch(next + i);
        }
        const uint8_t* meta = w.meta + n * meta_row + gb / 2;
        if (count == kBlockGroups) {
          run(xg, vals, meta, kBlockGroups, acc);
        } else {
          run(xg, vals, meta, count, acc);
        }
        for (int r = 0; r < R; ++r) {
          for (int s = 1; s < S; ++s) acc[0][r] = _mm512_add_ps(acc[0][r], acc[s][r]);
          _mm512_storeu_ps(sum + r * kLanes, acc[0][r]);
        }
      }
    }
    panel::store_tile(w, kWidth, sums, m0, rows, n0, n1);
  }
};

template <int R>
using Pairs = PairKernel<R, sets_for(R)>;

int64_t panel_width(int64_t rows) { return panel::panel_regs(rows, kLanes) * kLanes; }

}  // namespace

void spmm_pairs_avx512bf16(const SpmmWork& w, int64_t n0, int64_t n1) {
  panel::for_each_panel<Pairs, kLanes, kPanelRowsAvx512>(
      w, reinterpret_cast<const uint32_t*>(w.xt), pair_panel_words(w.K), n0, n1);
}

void pack_pairs_avx512bf16(DType dtype, const void* x, int64_t ldx, int64_t rows, int64_t K,
                           float* xt, uint8_t* bad) {
  (void)dtype;  // bfloat16 only: the plan picks this pack for bfloat16 x alone
  pack_pairs(static_cast<const uint16_t*>(x), ldx, rows, K, panel_width(rows),
             reinterpret_cast<uint32_t*>(xt), bad);
}

}  // namespace spmm_internal
}  // namespace sparse24
