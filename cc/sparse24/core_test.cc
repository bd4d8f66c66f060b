// Plain C++ test of the framework-free core (no TensorFlow): the sparse24/v1 format, meta
// validation, float16 conversions, ISA detection and spmm on every variant this CPU runs.
// tests/test_core_cc.py builds it with -fsanitize=address,undefined, runs it and checks its output.
// Exit status 0 and a final "ALL PASSED" line mean every check passed; failures print "FAIL ...".
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cc/sparse24/cpu_features.h"
#include "cc/sparse24/dtype.h"
#include "cc/sparse24/format.h"
#include "cc/sparse24/half.h"
#include "cc/sparse24/spmm.h"

namespace {

int g_failures = 0;
int64_t g_checks = 0;

#define CHECK(cond, ...)                               \
  do {                                                 \
    ++g_checks;                                        \
    if (!(cond)) {                                     \
      ++g_failures;                                    \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                        \
      std::printf("\n");                               \
    }                                                  \
  } while (0)

using sparse24::DType;

constexpr sparse24::Isa kIsas[] = {sparse24::Isa::kScalar, sparse24::Isa::kAvx2,
                                   sparse24::Isa::kAvx512, sparse24::Isa::kAvx512Bf16};

// A straight per-group transcription of docs/FORMAT.md, independent of format.cc's tables.
void reference_compress(const std::vector<float>& w, int64_t k, int64_t n,
                        std::vector<float>* values, std::vector<uint8_t>* meta) {
  values->assign(n * k / 2, 0.0f);
  meta->assign(n * sparse24::meta_cols(k), 0);
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t g = 0; g < k / 4; ++g) {
      int pos[2], used = 0;
      for (int p = 0; p < 4 && used < 2; ++p) {
        if (w[(4 * g + p) * n + c] != 0.0f) pos[used++] = p;  // NaN counts as non-zero
      }
      for (int p = 0; p < 4 && used < 2; ++p) {  // pad with the lowest unused positions
        if (used == 1 && p == pos[0]) continue;
        pos[used++] = p;
      }
      if (pos[0] > pos[1]) std::swap(pos[0], pos[1]);
      for (int j = 0; j < 2; ++j) {
        const float v = w[(4 * g + pos[j]) * n + c];
        (*values)[c * k / 2 + 2 * g + j] = v == 0.0f ? 0.0f : v;  // pads and -0.0 become +0.0
      }
      (*meta)[c * sparse24::meta_cols(k) + g / 2] |= (pos[0] | pos[1] << 2) << (4 * (g % 2));
    }
  }
}

std::vector<float> random_24(std::mt19937* rng, int64_t k, int64_t n) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> count(0, 2), position(0, 3);
  std::vector<float> w(k * n, 0.0f);
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t g = 0; g < k / 4; ++g) {
      const int keep = count(*rng);
      for (int i = 0; i < keep; ++i) w[(4 * g + position(*rng)) * n + c] = normal(*rng);
    }
  }
  return w;
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

void test_worked_example() {
  // docs/FORMAT.md: K = 12, N = 2.
  std::vector<float> w(24, 0.0f);
  w[1 * 2 + 0] = 1.5f;
  w[3 * 2 + 0] = -2.0f;
  w[6 * 2 + 0] = 4.0f;
  w[4 * 2 + 1] = 7.0f;
  w[5 * 2 + 1] = 8.0f;
  w[10 * 2 + 1] = 9.0f;
  w[11 * 2 + 1] = -1.0f;
  std::vector<float> values(12);
  std::vector<uint8_t> meta(4);
  const std::string error =
      sparse24::compress(DType::kFloat32, w.data(), 12, 2, values.data(), meta.data());
  CHECK(error.empty(), "worked example: %s", error.c_str());
  const float want_values[12] = {1.5f, -2.0f, 0, 4.0f, 0, 0, 0, 0, 7.0f, 8.0f, 9.0f, -1.0f};
  const uint8_t want_meta[4] = {0x8D, 0x04, 0x44, 0x0E};
  CHECK(std::memcmp(values.data(), want_values, sizeof(want_values)) == 0, "worked example values");
  CHECK(std::memcmp(meta.data(), want_meta, 4) == 0, "worked example meta %02x %02x %02x %02x",
        meta[0], meta[1], meta[2], meta[3]);
}

