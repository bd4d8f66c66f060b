// Microbenchmark of sparse24::spmm: one thread by default, timed in thread CPU time (other load
// on the machine skews it less than wall time); with threads > 1, the work units are shared by that
// many std::threads, as TF's pool shares them, and timed in wall time. Unlike TF's pool, the
// threads are started for each call, and their start (tens of microseconds) is in the time. Not
// part of the op library or the tests.
//   g++ -std=c++17 -O3 -I. bench/spmm_core_bench.cc cc/sparse24/spmm*.cc (minus *_test.cc)
//       cc/sparse24/cpu_features.cc cc/sparse24/format.cc -lpthread, each *_avx2.cc, *_avx512.cc
//       and *_avx512bf16.cc with its ISA flags from setup.py
//   ./a.out M K N [isa: 1 scalar, 2 avx2, 3 avx512, 4 avx512bf16] [dtype: 0 f32, 1 bf16, 2 f16]
//       [reps] [threads]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "cc/sparse24/spmm.h"

namespace {

double seconds(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s M K N [isa] [dtype] [reps]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const auto isa = static_cast<sparse24::Isa>(argc > 4 ? std::atoi(argv[4]) : 0);
  const auto dtype = static_cast<sparse24::DType>(argc > 5 ? std::atoi(argv[5]) : 0);
  const int reps = argc > 6 ? std::atoi(argv[6]) : 10;
  const int threads = argc > 7 ? std::max(1, std::atoi(argv[7])) : 1;
  const clockid_t clock = threads > 1 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID;
  if (!sparse24::isa_supported(isa)) {
    std::fprintf(stderr, "isa %s not supported here\n", sparse24::isa_name(isa));
    return 1;
  }
  const int64_t es = sparse24::dtype_size(dtype);
  std::mt19937 rng(0);
  std::vector<char> x(M * K * es), values(N * K / 2 * es), y(M * N * es);
  for (auto& b : x) b = static_cast<char>(rng() & 0x3f);  // small finite numbers in every dtype
  for (auto& b : values) b = static_cast<char>(rng() & 0x3f);
  std::vector<uint8_t> meta(N * ((K + 7) / 8));
  const uint8_t nibbles[6] = {0x4, 0x8, 0xc, 0x9, 0xd, 0xe};  // ascending position pairs
  for (auto& b : meta) b = nibbles[rng() % 6] | (nibbles[rng() % 6] << 4);
  sparse24::SpmmArgs args{dtype, x.data(), K, values.data(), meta.data(), M, K, N, y.data(), N};
  // Splits [0, total) into `threads` ranges, one per thread (spmm's tasks then take their work
  // units from a shared counter, whatever range they were handed).
  sparse24::ParallelFor parallel_for = [threads](int64_t total, int64_t,
                                                 const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t parts = std::min<int64_t>(threads, total);
    std::vector<std::thread> others;
    for (int64_t p = 1; p < parts; ++p) {
      others.emplace_back(
          [&fn, p, parts, total] { fn(total * p / parts, total * (p + 1) / parts); });
    }
    if (parts > 0) fn(0, total / parts);
    for (std::thread& t : others) t.join();
  };
  std::vector<double> times;
  for (int r = 0; r <= reps; ++r) {
    const double t0 = seconds(clock);
    if (!sparse24::spmm(args, isa, parallel_for).empty()) return 1;
    if (r > 0) times.push_back(seconds(clock) - t0);  // first run warms caches
  }
  std::sort(times.begin(), times.end());
  const double t = times[times.size() / 2];
  const double bytes = N * K / 2.0 * es + meta.size() + M * K * es + M * N * es;
  std::printf("%s M=%lld K=%lld N=%lld, %d thread(s): %.3f ms (min %.3f)  %.1f useful GFLOP/s  "
              "%.2f GB/s\n",
              sparse24::isa_name(isa), (long long)M, (long long)K, (long long)N, threads, t * 1e3,
              times[0] * 1e3, M * K * N / t / 1e9, bytes / t / 1e9);
  return 0;
}
