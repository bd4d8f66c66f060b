// sparse24::spmm on real threads (tests/test_core_cc.py builds it with ThreadSanitizer): for every
// ISA this CPU runs, each dtype and shapes cut into several row blocks and column tiles, the output
// computed with 2 and 3 threads must equal, bit for bit, the one computed on a single thread (every
// output element is one unit's, summed in a fixed order, whatever thread runs the unit). Exercises
// the panels packed on demand by whichever unit needs them first (spmm.cc, PanelPacks), their
// NaN/Inf flags (one x element is NaN, one Inf, in every case), and the early return on invalid
// meta (every thread count must refuse it). Prints "THREADS PASSED" or the first failure; not part
// of the op library (setup.py skips *_test.cc).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cc/sparse24/spmm.h"

extern "C" int sparse24_test_spmm(int dtype, int isa, const void* x, int64_t ldx,
                                  const void* values, const uint8_t* meta, int64_t m, int64_t k,
                                  int64_t n, void* y, int64_t ldy, int threads);

int main() {
  std::mt19937 rng(1);
  const uint8_t nibbles[6] = {0x4, 0x8, 0xc, 0x9, 0xd, 0xe};  // the valid position pairs
  struct Shape { int64_t m, k, n; };
  // Units (make_schedule's row blocks x column tiles), with AVX2's 48-row panels: 12 panels in 1
  // block x 16 tiles; 43 panels in 15 blocks x 1 tile; 21 panels in 6 blocks x 3 tiles; 7 panels
  // in 7 blocks x 2 tiles (K % 8 == 4); 5 panels in 5 blocks x 1 tile. With AVX-512's 96-row
  // panels: 6 in 1 x 16; 22 in 11 x 1; 11 in 6 x 3; 4 in 4 x 2; 3 in 3 x 1.
  const Shape shapes[] = {
      {530, 64, 4096}, {2048, 128, 96}, {1000, 256, 520}, {300, 44, 300}, {200, 40, 7}};
  int checked = 0;
  for (const int isa : {1, 2, 3, 4}) {  // sparse24::Isa: scalar, avx2, avx512, avx512bf16
    if (!sparse24::isa_supported(static_cast<sparse24::Isa>(isa))) continue;
    for (const int dtype : {0, 1, 2}) {  // float32, bfloat16, float16
      const int64_t size = dtype == 0 ? 4 : 2;
      for (const Shape& s : shapes) {
        // The scalar kernel has no panels (its units are 16-column tiles only): the three
        // smaller shapes give it 6, 19 and 1 tiles; the two big ones cost ~80 s under TSan.
        if (isa == 1 && s.m * s.k * s.n > (int64_t{32} << 20)) continue;
        // Small finite numbers in every dtype: 6 random low bits per byte.
        std::vector<uint8_t> x(s.m * s.k * size), values(s.n * s.k / 2 * size);
        for (uint8_t& b : x) b = rng() & 0x3f;
        for (uint8_t& b : values) b = rng() & 0x3f;
        std::vector<uint8_t> meta(s.n * ((s.k + 7) / 8));
        for (uint8_t& b : meta) b = nibbles[rng() % 6] | nibbles[rng() % 6] << 4;
        if (s.k % 8 == 4) {
          for (int64_t c = 0; c < s.n; ++c) meta[c * ((s.k + 7) / 8) + s.k / 8] &= 0x0f;
        }
        // One NaN and one Inf in x (rows in different panels), in this dtype's bits.
        const uint32_t nan = dtype == 0 ? 0x7fc00000u : dtype == 1 ? 0x7fc0u : 0x7e00u;
        const uint32_t inf = dtype == 0 ? 0x7f800000u : dtype == 1 ? 0x7f80u : 0x7c00u;
        std::memcpy(&x[((s.m / 3) * s.k + 1) * size], &nan, size);  // little-endian: low bytes
        std::memcpy(&x[((s.m - 1) * s.k + s.k - 2) * size], &inf, size);
        std::vector<uint8_t> one(s.m * s.n * size), many(s.m * s.n * size);
        for (const int threads : {1, 2, 3}) {
          std::vector<uint8_t>& y = threads == 1 ? one : many;
          std::memset(y.data(), 0xee, y.size());
          const int rc = sparse24_test_spmm(dtype, isa, x.data(), s.k, values.data(), meta.data(),
                                            s.m, s.k, s.n, y.data(), s.n, threads);
          if (rc != 0 || (threads > 1 && many != one)) {
            std::printf("FAIL isa %d dtype %d %ldx%ldx%ld, %d threads: %s\n", isa, dtype,
                        (long)s.m, (long)s.k, (long)s.n, threads,
                        rc != 0 ? "spmm failed" : "differs from one thread");
            return 1;
          }
        }
        // Invalid meta in the last column (positions (1, 1) in group 0): refused on every count.
        meta[(s.n - 1) * ((s.k + 7) / 8)] = 0x55;
        for (const int threads : {1, 2, 3}) {
          const int rc = sparse24_test_spmm(dtype, isa, x.data(), s.k, values.data(), meta.data(),
                                            s.m, s.k, s.n, many.data(), s.n, threads);
          if (rc != -2) {
            std::printf("FAIL isa %d dtype %d %ldx%ldx%ld, %d threads: invalid meta %s\n", isa,
                        dtype, (long)s.m, (long)s.k, (long)s.n, threads,
                        rc == 0 ? "accepted" : "gave another error");
            return 1;
          }
        }
        ++checked;
      }
    }
  }
  std::printf("THREADS PASSED (%d cases)\n", checked);
  return 0;
}
