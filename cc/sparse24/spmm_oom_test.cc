// sparse24::spmm out of memory on a worker thread (tests/test_core_cc.py builds and runs it, without
// sanitizers: they bring their own operator new). The AVX2 GEMV kernel allocates its reordered rows
// of x (4 x K floats) on whichever thread runs a unit; this program replaces the global operator new
// with one that refuses requests above a limit, runs a GEMV-shaped product whose units all run on
// std::threads, and requires spmm to report std::bad_alloc on the calling thread (the ctypes entry
// point returns -3) instead of the process terminating. With the limit lifted, the same call must
// then give the output a single unlimited thread gives. Prints "OOM PASSED" or the first failure.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <new>
#include <random>
#include <vector>

#include "cc/sparse24/spmm.h"

namespace {
std::atomic<size_t> allocation_limit{std::numeric_limits<size_t>::max()};
}  // namespace

void* operator new(size_t bytes) {
  if (bytes > allocation_limit.load(std::memory_order_relaxed)) throw std::bad_alloc();
  if (void* p = std::malloc(bytes ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t bytes) { return operator new(bytes); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

extern "C" int sparse24_test_spmm(int dtype, int isa, const void* x, int64_t ldx,
                                  const void* values, const uint8_t* meta, int64_t m, int64_t k,
                                  int64_t n, void* y, int64_t ldy, int threads);

int main() {
  constexpr int kAvx2 = 2;  // sparse24::Isa::kAvx2: the variant whose GEMV allocates per unit
  if (!sparse24::isa_supported(sparse24::Isa::kAvx2)) {
    std::printf("OOM SKIPPED: this CPU cannot run avx2\n");
    return 0;
  }
  // M = 2 rows: the GEMV kernel. Its scratch is 4 x K floats = 2 MiB; everything else spmm
  // allocates (NaN flags of M rows, the threads' bookkeeping) stays far below the 256 KiB limit.
  const int64_t m = 2, k = int64_t{1} << 17, n = 512;  // 8 column tiles of 64: several units
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> x(m * k), values(n * k / 2);
  for (float& v : x) v = dist(rng);
  for (float& v : values) v = dist(rng);
  const uint8_t nibbles[6] = {0x4, 0x8, 0xc, 0x9, 0xd, 0xe};
  std::vector<uint8_t> meta(n * (k / 8));
  for (uint8_t& b : meta) b = nibbles[rng() % 6] | nibbles[rng() % 6] << 4;
  std::vector<float> expected(m * n, -7.f), y(m * n, -7.f);
  if (sparse24_test_spmm(0, kAvx2, x.data(), k, values.data(), meta.data(), m, k, n,
                         expected.data(), n, 1) != 0) {
    std::printf("FAIL: the unlimited single-thread product failed\n");
    return 1;
  }
  for (const int threads : {2, 3}) {
    allocation_limit.store(256 << 10);
    const int rc = sparse24_test_spmm(0, kAvx2, x.data(), k, values.data(), meta.data(), m, k, n,
                                      y.data(), n, threads);
    allocation_limit.store(std::numeric_limits<size_t>::max());
    if (rc != -3) {
      std::printf("FAIL: %d threads under the limit returned %d, not -3 (out of memory)\n",
                  threads, rc);
      return 1;
    }
    const int again = sparse24_test_spmm(0, kAvx2, x.data(), k, values.data(), meta.data(), m, k,
                                         n, y.data(), n, threads);
    if (again != 0 || y != expected) {
      std::printf("FAIL: %d threads without the limit: %s\n", threads,
                  again != 0 ? "spmm failed" : "differs from one thread");
      return 1;
    }
  }
  std::printf("OOM PASSED\n");
  return 0;
}