void test_compress_round_trip(std::mt19937* rng) {
  for (int64_t k : {0, 4, 8, 12, 28, 260}) {
    for (int64_t n : {0, 1, 3, 17}) {
      std::vector<float> w = random_24(rng, k, n);
      // A -0.0 at a zero and a NaN in place of a non-zero: both keep the matrix 2:4.
      for (float& e : w) {
        if (e == 0.0f) {
          e = -0.0f;
          break;
        }
      }
      for (float& e : w) {
        if (e != 0.0f) {
          e = std::nanf("");
          break;
        }
      }
      std::vector<float> values(n * k / 2), ref_values;
      std::vector<uint8_t> meta(n * sparse24::meta_cols(k)), ref_meta;
      const std::string error =
          sparse24::compress(DType::kFloat32, w.data(), k, n, values.data(), meta.data());
      CHECK(error.empty(), "compress k=%ld n=%ld: %s", (long)k, (long)n, error.c_str());
      reference_compress(w, k, n, &ref_values, &ref_meta);
      bool same = meta == ref_meta;
      for (size_t i = 0; i < values.size(); ++i)
        same &= bits_of(values[i]) == bits_of(ref_values[i]);
      CHECK(same, "compress k=%ld n=%ld differs from the reference", (long)k, (long)n);
      std::vector<float> back(k * n, 1.0f);
      const std::string derr =
          sparse24::decompress(DType::kFloat32, values.data(), meta.data(), k, n, back.data());
      CHECK(derr.empty(), "decompress: %s", derr.c_str());
      bool equal = true;
      for (int64_t i = 0; i < k * n; ++i) {
        equal &= (std::isnan(w[i]) && std::isnan(back[i])) || w[i] == back[i];
      }
      CHECK(equal, "round trip k=%ld n=%ld", (long)k, (long)n);
      // 16-bit elements: the same bit patterns, shifted down (compress works on bit patterns).
      std::vector<uint16_t> w16(k * n), v16(n * k / 2);
      for (int64_t i = 0; i < k * n; ++i) w16[i] = sparse24::f32_to_bf16(w[i]);
      std::vector<uint8_t> meta16(meta.size());
      CHECK(
          sparse24::compress(DType::kBFloat16, w16.data(), k, n, v16.data(), meta16.data()).empty(),
          "bf16 compress");
      CHECK(meta16 == meta, "bf16 meta differs from f32 meta for the same matrix");
    }
  }
}

void test_compress_rejects_first_bad_group() {
  const int64_t k = 16, n = 5;
  std::vector<float> w(k * n, 0.0f);
  for (int r = 8; r < 11; ++r) w[r * n + 3] = 1.0f;   // group 2, column 3
  for (int r = 12; r < 16; ++r) w[r * n + 1] = 1.0f;  // group 3, column 1 (later in memory)
  std::vector<float> values(n * k / 2);
  std::vector<uint8_t> meta(n * 2);
  const std::string error =
      sparse24::compress(DType::kFloat32, w.data(), k, n, values.data(), meta.data());
  CHECK(error.find("group g=2 (rows k=8..11) of column n=3 has 3 non-zeros at rows k=[8, 9, 10]") !=
            std::string::npos,
        "compress error message: '%s'", error.c_str());
}

