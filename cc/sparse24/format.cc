#include "cc/sparse24/format.h"

#include <array>
#include <cstring>
#include <sstream>

namespace sparse24 {
namespace {

// Meta nibble (p0 | p1 << 2) for a group whose non-zero mask (bit i: element i) has <= 2 bits:
// the non-zeros plus the lowest unused positions, ascending. 0xFF for masks with 3 or 4 bits.
constexpr std::array<uint8_t, 16> make_nibble_table() {
  std::array<uint8_t, 16> table{};
  for (int mask = 0; mask < 16; ++mask) {
    int count = 0;
    for (int i = 0; i < 4; ++i) count += (mask >> i) & 1;
    if (count > 2) {
      table[mask] = 0xFF;
      continue;
    }
    int keep = mask;
    for (int i = 0; i < 4 && count < 2; ++i) {
      if (!((keep >> i) & 1)) {
        keep |= 1 << i;
        ++count;
      }
    }
    int pos[2] = {0, 0}, j = 0;
    for (int i = 0; i < 4; ++i) {
      if ((keep >> i) & 1) pos[j++] = i;
    }
    table[mask] = static_cast<uint8_t>(pos[0] | (pos[1] << 2));
  }
  return table;
}
constexpr std::array<uint8_t, 16> kNibbleForMask = make_nibble_table();

inline bool nibble_valid(unsigned nibble) { return (nibble & 3u) < (nibble >> 2); }

// U is the unsigned integer type of an element; abs_mask<U>() clears its sign bit.
template <typename U>
constexpr U abs_mask() {
  return static_cast<U>(~(U(1) << (8 * sizeof(U) - 1)));
}

// Non-zero mask of the group whose first element is at `col` (bit p: element 4g+p is non-zero).
template <typename U>
unsigned group_mask(const U* col, int64_t n) {
  constexpr U kAbs = abs_mask<U>();
  return ((col[0] & kAbs) != 0 ? 1u : 0u) | ((col[n] & kAbs) != 0 ? 2u : 0u) |
         ((col[2 * n] & kAbs) != 0 ? 4u : 0u) | ((col[3 * n] & kAbs) != 0 ? 8u : 0u);
}

// Message naming the first group with > 2 non-zeros in W's memory order (group g, then column n).
template <typename U>
std::string first_bad_group(const U* dense, int64_t k, int64_t n) {
  for (int64_t g = 0; g < k / 4; ++g) {
    for (int64_t c = 0; c < n; ++c) {
      const unsigned mask = group_mask(dense + 4 * g * n + c, n);
      if (kNibbleForMask[mask] != 0xFF) continue;
      std::ostringstream msg;
      msg << "not 2:4 sparse: group g=" << g << " (rows k=" << 4 * g << ".." << 4 * g + 3
          << ") of column n=" << c << " has " << __builtin_popcount(mask)
          << " non-zeros at rows k=[";
      const char* sep = "";
      for (int i = 0; i < 4; ++i) {
        if ((mask >> i) & 1) {
          msg << sep << 4 * g + i;
          sep = ", ";
        }
      }
      msg << "]; at most 2 of every 4 consecutive elements along K may be non-zero";
      return msg.str();
    }
  }
  return std::string();
}

// Both directions walk W four rows (one group) at a time, all columns, so W is read or written
// sequentially; values and meta go column by column (strided, but each line is reused by the next
// groups while it stays in L2). Tiling over groups was slower: W's rows sit 4*N bytes apart and a
// tile of them collides in the same cache sets.
template <typename U>
std::string compress_impl(const U* dense, int64_t k, int64_t n, U* values, uint8_t* meta) {
  const int64_t groups = k / 4, half_k = k / 2, mcols = meta_cols(k);
  if (n * mcols == 0) return std::string();  // nothing to write (and memset(nullptr) is UB)
  std::memset(meta, 0, static_cast<size_t>(n * mcols));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t c = 0; c < n; ++c) {
      const U* col = dense + 4 * g * n + c;
      const unsigned mask = group_mask(col, n);
      const uint8_t nibble = kNibbleForMask[mask];
      if (nibble == 0xFF) return first_bad_group(dense, k, n);
      const int p0 = nibble & 3, p1 = nibble >> 2;
      U* out = values + c * half_k + 2 * g;
      out[0] = ((mask >> p0) & 1) ? col[p0 * n] : U(0);  // a padded position is +0.0
      out[1] = ((mask >> p1) & 1) ? col[p1 * n] : U(0);
      meta[c * mcols + g / 2] |= static_cast<uint8_t>(nibble << (4 * (g & 1)));
    }
  }
  return std::string();
}

