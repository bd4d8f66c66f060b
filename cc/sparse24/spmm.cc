// SpMM dispatch: picks the kernel for the ISA and shape, prepares x once per call (float32 copy, or
// packed panels made as the work units first need them; x is the activation, so this is not weight
// repacking), splits the output over the caller's thread pool, and makes NaN/Inf in x propagate as
// in a dense matmul.
#include "cc/sparse24/spmm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <vector>

#include "cc/sparse24/format.h"
#include "cc/sparse24/spmm_kernels.h"

namespace sparse24 {
namespace {

using spmm_internal::SpmmKernel;
using spmm_internal::SpmmWork;

// Up to this many rows the SIMD paths run the GEMV kernel (x rows stay in L1 and are gathered with
// in-register permutes); above it the panel kernel (vectorized over rows of packed x^T).
constexpr int64_t kGemvMaxRows = 4;

struct Plan {
  SpmmKernel kernel;
  spmm_internal::PanelPack pack;  // panel kernels: packs x (null: kernel reads float32 rows)
  int64_t tile;                   // output columns per parallel work unit
  int64_t row_words;              // panel kernels: words (floats) per row of x in the pack
  int64_t panel_rows;             // panel kernels: rows of x per panel
  bool panel() const { return pack != nullptr; }
};

Plan make_plan(Isa isa, DType dtype, int64_t M, int64_t K, int64_t N) {
  // Panel tiles are wide (each tile streams every x^T panel once) but leave about 32 units, so the
  // threads stay balanced when N is small (768 columns -> 32 tiles of 24, 3072 -> 32 of 96).
  const int64_t panel_tile = std::clamp<int64_t>((N / 32 + 7) / 8 * 8, 16, 256);
  switch (isa) {
    case Isa::kAvx512Bf16:
      if (M > kGemvMaxRows && dtype == DType::kBFloat16) {
        return {spmm_internal::spmm_pairs_avx512bf16, spmm_internal::pack_pairs_avx512bf16,
                panel_tile, spmm_internal::pair_panel_words(K), spmm_internal::kPanelRowsAvx512};
      }
      [[fallthrough]];  // float32 and float16, and GEMV shapes: the AVX-512 kernels
    case Isa::kAvx512:
      if (M > kGemvMaxRows) {
        return {spmm_internal::spmm_panel_avx512, spmm_internal::pack_panel_avx512, panel_tile, K,
                spmm_internal::kPanelRowsAvx512};
      }
      return {spmm_internal::spmm_gemv_avx512, nullptr, 64, 0, 0};
    case Isa::kAvx2:
      if (M > kGemvMaxRows) {
        return {spmm_internal::spmm_panel_avx2, spmm_internal::pack_panel_avx2, panel_tile, K,
                spmm_internal::kPanelRowsAvx2};
      }
      return {spmm_internal::spmm_gemv_avx2, nullptr, 64, 0, 0};
    case Isa::kAuto:
    case Isa::kScalar:
      break;
  }
  return {spmm_internal::spmm_rows_scalar, nullptr, 16, 0, 0};
}

// Parallel work units: output column tiles times blocks of whole panels (rows). A tile's values
// (at most 256 columns: 256 KiB at K = 512 in float32) stay in L2 while the panels of its row block
// stream past, and each K block of a panel in L1 serves the whole tile. Up to 144 rows only the
// columns are split (the plan's tile). With more (M = 2048) the tiles are wide and the rows
// split too, rather than 16 narrow column tiles each streaming all of x^T from L3. Units run row
// block major (consecutive units walk the column tiles of one row block), and a row block's pack
// is made when its first unit starts (PanelPacks) and is at most kBlockPackBytes (or one panel's,
// if that is larger), so it is still in L3 while every column tile passes it.
struct Schedule {
  int64_t tile;        // output columns per unit
  int64_t block_rows;  // rows per unit (a multiple of the plan's panel rows, or M)
  int64_t col_tiles, row_blocks;