void test_validate_meta_every_byte() {
  // K = 8 (one full byte per row): a byte is valid iff both nibbles are strictly ascending pairs.
  for (int byte = 0; byte < 256; ++byte) {
    const uint8_t m = static_cast<uint8_t>(byte);
    const bool lo = (byte & 3) < ((byte >> 2) & 3), hi = ((byte >> 4) & 3) < (byte >> 6);
    const std::string error = sparse24::validate_meta(&m, 8, 0, 1);
    CHECK(error.empty() == (lo && hi), "byte 0x%02x: '%s'", byte, error.c_str());
    if (!lo) CHECK(error.find("group g=0") != std::string::npos, "byte 0x%02x names g=0", byte);
    if (lo && !hi) CHECK(error.find("group g=1") != std::string::npos, "byte 0x%02x g=1", byte);
  }
  // Long rows go through the 8-bytes-at-a-time path: one bad nibble anywhere must be found.
  const int64_t k = 8 * 37 + 4, n = 3, cols = sparse24::meta_cols(k);
  std::vector<uint8_t> meta(n * cols, 0x4E);
  for (int64_t r = 0; r < n; ++r) meta[r * cols + cols - 1] = 0x0E;
  CHECK(sparse24::validate_meta(meta.data(), k, 0, n).empty(), "valid long meta");
  for (int64_t i = 0; i < n * cols; ++i) {
    const uint8_t saved = meta[i];
    meta[i] = static_cast<uint8_t>(saved ^ 0x30);  // high nibble 0x4 -> 0x7: (3, 1), descending
    const std::string error = sparse24::validate_meta(meta.data(), k, 0, n);
    const int64_t row = i / cols, group = 2 * (i % cols) + 1;
    const std::string want = (i % cols == cols - 1) ? "row n=" + std::to_string(row) + ", last byte"
                                                    : "row n=" + std::to_string(row) +
                                                          ", group g=" + std::to_string(group) +
                                                          " has positions (3, 1)";
    CHECK(error.find(want) != std::string::npos, "byte %ld: '%s' lacks '%s'", (long)i,
          error.c_str(), want.c_str());
    meta[i] = saved;
  }
  // decompress validates before writing.
  std::vector<float> values(n * k / 2, 1.0f), dense(k * n);
  meta[cols + 5] = 0xAA;
  CHECK(!sparse24::decompress(DType::kFloat32, values.data(), meta.data(), k, n, dense.data())
             .empty(),
        "decompress accepts bad meta");
}

double half_reference(uint16_t h) {  // IEEE binary16 by its definition
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  const double s = sign ? -1.0 : 1.0;
  if (exp == 0) return s * std::ldexp(mant, -24);
  if (exp == 31) return mant ? NAN : s * INFINITY;
  return s * std::ldexp(1024 + mant, exp - 25);
}

void test_half() {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = half_reference(static_cast<uint16_t>(h));
    const float got = sparse24::f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want)
            ? !std::isnan(got)
            : (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want))) {
      ++bad;
    } else if (!std::isnan(want) && sparse24::f32_to_f16(got) != h) {
      ++bad;  // every half value survives the round trip
    }
    // Midpoint to the next half up (same sign) rounds to the one with an even mantissa.
    const uint16_t next = static_cast<uint16_t>(h + 1);
    if ((h & 0x7fff) < 0x7bff + 1 && (h & 0x7fff) != 0x7bff && (next & 0x7c00) != 0x7c00) {
      const double mid = (want + half_reference(next)) / 2;
      const uint16_t rounded = sparse24::f32_to_f16(static_cast<float>(mid));
      if (rounded != ((h & 1) ? next : h)) ++bad;
    }
  }
  CHECK(bad == 0, "%d float16 conversion mismatches", bad);
  CHECK(sparse24::f32_to_f16(65520.0f) == 0x7c00 && sparse24::f32_to_f16(65519.0f) == 0x7bff,
        "float16 overflow threshold");
  CHECK((sparse24::f32_to_f16(std::nanf("")) & 0x7e00) == 0x7e00, "float16 quiet NaN");
}