template <typename U>
void decompress_impl(const U* values, const uint8_t* meta, int64_t k, int64_t n, U* dense) {
  const int64_t groups = k / 4, half_k = k / 2, mcols = meta_cols(k);
  if (k * n == 0) return;
  std::memset(dense, 0, static_cast<size_t>(k * n) * sizeof(U));
  for (int64_t g = 0; g < groups; ++g) {
    U* rows = dense + 4 * g * n;
    for (int64_t c = 0; c < n; ++c) {
      const unsigned nibble = (meta[c * mcols + g / 2] >> (4 * (g & 1))) & 0xFu;
      rows[(nibble & 3) * n + c] = values[c * half_k + 2 * g];
      rows[(nibble >> 2) * n + c] = values[c * half_k + 2 * g + 1];
    }
  }
}

// True if every group in the `bytes` full meta bytes at `p` is valid: 8 bytes at a time, with per
// byte fields a = bits 0-1, b = 2-3, c = 4-5, d = 6-7 and the test b > a <=> bit 2 of (b + 3 - a)
// (no carry or borrow crosses a byte: b + 3 - a lies in 0..6).
bool full_bytes_valid(const uint8_t* p, int64_t bytes) {
  constexpr uint64_t kTwoBits = 0x0303030303030303ull, kBit2 = 0x0404040404040404ull;
  uint64_t all = kBit2;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t x;
    std::memcpy(&x, p + i, 8);
    const uint64_t a = x & kTwoBits, b = (x >> 2) & kTwoBits;
    const uint64_t c = (x >> 4) & kTwoBits, d = (x >> 6) & kTwoBits;
    all &= (b + kTwoBits - a) & (d + kTwoBits - c);
  }
  bool ok = (all & kBit2) == kBit2;
  for (; i < bytes; ++i) ok &= nibble_valid(p[i] & 0xFu) && nibble_valid(p[i] >> 4);
  return ok;
}

}  // namespace

std::string compress(DType dtype, const void* dense, int64_t k, int64_t n, void* values,
                     uint8_t* meta) {
  if (dtype_size(dtype) == 4) {
    return compress_impl(static_cast<const uint32_t*>(dense), k, n, static_cast<uint32_t*>(values),
                         meta);
  }
  return compress_impl(static_cast<const uint16_t*>(dense), k, n, static_cast<uint16_t*>(values),
                       meta);
}

bool meta_rows_valid(const uint8_t* meta, int64_t k, int64_t row_begin, int64_t row_end) {
  const int64_t mcols = meta_cols(k), full = k / 8;
  if (full == mcols) {  // K % 8 == 0: the rows are one run of whole bytes
    return full_bytes_valid(meta + row_begin * mcols, (row_end - row_begin) * mcols);
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* m = meta + r * mcols;
    if (!full_bytes_valid(m, full)) return false;
    // K % 8 == 4: the last byte holds one group (low nibble); its high nibble must be 0.
    if (full != mcols && (!nibble_valid(m[full] & 0xFu) || (m[full] >> 4) != 0)) return false;
  }
  return true;
}

std::string validate_meta(const uint8_t* meta, int64_t k, int64_t row_begin, int64_t row_end) {
  if (meta_rows_valid(meta, k, row_begin, row_end)) return std::string();
  const int64_t groups = k / 4, mcols = meta_cols(k);
  for (int64_t r = row_begin; r < row_end; ++r) {  // slow path: find the first bad group
    const uint8_t* m = meta + r * mcols;
    for (int64_t g = 0; g < groups; ++g) {
      const unsigned nibble = (m[g / 2] >> (4 * (g & 1))) & 0xFu;
      if (!nibble_valid(nibble)) {
        std::ostringstream msg;
        msg << "invalid meta: row n=" << r << ", group g=" << g << " has positions ("
            << (nibble & 3) << ", " << (nibble >> 2)
            << "); the two positions of a group must be strictly ascending";
        return msg.str();
      }
    }
  }
  for (int64_t r = row_begin; r < row_end && k % 8 == 4; ++r) {  // then the last high nibbles
    const unsigned last = meta[r * mcols + mcols - 1];
    if (last >> 4) {
      std::ostringstream msg;
      msg << "invalid meta: row n=" << r << ", last byte 0x" << std::hex << last
          << " has a non-zero high nibble, which must be 0 when K % 8 == 4 (K=" << std::dec << k
          << ")";
      return msg.str();
    }
  }
  return std::string();
}

std::string decompress(DType dtype, const void* values, const uint8_t* meta, int64_t k, int64_t n,
                       void* dense) {
  std::string error = validate_meta(meta, k, 0, n);
  if (!error.empty()) return error;
  if (dtype_size(dtype) == 4) {
    decompress_impl(static_cast<const uint32_t*>(values), meta, k, n,
                    static_cast<uint32_t*>(dense));
  } else {
    decompress_impl(static_cast<const uint16_t*>(values), meta, k, n,
                    static_cast<uint16_t*>(dense));
  }
  return std::string();
}

}  // namespace sparse24