  // Unit u's first row and first column.
  int64_t row(int64_t u) const { return u / col_tiles * block_rows; }
  int64_t col(int64_t u) const { return u % col_tiles * tile; }
};

Schedule make_schedule(const Plan& plan, int64_t M, int64_t N) {
  constexpr int64_t kMinUnits = 16, kWideTile = 256, kColumnsOnlyRows = 144;
  constexpr int64_t kBlockPackBytes = int64_t{8} << 20;
  if (!plan.panel() || M <= kColumnsOnlyRows) {
    return {plan.tile, M, (N + plan.tile - 1) / plan.tile, 1};
  }
  const int64_t panels = (M + plan.panel_rows - 1) / plan.panel_rows;
  const int64_t tile = std::min<int64_t>(kWideTile, (N + 7) / 8 * 8);
  const int64_t col_tiles = (N + tile - 1) / tile;
  const int64_t wanted_blocks = std::min(panels, (kMinUnits + col_tiles - 1) / col_tiles);
  const int64_t fitting_panels =
      std::max<int64_t>(1, kBlockPackBytes / (plan.panel_rows * plan.row_words * sizeof(float)));
  const int64_t wanted_panels = (panels + wanted_blocks - 1) / wanted_blocks;
  const int64_t block_panels = std::min(wanted_panels, fitting_panels);
  return {tile, block_panels * plan.panel_rows, col_tiles,
          (panels + block_panels - 1) / block_panels};
}

bool is_nonfinite(DType dtype, const void* p, int64_t i) {
  if (dtype == DType::kFloat32) {
    uint32_t bits;
    std::memcpy(&bits, static_cast<const float*>(p) + i, sizeof(bits));
    return (bits & 0x7f800000u) == 0x7f800000u;
  }
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dtype == DType::kBFloat16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
}

// Element access per dtype, as compile-time types so the preparation loops vectorize.
template <DType D>
struct Elem;
template <>
struct Elem<DType::kFloat32> {
  using Bits = uint32_t;
  static constexpr Bits kExp = 0x7f800000u;  // all-ones exponent: Inf or NaN
  static float f32(Bits b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  }
};
template <>
struct Elem<DType::kBFloat16> {
  using Bits = uint16_t;
  static constexpr Bits kExp = 0x7f80u;
  static float f32(Bits b) { return bf16_to_f32(b); }
};
template <>
struct Elem<DType::kFloat16> {
  using Bits = uint16_t;
  static constexpr Bits kExp = 0x7c00u;
  static float f32(Bits b) { return f16_to_f32(b); }
};

// Marks rows [m0, m1) of x holding NaN/Inf in `bad`; with `rows`, also writes their float32 copy
// (row stride K).
template <DType D>
void convert_rows(const SpmmArgs& a, int64_t m0, int64_t m1, float* rows, uint8_t* bad) {
  using E = Elem<D>;
  for (int64_t m = m0; m < m1; ++m) {
    const typename E::Bits* src = static_cast<const typename E::Bits*>(a.x) + m * a.ldx;
    typename E::Bits any = 0;
    for (int64_t k = 0; k < a.K; ++k) any |= ((src[k] & E::kExp) == E::kExp);
    bad[m] = any != 0;
    if (rows != nullptr) {
      for (int64_t k = 0; k < a.K; ++k) rows[m * a.K + k] = E::f32(src[k]);
    }
  }
}

// x's panels for the panel kernels (plan.panel_rows rows each), each packed by the first unit that
// needs it; units of the same row block running at once share its panels' packing and wait for the
// rest. Packing all of x before any unit ran left the early row blocks' packs in memory by the time
// their units read them: one thread, bfloat16, 14.5 -> 12.1 ms at 2048x2048x512, 26.9 -> 22.8 ms
// at 960x4096x1024 (docs/KERNELS.md). A panel is claimed by one thread and packed at once, so a
// waiting thread only waits for packing in progress (never for a thread that is itself waiting).
class PanelPacks {
 public:
  PanelPacks(const SpmmArgs& a, const Plan& plan, float* xt, uint8_t* bad)
      : a_(a), plan_(plan), xt_(xt), bad_(bad),
        state_(new std::atomic<uint8_t>[(a.M + plan.panel_rows - 1) / plan.panel_rows]()) {}

