// The sparse24/v1 compressed format: compress, decompress and meta validation (framework-free).
//
// W [K, N] row-major (Keras kernel layout, 2:4 along K) <-> values [N, K/2] + meta [N, ceil(K/8)].
// tf_sparse24/format.py is the definition and docs/FORMAT.md describes it byte by byte; these
// functions match it bit for bit. They work on bit patterns (an element is non-zero unless all its
// bits but the sign are clear), so they need no float arithmetic and keep NaN payloads.
// Errors are returned as a message (empty string: success) with the same wording as format.py.
#ifndef TF_SPARSE24_CC_SPARSE24_FORMAT_H_
#define TF_SPARSE24_CC_SPARSE24_FORMAT_H_

#include <cstdint>
#include <string>

#include "cc/sparse24/dtype.h"

namespace sparse24 {

// ceil(K/8) for K >= 0, without the K + 7 that overflows int64 at K = 2^63 - 4 (a valid K for an
// empty weight: values [0, K/2], meta [0, 2^60]).
inline int64_t meta_cols(int64_t k) { return k / 8 + (k % 8 != 0 ? 1 : 0); }

// dense [K, N] -> values [N, K/2], meta [N, ceil(K/8)]. Precondition: K % 4 == 0. On a group with
// more than two non-zeros returns a message naming the first one in W's memory order (group g, then
// column n); the outputs are then unspecified.
std::string compress(DType dtype, const void* dense, int64_t k, int64_t n, void* values,
                     uint8_t* meta);

// Checks meta rows [row_begin, row_end) of a [N, ceil(K/8)] array: in every group the two positions
// are strictly ascending and, when K % 8 == 4, every row's last high nibble is 0. Reports the first
// bad group in (row, group) order, then the first bad high nibble (format.check_meta's order).
std::string validate_meta(const uint8_t* meta, int64_t k, int64_t row_begin, int64_t row_end);

// validate_meta(...).empty() without building a message: the check the SpMM runs per work unit.
bool meta_rows_valid(const uint8_t* meta, int64_t k, int64_t row_begin, int64_t row_end);

// values [N, K/2] + meta -> dense [K, N] (+0.0 where nothing is kept). Validates meta first.
std::string decompress(DType dtype, const void* values, const uint8_t* meta, int64_t k, int64_t n,
                       void* dense);

}  // namespace sparse24

#endif  // TF_SPARSE24_CC_SPARSE24_FORMAT_H_
