#include "cc/sparse24/group_scores.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace sparse24 {
namespace {

constexpr int kLanes = 8;            // independent accumulators: the compiler vectorizes them
constexpr int64_t kBlockRows = 2048;  // rows summed in float32 (256 per lane) before float64

inline float top2(float x0, float x1, float x2, float x3) {
  const float hi01 = std::max(x0, x1), lo01 = std::min(x0, x1);
  const float hi23 = std::max(x2, x3), lo23 = std::min(x2, x3);
  return std::max(hi01, hi23) + std::max(std::min(hi01, hi23), std::max(lo01, lo23));
}

double group_sum(const float* a, const float* b, const float* c, const float* d, int64_t rows) {
  double total = 0.0;
  for (int64_t begin = 0; begin < rows; begin += kBlockRows) {
    const int64_t end = std::min(rows, begin + kBlockRows);
    float lanes[kLanes] = {};
    int64_t r = begin;
    for (; r + kLanes <= end; r += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += top2(a[r + l], b[r + l], c[r + l], d[r + l]);
    }
    for (; r < end; ++r) lanes[0] += top2(a[r], b[r], c[r], d[r]);
    for (float lane : lanes) total += lane;
  }
  return total;
}

void score_range(const float* magnitudes, int64_t rows, const int64_t* groups, int64_t begin,
                 int64_t end, double* out) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t* g = groups + 4 * i;
    out[i] = group_sum(magnitudes + g[0] * rows, magnitudes + g[1] * rows, magnitudes + g[2] * rows,
                       magnitudes + g[3] * rows, rows);
  }
}

}  // namespace

void top2_group_sums(const float* magnitudes, int64_t rows, const int64_t* groups, int64_t count,
                     double* out, int threads) {
  constexpr int64_t kWorkPerThread = int64_t{1} << 20;  // rows x groups worth a thread start
  const int64_t useful = std::max<int64_t>(1, count * rows / kWorkPerThread);
  const int64_t workers = std::min<int64_t>({std::max(threads, 1), useful, count});
  if (workers <= 1) {
    score_range(magnitudes, rows, groups, 0, count, out);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t step = (count + workers - 1) / workers;
  for (int64_t begin = step; begin < count; begin += step) {
    pool.emplace_back(score_range, magnitudes, rows, groups, begin, std::min(count, begin + step),
                      out);
  }
  score_range(magnitudes, rows, groups, 0, std::min(count, step), out);
  for (auto& worker : pool) worker.join();
}

}  // namespace sparse24