  // Rows [m0, m0 + rows) are packed into xt (their NaN/Inf flags into bad) when this returns.
  void ensure(int64_t m0, int64_t rows) {
    const int64_t size = plan_.panel_rows;
    const int64_t p0 = m0 / size, p1 = (m0 + rows + size - 1) / size;
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t unpacked = kUnpacked;
      if (state_[p].compare_exchange_strong(unpacked, kPacking, std::memory_order_relaxed)) {
        const int64_t first = p * size, count = std::min(size, a_.M - first);
        plan_.pack(a_.dtype,
                   static_cast<const char*>(a_.x) + first * a_.ldx * dtype_size(a_.dtype), a_.ldx,
                   count, a_.K, xt_ + first * plan_.row_words, bad_ + first);
        state_[p].store(kPacked, std::memory_order_release);
      }
    }
    for (int64_t p = p0; p < p1; ++p) {
      while (state_[p].load(std::memory_order_acquire) != kPacked) std::this_thread::yield();
    }
  }

 private:
  static constexpr uint8_t kUnpacked = 0, kPacking = 1, kPacked = 2;
  const SpmmArgs& a_;
  const Plan& plan_;
  float* xt_;
  uint8_t* bad_;
  std::unique_ptr<std::atomic<uint8_t>[]> state_;
};

// Float32 rows of x for the GEMV and scalar kernels (a converted copy unless x is float32).
template <DType D>
void prepare_rows(const SpmmArgs& a, const ParallelFor& parallel_for, float* rows, uint8_t* bad) {
  parallel_for(a.M, a.K * 2,
               [&](int64_t m0, int64_t m1) { convert_rows<D>(a, m0, m1, rows, bad); });
}

// A dense matmul multiplies every x[m, k] with W[k, n], zeros included, so a NaN/Inf x[m, k] at a
// position the 2:4 kernel skipped (W[k, n] == 0) makes y[m, n] NaN. Kept positions already went
// through the kernel, so only skipped ones need this fix-up; it runs only for rows with NaN/Inf.
void propagate_nonfinite(const SpmmArgs& a, const uint8_t* bad) {
  const int64_t meta_row = (a.K + 7) / 8;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> ks;
  for (int64_t m = 0; m < a.M; ++m) {
    if (!bad[m]) continue;
    ks.clear();
    for (int64_t k = 0; k < a.K; ++k) {
      if (is_nonfinite(a.dtype, a.x, m * a.ldx + k)) ks.push_back(k);
    }
    for (int64_t n = 0; n < a.N; ++n) {
      const uint8_t* meta = a.meta + n * meta_row;
      for (int64_t k : ks) {
        const int64_t g = k / 4, pos = k % 4;
        const unsigned bits = meta[g >> 1] >> ((g & 1) * 4);
        if (pos != (bits & 3u) && pos != ((bits >> 2) & 3u)) {
          spmm_internal::store_f32(a.dtype, a.y, m * a.ldy + n, nan);
          break;
        }
      }
    }
  }
}

// Memory for packed x. Up to kRetainedPackBytes it is the calling thread's buffer, kept between
// calls and grown when a call needs more: a fresh allocation of that size every call is fresh pages
// from the OS above glibc's mmap threshold (32 MiB at most), one page fault per 4 KiB, 10-15% of an
// M = 2048, K = 4096 call on Zen 5. Larger packs are allocated for the call alone, so a thread
// never holds more than kRetainedPackBytes after a call. Pool threads that run the units only read
// the buffer, and spmm is never re-entered on a thread while a call is running.
class PackMemory {
 public:
  explicit PackMemory(int64_t floats) {
    constexpr int64_t kRetainedPackBytes = int64_t{64} << 20;
    if (floats * static_cast<int64_t>(sizeof(float)) > kRetainedPackBytes) {
      own_.reset(new float[floats]);
      data_ = own_.get();
      return;
    }
    thread_local std::unique_ptr<float[]> buffer;
    thread_local int64_t capacity = 0;
    if (floats > capacity) {
      buffer.reset();  // before the new allocation, so the two never coexist
      capacity = 0;    // stays 0 if the allocation throws
      buffer.reset(new float[floats]);
      capacity = floats;
    }
    data_ = buffer.get();
  }
  float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> own_;
  float* data_;
};

}  // namespace