void test_isa() {
  using sparse24::Isa;
  CHECK(sparse24::isa_supported(Isa::kScalar) && sparse24::isa_supported(Isa::kAuto), "scalar");
  CHECK(sparse24::isa_supported(sparse24::best_isa()), "best isa supported");
  CHECK(!sparse24::isa_supported(Isa::kAvx512) || sparse24::isa_supported(Isa::kAvx2),
        "avx512 implies avx2");
  CHECK(!sparse24::isa_supported(Isa::kAvx512Bf16) || sparse24::isa_supported(Isa::kAvx512),
        "avx512bf16 implies avx512");
  Isa parsed;
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    CHECK(sparse24::parse_isa(sparse24::isa_name(isa), &parsed) && parsed == isa, "parse_isa");
  }
  CHECK(!sparse24::parse_isa("sse9", &parsed), "parse_isa rejects unknown names");
  std::printf("isa: best=%s avx2=%d avx512=%d avx512bf16=%d\n",
              sparse24::isa_name(sparse24::best_isa()), sparse24::isa_supported(Isa::kAvx2),
              sparse24::isa_supported(Isa::kAvx512), sparse24::isa_supported(Isa::kAvx512Bf16));
}

float load(DType dtype, const std::vector<uint32_t>& buf, int64_t i) {
  const uint32_t b = buf[i];
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  return dtype == DType::kBFloat16 ? sparse24::bf16_to_f32(static_cast<uint16_t>(b))
                                   : sparse24::f16_to_f32(static_cast<uint16_t>(b));
}

uint32_t store(DType dtype, float f) {
  if (dtype == DType::kFloat32) return bits_of(f);
  return dtype == DType::kBFloat16 ? sparse24::f32_to_bf16(f) : sparse24::f32_to_f16(f);
}

// Packs 32-bit slots into the element width the kernel reads.
std::vector<uint8_t> pack(DType dtype, const std::vector<uint32_t>& slots) {
  const int64_t size = sparse24::dtype_size(dtype);
  std::vector<uint8_t> out(slots.size() * size);
  for (size_t i = 0; i < slots.size(); ++i) std::memcpy(&out[i * size], &slots[i], size);
  return out;
}

void test_spmm_rejects_bad_meta(std::mt19937* rng) {
  // Every kernel path names the first bad row, wherever the work unit that meets it runs.
  const sparse24::ParallelFor backwards = [](int64_t total, int64_t,
                                             const std::function<void(int64_t, int64_t)>& fn) {
    for (int64_t b = total - 1; b >= 0; --b) fn(b, b + 1);
  };
  const int64_t k = 64, n = 600;
  const std::vector<float> w = random_24(rng, k, n);
  std::vector<float> values(n * k / 2);
  std::vector<uint8_t> meta(n * sparse24::meta_cols(k));
  CHECK(sparse24::compress(DType::kFloat32, w.data(), k, n, values.data(), meta.data()).empty(),
        "compress for bad-meta spmm");
  meta[517 * 8 + 3] = 0x4B;  // group 6 of row 517: (3, 2)
  meta[20 * 8 + 0] = 0x81;   // group 0 of row 20: (1, 0)
  std::vector<uint16_t> values_bf16(values.size());
  for (size_t i = 0; i < values.size(); ++i) values_bf16[i] = sparse24::f32_to_bf16(values[i]);
  for (sparse24::Isa isa : kIsas) {
    if (!sparse24::isa_supported(isa)) continue;
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {  // bfloat16: avx512bf16's own kernel
      const bool f32 = dtype == DType::kFloat32;
      for (int64_t m : {2, 64, 200}) {
        std::vector<float> x(m * k, 1.0f), y(m * n);  // as bfloat16: 0.0, 1.0, ... (any x does)
        const sparse24::SpmmArgs args{
            dtype, x.data(), k, f32 ? static_cast<const void*>(values.data()) : values_bf16.data(),
            meta.data(), m, k, n, y.data(), n};
        const std::string error = sparse24::spmm(args, isa, backwards);
        CHECK(error.find("row n=20, group g=0 has positions (1, 0)") != std::string::npos,
              "%s dtype %d m=%ld: '%s'", sparse24::isa_name(isa), static_cast<int>(dtype), (long)m,
              error.c_str());
      }
    }
  }
}

