// Scores of 4-channel groups for the channel-permutation search (tf_sparse24/permute_search.py).
//
// A group's score is the magnitude 2:4 keeps of it: the sum over rows of the two largest of its
// four channels' |w|. The search scores millions of candidate groups, so this is its hot loop
// (numpy needed ~8 ns per row and group; this loop well under 1). Framework-free; Python reaches
// it through the op library's C entry point `tf_sparse24_top2_group_sums`.
#ifndef TF_SPARSE24_CC_SPARSE24_GROUP_SCORES_H_
#define TF_SPARSE24_CC_SPARSE24_GROUP_SCORES_H_

#include <cstdint>

namespace sparse24 {

// magnitudes: [channels, rows] float32, row-major, non-negative; groups: [count, 4] channel
// indices, each in [0, channels) (not checked: the caller builds them); out: [count] float64.
// Partial sums are float32 over at most 256 rows per lane, then float64. Runs on up to `threads`
// std::threads when the work is large enough to pay for them.
void top2_group_sums(const float* magnitudes, int64_t rows, const int64_t* groups, int64_t count,
                     double* out, int threads);

}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_GROUP_SCORES_H_