std::string spmm(const SpmmArgs& a, Isa isa, const ParallelFor& parallel_for) {
  if (a.M <= 0 || a.N <= 0) return validate_meta(a.meta, a.K, 0, std::max<int64_t>(a.N, 0));
  if (a.K == 0) {
    for (int64_t m = 0; m < a.M; ++m) {
      for (int64_t n = 0; n < a.N; ++n) spmm_internal::store_f32(a.dtype, a.y, m * a.ldy + n, 0.f);
    }
    return std::string();
  }
  if (isa == Isa::kAuto) isa = best_isa();
  const Plan plan = make_plan(isa, a.dtype, a.M, a.K, a.N);

  SpmmWork w{a.dtype, a.M, a.K, a.N, a.values, a.meta, nullptr, 0, nullptr, a.y, a.ldy};
  std::vector<uint8_t> bad(a.M);
  std::unique_ptr<float[]> rows;
  std::optional<PackMemory> pack_memory;
  float* xt = nullptr;
  if (plan.panel()) {
    // 64-byte aligned: a panel row is whole cache lines, so no SIMD load of it splits a line.
    pack_memory.emplace((a.M + plan.panel_rows) * plan.row_words + 16);
    xt = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(pack_memory->data()) + 63) & ~uintptr_t{63});
    w.xt = xt;
  } else if (a.dtype != DType::kFloat32) {
    rows.reset(new float[a.M * a.K]);
    w.x = rows.get();
    w.ldx = a.K;
  } else {
    w.x = static_cast<const float*>(a.x);
    w.ldx = a.ldx;
  }
  std::optional<PanelPacks> packs;
  if (plan.panel()) {
    packs.emplace(a, plan, xt, bad.data());
  } else if (a.dtype == DType::kFloat32) {
    prepare_rows<DType::kFloat32>(a, parallel_for, nullptr, bad.data());
  } else if (a.dtype == DType::kBFloat16) {
    prepare_rows<DType::kBFloat16>(a, parallel_for, rows.get(), bad.data());
  } else {
    prepare_rows<DType::kFloat16>(a, parallel_for, rows.get(), bad.data());
  }

  // Consecutive units reuse one row block's pack (Schedule). Each task the pool runs takes units
  // from a shared counter until none are left (not the block it was handed), so a thread slowed by
  // other load on the machine takes fewer units instead of finishing last.
  const Schedule s = make_schedule(plan, a.M, a.N);
  const int64_t units = s.col_tiles * s.row_blocks;
  const int64_t cost = s.tile * std::min(a.M, s.block_rows) * a.K / 8 + 1;
  std::atomic<bool> meta_ok{true}, out_of_memory{false};
  std::atomic<int64_t> next_unit{0};
  parallel_for(units, cost, [&](int64_t, int64_t) {
    // A kernel's scratch (the AVX2 GEMV's reordered x) is allocated on whichever thread runs the
    // unit; std::bad_alloc escaping a pool thread would terminate the process, so it stops the
    // remaining units here and is thrown again on the calling thread below.
    try {
      for (int64_t u; (u = next_unit.fetch_add(1, std::memory_order_relaxed)) < units;) {
        const int64_t n0 = s.col(u), m0 = s.row(u);
        const int64_t n1 = std::min(a.N, n0 + s.tile);
        if (!meta_rows_valid(a.meta, a.K, n0, n1)) {
          meta_ok.store(false, std::memory_order_relaxed);
          continue;
        }
        SpmmWork part = w;
        part.M = std::min(a.M - m0, s.block_rows);
        if (plan.panel()) {
          packs->ensure(m0, part.M);
          part.xt = w.xt + m0 * plan.row_words;
        }
        part.y = static_cast<char*>(a.y) + m0 * a.ldy * dtype_size(a.dtype);
        plan.kernel(part, n0, n1);
      }
    } catch (const std::bad_alloc&) {
      out_of_memory.store(true, std::memory_order_relaxed);
      next_unit.store(units, std::memory_order_relaxed);
    }
  });

  if (out_of_memory.load()) throw std::bad_alloc();
  if (!meta_ok.load()) return validate_meta(a.meta, a.K, 0, a.N);
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) propagate_nonfinite(a, bad.data());
  return std::string();
}

}  // namespace sparse24
