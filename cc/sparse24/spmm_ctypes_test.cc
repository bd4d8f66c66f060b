// C entry points over sparse24::spmm for tests/test_spmm_kernels.py (loaded with ctypes) and
// bench/matmul.py --core. Not part of the op library (setup.py skips *_test.cc).
#include <algorithm>
#include <cstdint>
#include <new>
#include <thread>
#include <vector>

#include "cc/sparse24/spmm.h"

namespace {

// Splits [0, total) into uneven chunks run on `threads` std::threads, so tests see the kernels
// called on ranges that start and end anywhere (as TensorFlow's pool may do).
sparse24::ParallelFor thread_pool(int threads) {
  return [threads](int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
    if (threads <= 1 || total <= 1) {
      if (total > 0) fn(0, total);
      return;
    }
    std::vector<std::pair<int64_t, int64_t>> chunks;
    int64_t begin = 0, step = std::max<int64_t>(1, total / (2 * threads + 1));
    for (int i = 0; begin < total; ++i) {
      const int64_t end = std::min(total, begin + step + (i % 2));
      chunks.emplace_back(begin, end);
      begin = end;
    }
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        for (size_t c = t; c < chunks.size(); c += threads) fn(chunks[c].first, chunks[c].second);
      });
    }
    for (auto& worker : workers) worker.join();
  };
}

}  // namespace

extern "C" {

int sparse24_test_isa_supported(int isa) {
  return sparse24::isa_supported(static_cast<sparse24::Isa>(isa)) ? 1 : 0;
}

// dtype: 0 float32, 1 bfloat16, 2 float16; isa: sparse24::Isa. Returns 0, -1 if isa unsupported,
// -2 if spmm rejected the meta, or -3 if it ran out of memory (std::bad_alloc).
int sparse24_test_spmm(int dtype, int isa, const void* x, int64_t ldx, const void* values,
                       const uint8_t* meta, int64_t m, int64_t k, int64_t n, void* y, int64_t ldy,
                       int threads) {
  const auto which = static_cast<sparse24::Isa>(isa);
  if (!sparse24::isa_supported(which)) return -1;
  const sparse24::SpmmArgs args{static_cast<sparse24::DType>(dtype), x, ldx, values, meta, m, k, n,
                                y, ldy};
  try {
    return sparse24::spmm(args, which, thread_pool(threads)).empty() ? 0 : -2;
  } catch (const std::bad_alloc&) {
    return -3;
  }
}

}  // extern "C"