void test_spmm(std::mt19937* rng) {
  using sparse24::Isa;
  const sparse24::ParallelFor serial = [](int64_t total, int64_t,
                                          const std::function<void(int64_t, int64_t)>& fn) {
    // Uneven chunks, as a thread pool may hand out.
    for (int64_t b = 0; b < total; b += 3) fn(b, std::min(total, b + 3));
  };
  std::normal_distribution<float> normal;
  for (Isa isa : kIsas) {
    if (!sparse24::isa_supported(isa)) continue;
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const double rtol = dtype == DType::kFloat32   ? 2e-6
                          : dtype == DType::kFloat16 ? 1.5e-3
                                                     : 1.2e-2;
      for (int64_t m : {1, 3, 4, 5, 33, 47, 70, 200}) {  // panels, tails, row blocks
        for (int64_t k : {4, 12, 64, 260}) {
          for (int64_t n : {1, 7, 40}) {
            const std::vector<float> wf = random_24(rng, k, n);
            std::vector<uint32_t> w(k * n), x(m * k);
            for (int64_t i = 0; i < k * n; ++i) w[i] = store(dtype, wf[i]);
            for (int64_t i = 0; i < m * k; ++i) x[i] = store(dtype, normal(*rng));
            const std::vector<uint8_t> w_packed = pack(dtype, w), x_packed = pack(dtype, x);
            std::vector<uint8_t> values(n * k / 2 * sparse24::dtype_size(dtype));
            std::vector<uint8_t> meta(n * sparse24::meta_cols(k));
            const std::string error =
                sparse24::compress(dtype, w_packed.data(), k, n, values.data(), meta.data());
            CHECK(error.empty(), "compress for spmm: %s", error.c_str());
            const int64_t ldy = n + 3;  // a padded output row stride
            std::vector<uint8_t> y(m * ldy * sparse24::dtype_size(dtype), 0xEE);
            sparse24::SpmmArgs args{dtype, x_packed.data(), k,  values.data(), meta.data(), m, k,
                                    n,     y.data(),        ldy};
            const std::string spmm_error = sparse24::spmm(args, isa, serial);
            CHECK(spmm_error.empty(), "spmm on valid meta: %s", spmm_error.c_str());
            std::vector<uint32_t> y_slots(m * ldy, 0);
            for (int64_t i = 0; i < m * ldy; ++i) {
              std::memcpy(&y_slots[i], &y[i * sparse24::dtype_size(dtype)],
                          sparse24::dtype_size(dtype));
            }
            int bad = 0;
            for (int64_t r = 0; r < m; ++r) {
              for (int64_t c = 0; c < n; ++c) {
                double ref = 0, scale = 0;
                for (int64_t i = 0; i < k; ++i) {
                  const double p =
                      static_cast<double>(load(dtype, x, r * k + i)) * load(dtype, w, i * n + c);
                  ref += p;
                  scale += std::fabs(p);
                }
                const double got = load(dtype, y_slots, r * ldy + c);
                // float16 outputs below 2^-14 are subnormal: absolute spacing 2^-24.
                const double atol = dtype == DType::kFloat16 ? std::ldexp(1.0, -24) : 1e-30;
                if (!(std::fabs(got - ref) <= rtol * scale + atol) && bad++ == 0) {
                  std::printf("first bad output y[%ld, %ld] = %.9g, float64 reference %.9g\n",
                              (long)r, (long)c, got, ref);
                }
              }
              for (int64_t c = n; c < ldy; ++c) {  // padding past N untouched
                bad += y[(r * ldy + c) * sparse24::dtype_size(dtype)] != 0xEE;
              }
            }
            CHECK(bad == 0, "spmm isa=%s dtype=%d m=%ld k=%ld n=%ld: %d bad outputs",
                  sparse24::isa_name(isa), static_cast<int>(dtype), (long)m, (long)k, (long)n, bad);
          }
        }
      }
    }
    std::printf("spmm %s checked\n", sparse24::isa_name(isa));
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  test_worked_example();
  test_compress_round_trip(&rng);
  test_compress_rejects_first_bad_group();
  test_validate_meta_every_byte();
  test_half();
  test_isa();
  test_spmm(&rng);
  test_spmm_rejects_bad_meta(&rng);
  std::printf("%ld checks, %d failures\n", (long)g_checks, g_failures);
  if (g_failures == 0) std::printf("ALL PASSED\n");
  return g_failures == 0 ? 0 : 1;
}
