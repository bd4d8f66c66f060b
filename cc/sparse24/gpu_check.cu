// gpu_check: framework-free test and benchmark of the GPU path (no TensorFlow).
//
// 1. Checks, on fresh random inputs (never zeros; all-zero and -0.0 groups included on purpose) and
//    with every output poisoned (0xFF bytes = NaN) first: GPU compress against a CPU reference,
//    bit for bit; the first-bad-group and meta checks; decompress both ways; cuSPARSELt matmul,
//    cuBLAS and the plain fallback kernel against a float64 CPU product; the TF ops' own logic
//    (gpu_matmul.h: weight cache, in-place changes, eviction, named errors) driven as they drive it.
// 2. Times cuSPARSELt 2:4 (default config, then after cusparseLtMatmulSearch) against cuBLAS
//    dense (cublasGemmEx, fp32 accumulation), CUDA events, median of many timed batches after
//    warm-up, inputs rotated so repeated runs do not just hit L2; prints a ratio table.
// Every CUDA, cuBLAS and cuSPARSELt status is checked. Exit status: 0 all checks passed, 1 a check
// failed, 2 bad arguments, 3 a library or the GPU is missing (without cuSPARSELt the checks that
// do not need it still run, then 3).
//
// Build and run: scripts/gpu_check.sh (it finds the libraries). `gpu_check --help` lists flags.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cc/sparse24/cusparselt.h"
#include "cc/sparse24/dtype.h"
#include "cc/sparse24/gpu_blas.h"
#include "cc/sparse24/gpu_kernels.h"
#include "cc/sparse24/gpu_matmul.h"
#include "cc/sparse24/gpu_spmm.h"

namespace {

using sparse24::DType;
namespace gpu = sparse24::gpu;

// ---------------------------------------------------------------------------------------------
// Errors and output.

FILE* g_log = nullptr;  // --out DIR/gpu_check.log, written beside stdout

void out(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void out(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  char buf[4096];
  vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  fputs(buf, stdout);
  fflush(stdout);
  if (g_log) { fputs(buf, g_log); fflush(g_log); }
}

[[noreturn]] void die(int code, const std::string& what) {
  out("gpu_check: FATAL: %s\n", what.c_str());
  exit(code);
}

#define CUDA_OK(expr)                                                                        \
  do {                                                                                       \
    cudaError_t _e = (expr);                                                                 \
    if (_e != cudaSuccess) die(1, std::string(#expr) + ": " + cudaGetErrorString(_e) +      \
                                      " at line " + std::to_string(__LINE__));               \
  } while (0)
#define LAUNCH_OK() CUDA_OK(cudaGetLastError())

int g_failures = 0, g_skipped = 0;
void verdict(bool ok, const std::string& what) {
  if (!ok) ++g_failures;
  out("  [%s] %s\n", ok ? "ok" : "FAIL", what.c_str());
}
// A check that cannot run here (cuSPARSELt not loaded, no memory pools): counted, and the run
// cannot pass.
void skipped(const std::string& what) {
  ++g_skipped;
  out("  [skip] %s\n", what.c_str());
}

// ---------------------------------------------------------------------------------------------
// Host-side element conversions and the CPU reference of sparse24/v1 (written from
// docs/FORMAT.md, independently of the GPU kernels).

float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}

int esize(DType t) { return static_cast<int>(sparse24::dtype_size(t)); }
const char* dname(DType t) {
  return t == DType::kBFloat16 ? "bf16" : t == DType::kFloat16 ? "fp16" : "fp32";
}

double to_double(DType t, const uint8_t* p, int64_t i) {
  if (t == DType::kFloat32) { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return t == DType::kBFloat16 ? sparse24::bf16_to_f32(h) : half_bits_to_float(h);
}
bool is_nonzero(DType t, const uint8_t* p, int64_t i) {
  if (t == DType::kFloat32) { uint32_t b; std::memcpy(&b, p + 4 * i, 4); return (b & 0x7fffffffu) != 0; }
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return (b & 0x7fffu) != 0;
}

// W [K, N] -> values [N, K/2], meta [N, ceil(K/8)]; pads +0.0.
void cpu_compress(DType t, const std::vector<uint8_t>& w, int64_t K, int64_t N,
                  std::vector<uint8_t>* values, std::vector<uint8_t>* meta) {
  const int es = esize(t);
  const int64_t bytes = (K + 7) / 8;
  values->assign(N * (K / 2) * es, 0);
  meta->assign(N * bytes, 0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < K / 4; ++g) {
      std::vector<int> keep;
      for (int r = 0; r < 4; ++r) if (is_nonzero(t, w.data(), (4 * g + r) * N + n)) keep.push_back(r);
      for (int r = 0; r < 4 && keep.size() < 2; ++r) {
        if (std::find(keep.begin(), keep.end(), r) == keep.end()) keep.push_back(r);
      }
      std::sort(keep.begin(), keep.begin() + 2);
      for (int j = 0; j < 2; ++j) {
        const int64_t src = (4 * g + keep[j]) * N + n, dst = n * (K / 2) + 2 * g + j;
        if (is_nonzero(t, w.data(), src)) std::memcpy(&(*values)[dst * es], &w[src * es], es);
      }
      (*meta)[n * bytes + g / 2] |= static_cast<uint8_t>((keep[0] | (keep[1] << 2)) << (4 * (g % 2)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Device buffers and random inputs.

struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n = 0) : bytes(n) { if (n) CUDA_OK(cudaMalloc(&p, n)); }
  ~Buf() { if (p) cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; o.bytes = 0; }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  template <typename T = void> T* get() const { return static_cast<T*>(p); }
  void poison() const { if (bytes) CUDA_OK(cudaMemset(p, 0xff, bytes)); }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> h(bytes);
    if (bytes) CUDA_OK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

__device__ uint64_t hash3(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull ^
               (c + 0x1234567ull) * 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ void store_float(DType t, void* p, int64_t i, float v) {
  if (t == DType::kFloat32) { static_cast<float*>(p)[i] = v; return; }
  if (t == DType::kFloat16) { static_cast<__half*>(p)[i] = __float2half_rn(v); return; }
  uint32_t bits = __float_as_uint(v);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
}

// Non-zero magnitudes in [0.25, 1): exact in every dtype's range, never rounded to 0.
__device__ float random_value(uint64_t h) {
  const float u = 0.25f + 0.75f * static_cast<float>((h >> 11) & 0xffffff) / 16777216.f;
  return (h & 1) ? -u : u;
}

// W [K, N] 2:4 along K: per group 2 non-zeros (7/8 of groups), 1 (3/32) or none (1/32, with a
// -0.0 sometimes, which compression must store as +0.0).
__global__ void fill_sparse24(DType t, void* w, int64_t K, int64_t N, uint64_t seed) {
  const int64_t total = (K / 4) * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i / N, n = i % N;
    const uint64_t h = hash3(seed, g, n);
    const int kind = static_cast<int>((h >> 40) & 31);
    const int count = kind == 0 ? 0 : kind <= 3 ? 1 : 2;
    const int pair = static_cast<int>((h >> 45) % 6);
    const int pairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
    for (int r = 0; r < 4; ++r) {
      const bool on = (count == 2 && (r == pairs[pair][0] || r == pairs[pair][1])) ||
                      (count == 1 && r == pairs[pair][1]);
      const float v = on ? random_value(hash3(seed + 1, 4 * g + r, n)) : ((h >> 50) & 1 ? -0.f : 0.f);
      store_float(t, w, (4 * g + r) * N + n, v);
    }
  }
}

__global__ void fill_dense(DType t, void* x, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    store_float(t, x, i, random_value(hash3(seed, i, 7)));
  }
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>(4096, (n + 255) / 256)); }

uint64_t g_seed = 0;
uint64_t next_seed() { return ++g_seed * 1000003ull + static_cast<uint64_t>(time(nullptr)); }

// A problem instance: W [K, N] (dense and compressed), x [M, K], y [M, N].
struct Problem {
  DType t;
  int64_t M, K, N;
  Buf w, values, meta, x;
  Problem(DType t_, int64_t M_, int64_t K_, int64_t N_)
      : t(t_), M(M_), K(K_), N(N_), w(K_ * N_ * esize(t_)), values(N_ * (K_ / 2) * esize(t_)),
        meta(N_ * ((K_ + 7) / 8)), x(M_ * K_ * esize(t_)) {
    fill_sparse24<<<grid_for(K * N / 4), 256>>>(t, w.p, K, N, next_seed());
    LAUNCH_OK();
    fill_dense<<<grid_for(M * K), 256>>>(t, x.p, M * K, next_seed());
    LAUNCH_OK();
  }
  // GPU compress into values/meta (poisoned first); returns the first-bad slot.
  unsigned long long compress() {
    values.poison();
    meta.poison();
    Buf slot(sizeof(unsigned long long));
    CUDA_OK(gpu::reset_error_slots(slot.get<unsigned long long>(), 1, 0));
    CUDA_OK(gpu::compress(t, w.p, K, N, values.p, meta.get<uint8_t>(), slot.get<unsigned long long>(), 0));
    unsigned long long bad;
    CUDA_OK(cudaMemcpy(&bad, slot.p, sizeof(bad), cudaMemcpyDeviceToHost));
    return bad;
  }
  // compress() of the generated 2:4 W, which must not be flagged.
  void compress_2to4() {
    if (compress() != gpu::kNoError) die(1, "compress flagged a 2:4 input");
  }
};

// Unit roundoff of the output type: what rounding y to it may cost, relative to |y|.
double unit_roundoff(DType t) {
  return t == DType::kFloat32 ? 0x1p-24 : t == DType::kFloat16 ? 0x1p-11 : 0x1p-8;
}

// ||y - x @ W|| / ||x @ W|| over `rows` of the first `m` rows of y, float64 on the CPU; also counts
// non-finite values in those m rows of y (poisoned before the run, so NaN = never written) and,
// in the checked rows, elements outside a per-element bound, so that one wrong column or element
// cannot hide in the norm: |y - ref| <= 2u|ref| + (u/8 + 16 sqrt(K) 2^-24) sum_k |x_k w_k|, with u
// the output type's unit roundoff (y's rounding), room for split-K partial sums rounded to the
// output type (u/8) and for float32 accumulation (random-walk error with a 16x margin). Simulated
// in numpy (bf16/fp16, K 4096/16384, 8-way split-K with bf16 partials): correct products reach at
// most 0.38 of the bound; a product off by one column is flagged in 97-99% of its elements. The
// worst element is printed with its position.
double element_bound(DType t, int64_t K, double ref, double magnitude) {
  const double u = unit_roundoff(t);
  return 2 * u * std::fabs(ref) + (u / 8 + 16 * std::sqrt(static_cast<double>(K)) * 0x1p-24) * magnitude;
}

// Row m of x @ W in float64 (IEEE: Inf * 0 = NaN, as in a dense matmul) into acc[n], and
// sum_k |x[m, k] w[k, n]| into mag[n] (the scale of the rounding bound).
void reference_row(const Problem& p, const std::vector<uint8_t>& hx, const std::vector<uint8_t>& hw,
                   int64_t m, std::vector<double>* acc, std::vector<double>* mag) {
  acc->assign(p.N, 0.0);
  mag->assign(p.N, 0.0);
  for (int64_t k = 0; k < p.K; ++k) {
    const double xv = to_double(p.t, hx.data(), m * p.K + k);
    for (int64_t n = 0; n < p.N; ++n) {
      const double term = xv * to_double(p.t, hw.data(), k * p.N + n);
      (*acc)[n] += term;
      (*mag)[n] += std::fabs(term);
    }
  }
}

struct Check { double rel_err; int64_t bad_outputs; int64_t outliers; };
Check check_product(const Problem& p, const Buf& y, int64_t m, int rows) {
  const std::vector<uint8_t> hw = p.w.host(), hx = p.x.host(), hy = y.host();
  Check c{0, 0, 0};
  for (int64_t i = 0; i < m * p.N; ++i) c.bad_outputs += !std::isfinite(to_double(p.t, hy.data(), i));
  rows = static_cast<int>(std::min<int64_t>(rows, m));
  std::vector<int64_t> picks;
  for (int r = 0; r < rows; ++r) picks.push_back(rows == 1 ? 0 : r * (m - 1) / (rows - 1));
  std::vector<double> num(picks.size()), den(picks.size()), worst(picks.size());
  std::vector<int64_t> outliers(picks.size()), worst_n(picks.size());
  std::vector<std::thread> pool;
  for (size_t j = 0; j < picks.size(); ++j) {
    pool.emplace_back([&, j] {
      const int64_t m = picks[j];
      std::vector<double> acc, mag;
      reference_row(p, hx, hw, m, &acc, &mag);
      for (int64_t n = 0; n < p.N; ++n) {
        const double d = to_double(p.t, hy.data(), m * p.N + n) - acc[n];
        num[j] += d * d;
        den[j] += acc[n] * acc[n];
        const double excess = std::fabs(d) / (element_bound(p.t, p.K, acc[n], mag[n]) + 1e-300);
        if (!(excess <= 1)) ++outliers[j];  // NaN counts
        if (!(excess <= worst[j])) worst[j] = excess, worst_n[j] = n;
      }
    });
  }
  for (auto& t : pool) t.join();
  double sn = 0, sd = 0;
  size_t w = 0;
  for (size_t j = 0; j < picks.size(); ++j) {
    sn += num[j];
    sd += den[j];
    c.outliers += outliers[j];
    if (!(worst[j] <= worst[w])) w = j;
  }
  c.rel_err = std::sqrt(sn / std::max(sd, 1e-300));
  if (std::isnan(c.rel_err)) c.rel_err = INFINITY;
  if (c.outliers) {
    out("  %ld of %ld checked outputs beyond the per-element bound; worst %.3g x the bound at "
        "row %ld, column %ld\n", (long)c.outliers, (long)(picks.size() * p.N), worst[w],
        (long)picks[w], (long)worst_n[w]);
  }
  return c;
}

double tolerance(DType t) { return t == DType::kFloat32 ? 1e-5 : t == DType::kFloat16 ? 2e-3 : 1e-2; }

// Whether a checked product is right: every output written, each element within its bound, and
// the norm-relative error below the dtype's tolerance.
bool correct(const Check& c, DType t) {
  return c.bad_outputs == 0 && c.outliers == 0 && c.rel_err < tolerance(t);
}

std::string fmt(const char* f, ...) {
  va_list args;
  va_start(args, f);
  char buf[512];
  vsnprintf(buf, sizeof(buf), f, args);
  va_end(args);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// The three matmul paths on one Problem.

// cuSPARSELt operand + plan for one Problem. A library refusal is a result (error is set and the
// caller records a failed check), so one unsupported shape does not end the whole run.
struct LtRunner {
  gpu::LtContext* ctx;
  gpu::LtSparseOperand operand;
  gpu::LtMatmulPlan plan;
  Buf compressed, workspace;
  int64_t m_pad;
  std::string error;
  // with_plan false: the compressed operand only (a plan does not depend on the data pointers,
  // so the timing copies of one shape share the first copy's plan and workspace).
  LtRunner(gpu::LtContext* c, const Problem& p, bool with_plan = true)
      : ctx(c), m_pad(gpu::lt_padded_rows(p.M)) {
    Buf wt(p.N * p.K * esize(p.t));
    wt.poison();
    CUDA_OK(gpu::decompress(p.t, p.values.p, p.meta.get<uint8_t>(), p.K, p.N, true, wt.p, 0));
    error = operand.init(ctx, p.t, p.K, p.N);
    if (!error.empty()) return;
    compressed = Buf(operand.compressed_bytes());
    Buf scratch(operand.scratch_bytes());
    error = operand.compress(wt.p, compressed.p, scratch.p, 0);
    if (!error.empty()) return;
    CUDA_OK(cudaDeviceSynchronize());
    if (!with_plan) return;
    error = plan.init(ctx, p.t, m_pad, p.K, p.N);
    if (!error.empty()) return;
    workspace = Buf(plan.workspace_bytes());
  }
};

// y [m, N] = x[:m] @ W with cuBLAS (the op's dense path, gpu_blas.h).
// exact_reduction: as the op's fallback runs it (checks); false: cuBLAS' default math, what
// TensorFlow and PyTorch run (the timed baseline).
void cublas_run(const Problem& p, int64_t m, const void* w, const void* x, void* y,
                bool exact_reduction = true) {
  const std::string error = gpu::dense_gemm(p.t, x, w, m, p.K, p.N, y, 0, exact_reduction);
  if (!error.empty()) die(1, error);
}

// ---------------------------------------------------------------------------------------------
// Checks.

void check_format(DType t, int64_t K, int64_t N) {
  Problem p(t, 1, K, N);
  const unsigned long long bad = p.compress();
  std::vector<uint8_t> ref_v, ref_m;
  const std::vector<uint8_t> hw = p.w.host();
  cpu_compress(t, hw, K, N, &ref_v, &ref_m);
  const std::string shape = fmt("%s K=%ld N=%ld", dname(t), (long)K, (long)N);
  verdict(bad == gpu::kNoError, "compress reports no bad group on 2:4 input, " + shape);
  verdict(p.values.host() == ref_v && p.meta.host() == ref_m,
          "compress == CPU reference, values and meta bit for bit, " + shape);
  // Decompress both ways: W with every -0.0 as +0.0, and its transpose.
  std::vector<uint8_t> canon = hw;
  const int es = esize(t);
  for (int64_t i = 0; i < K * N; ++i) {
    if (!is_nonzero(t, hw.data(), i)) std::memset(&canon[i * es], 0, es);
  }
  std::vector<uint8_t> canon_t(canon.size());
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) std::memcpy(&canon_t[(n * K + k) * es], &canon[(k * N + n) * es], es);
  Buf dense(K * N * es);
  for (bool transposed : {false, true}) {
    dense.poison();
    CUDA_OK(gpu::decompress(t, p.values.p, p.meta.get<uint8_t>(), K, N, transposed, dense.p, 0));
    verdict(dense.host() == (transposed ? canon_t : canon),
            std::string("decompress") + (transposed ? " to W^T" : "") + " == W, " + shape);
  }
  // Meta check: none on valid meta; then a descending pair in row n=N/2, group g=1.
  Buf slots(2 * sizeof(unsigned long long));
  unsigned long long got[2];
  CUDA_OK(gpu::reset_error_slots(slots.get<unsigned long long>(), 2, 0));
  CUDA_OK(gpu::check_meta(p.meta.get<uint8_t>(), K, N, slots.get<unsigned long long>(), 0));
  CUDA_OK(cudaMemcpy(got, slots.p, sizeof(got), cudaMemcpyDeviceToHost));
  verdict(got[0] == gpu::kNoError && got[1] == gpu::kNoError, "check_meta accepts compress output, " + shape);
  if (K >= 8) {
    const int64_t n = N / 2, byte_index = n * ((K + 7) / 8);
    uint8_t byte;
    CUDA_OK(cudaMemcpy(&byte, p.meta.get<uint8_t>() + byte_index, 1, cudaMemcpyDeviceToHost));
    byte = static_cast<uint8_t>((byte & 0x0f) | (0x6 << 4));  // group 1: positions (2, 1)
    CUDA_OK(cudaMemcpy(p.meta.get<uint8_t>() + byte_index, &byte, 1, cudaMemcpyHostToDevice));
    CUDA_OK(gpu::reset_error_slots(slots.get<unsigned long long>(), 2, 0));
    CUDA_OK(gpu::check_meta(p.meta.get<uint8_t>(), K, N, slots.get<unsigned long long>(), 0));
    CUDA_OK(cudaMemcpy(got, slots.p, sizeof(got), cudaMemcpyDeviceToHost));
    verdict(got[0] == static_cast<unsigned long long>(n * (K / 4) + 1),
            fmt("check_meta names row n=%ld group g=1 (got index %llu), ", (long)n, got[0]) + shape);
  }
  // Fingerprint (the op's cache key): equal for equal bytes at another address, different after
  // one value byte changes.
  auto fingerprint = [&](const Buf& v, const Buf& m) {
    Buf sum(sizeof(unsigned long long));
    CUDA_OK(gpu::fingerprint_weight(v.p, v.bytes, m.get<uint8_t>(), m.bytes,
                                    sum.get<unsigned long long>(), 0));
    unsigned long long h;
    CUDA_OK(cudaMemcpy(&h, sum.p, sizeof(h), cudaMemcpyDeviceToHost));
    return h;
  };
  {
    Buf v2(p.values.bytes), m2(p.meta.bytes);
    CUDA_OK(cudaMemcpy(v2.p, p.values.p, v2.bytes, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(m2.p, p.meta.p, m2.bytes, cudaMemcpyDeviceToDevice));
    const unsigned long long same = fingerprint(p.values, p.meta), copy = fingerprint(v2, m2);
    const uint8_t flip = 0x01;
    CUDA_OK(cudaMemcpy(v2.get<uint8_t>() + v2.bytes - 1, &flip, 1, cudaMemcpyHostToDevice));
    const unsigned long long changed = fingerprint(v2, m2);
    verdict(same == copy && changed != same, "fingerprint: same bytes -> same, one byte changed -> differs, " + shape);
  }
  // Non-2:4 input: three non-zeros in two groups; the first in memory order (g, n) is reported.
  const int64_t g_a = K / 4 - 1, n_a = N - 1, g_b = K / 4 - 1, n_b = N / 3;
  for (auto [g, n] : {std::pair<int64_t, int64_t>{g_a, n_a}, {g_b, n_b}}) {
    for (int r = 0; r < 3; ++r) {
      std::vector<uint8_t> one(es);
      if (t == DType::kFloat32) { float v = 0.5f; std::memcpy(one.data(), &v, 4); }
      else { uint16_t v = t == DType::kBFloat16 ? 0x3f00 : 0x3800; std::memcpy(one.data(), &v, 2); }
      CUDA_OK(cudaMemcpy(p.w.get<uint8_t>() + ((4 * g + r) * N + n) * es, one.data(), es, cudaMemcpyHostToDevice));
    }
  }
  const unsigned long long first = p.compress();
  verdict(first == static_cast<unsigned long long>(g_b * N + std::min(n_a, n_b)),
          fmt("compress names the first non-2:4 group g=%ld n=%ld (got index %llu), ", (long)g_b,
              (long)std::min(n_a, n_b), first) + shape);
}

void check_matmul(gpu::LtContext* ctx, DType t, int64_t M, int64_t K, int64_t N) {
  Problem p(t, M, K, N);
  p.compress_2to4();
  const std::string shape = fmt("%s M=%ld K=%ld N=%ld", dname(t), (long)M, (long)K, (long)N);
  const int rows = static_cast<int>(std::min<int64_t>(M, 64));
  Buf y(M * N * esize(t));
  y.poison();
  CUDA_OK(gpu::spmm_simple(t, p.x.p, p.values.p, p.meta.get<uint8_t>(), M, K, N, y.p, 0));
  CUDA_OK(cudaDeviceSynchronize());
  Check c = check_product(p, y, M, rows);
  verdict(correct(c, t),
          fmt("fallback spmm_simple rel err %.2e, unwritten %ld, ", c.rel_err, (long)c.bad_outputs) + shape);
  // The op's repair path: spmm_simple_unless leaves y alone when the weight's fingerprint is the
  // expected one, and computes it when not.
  {
    Buf fp(sizeof(unsigned long long));
    CUDA_OK(gpu::fingerprint_weight(p.values.p, p.values.bytes, p.meta.get<uint8_t>(),
                                    p.meta.bytes, fp.get<unsigned long long>(), 0));
    unsigned long long now;
    CUDA_OK(cudaMemcpy(&now, fp.p, sizeof(now), cudaMemcpyDeviceToHost));
    y.poison();
    CUDA_OK(gpu::spmm_simple_unless(t, p.x.p, p.values.p, p.meta.get<uint8_t>(), M, K, N, y.p,
                                    fp.get<unsigned long long>(), now, 0));
    const std::vector<uint8_t> untouched = y.host();
    const bool all_poison = std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 0xff; });
    y.poison();
    CUDA_OK(gpu::spmm_simple_unless(t, p.x.p, p.values.p, p.meta.get<uint8_t>(), M, K, N, y.p,
                                    fp.get<unsigned long long>(), now + 1, 0));
    CUDA_OK(cudaDeviceSynchronize());
    c = check_product(p, y, M, rows);
    verdict(all_poison && correct(c, t),
            fmt("spmm_simple_unless: skips on the expected fingerprint (%s), computes otherwise "
                "(rel err %.2e), ", all_poison ? "y untouched" : "y WRITTEN", c.rel_err) + shape);
  }
  if (t == DType::kFloat32) return;
  y.poison();
  cublas_run(p, M, p.w.p, p.x.p, y.p);
  CUDA_OK(cudaDeviceSynchronize());
  c = check_product(p, y, M, rows);
  verdict(correct(c, t),
          fmt("cuBLAS dense rel err %.2e, unwritten %ld, ", c.rel_err, (long)c.bad_outputs) + shape);
  if (!gpu::lt_unsupported_reason(t, K, N).empty()) return;
  if (ctx == nullptr) return skipped("cuSPARSELt matmul (library not loaded), " + shape);
  LtRunner lt(ctx, p);
  if (!lt.error.empty()) return verdict(false, "cuSPARSELt refused " + shape + ": " + lt.error);
  // cuSPARSELt sees x padded to m_pad rows (pad rows random too: they must not leak into y).
  Buf xp(lt.m_pad * K * esize(t)), yp(lt.m_pad * N * esize(t));
  fill_dense<<<grid_for(lt.m_pad * K), 256>>>(t, xp.p, lt.m_pad * K, next_seed());
  LAUNCH_OK();
  CUDA_OK(cudaMemcpy(xp.p, p.x.p, p.x.bytes, cudaMemcpyDeviceToDevice));
  yp.poison();
  if (const std::string e = lt.plan.run(lt.compressed.p, xp.p, yp.p, lt.workspace.p, 0); !e.empty()) {
    return verdict(false, "cuSPARSELt matmul failed, " + shape + ": " + e);
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(y.p, yp.p, y.bytes, cudaMemcpyDeviceToDevice));
  c = check_product(p, y, M, rows);
  std::vector<uint8_t> pad = yp.host();
  int64_t pad_nan = 0;
  for (int64_t i = M * N; i < lt.m_pad * N; ++i) pad_nan += !std::isfinite(to_double(t, pad.data(), i));
  verdict(correct(c, t) && pad_nan == 0,
          fmt("cuSPARSELt rel err %.2e, unwritten %ld (+%ld in pad rows), M padded to %ld, ",
              c.rel_err, (long)c.bad_outputs, (long)pad_nan, (long)lt.m_pad) + shape);
}

// ---------------------------------------------------------------------------------------------
// The TF ops' own GPU logic (gpu_matmul.h), driven as the TF kernels drive it, with a
// stream-ordered allocator like TensorFlow's.

// Busy-waits on the device for `ms` milliseconds (keeps later work on the stream queued).
__global__ void spin_kernel(unsigned long long ms) {
#ifdef __CUDA_ARCH__  // device code only: tests/test_gpu_on_cpu.py compiles this file for the CPU
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ms * 1000000ull);
#endif
}

bool g_memory_pools = true;  // cudaDevAttrMemoryPoolsSupported, read in main

// Stream-ordered like TensorFlow's allocator (cudaMallocAsync); plain cudaMalloc/cudaFree where
// the device has no memory pools (cudaFree then waits for the device).
gpu::Allocator stream_allocator(cudaStream_t stream) {
  return [stream](size_t bytes, gpu::DeviceBuffer* out) -> gpu::Status {
    void* p = nullptr;
    const cudaError_t e = g_memory_pools ? cudaMallocAsync(&p, bytes, stream) : cudaMalloc(&p, bytes);
    if (e != cudaSuccess) return {gpu::Status::kResourceExhausted, cudaGetErrorString(e)};
    if (g_memory_pools) {
      *out = gpu::DeviceBuffer(p, [stream](void* q) { cudaFreeAsync(q, stream); });
    } else {
      *out = gpu::DeviceBuffer(p, [](void* q) { cudaFree(q); });
    }
    return {};
  };
}

// Copies b's weight (dense W, values, meta) over a's buffers: a's weight changes in place.
void overwrite_weight(Problem& a, const Problem& b) {
  CUDA_OK(cudaMemcpy(a.w.p, b.w.p, a.w.bytes, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaMemcpy(a.values.p, b.values.p, a.values.bytes, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaMemcpy(a.meta.p, b.meta.p, a.meta.bytes, cudaMemcpyDeviceToDevice));
}

void check_tf_op_logic(DType t, cudaStream_t stream) {
  const int64_t M = 40, K = 512, N = 256;  // cuSPARSELt takes it (bf16/fp16); M padded to 48
  const std::string shape = fmt("%s M=%ld K=%ld N=%ld", dname(t), (long)M, (long)K, (long)N);
  const gpu::Allocator alloc = stream_allocator(stream);
  std::vector<std::string> logs;
  // The weights it caches (p, more) live to the end of this function, so no later Problem gets a
  // cached weight's addresses (that would be a cache hit). Declared first: destroyed last, while
  // the caller's stream, on which its buffers are freed, still exists.
  const size_t capacity = 8;  // weights; the byte limit is checked on its own below
  gpu::SparseMatMul mm([&](const std::string&, const std::string& m) { logs.push_back(m); },
                       /*trust_weight_address=*/false,
                       gpu::CacheLimits{capacity, std::numeric_limits<size_t>::max()});
  Buf y(M * N * esize(t));
  auto check_y = [&](const Problem& p, int64_t rows, const std::string& what) {
    CUDA_OK(cudaStreamSynchronize(stream));
    const Check c = check_product(p, y, rows, 8);
    verdict(correct(c, t),
            fmt("SparseMatMul %s: rel err %.2e, unwritten %ld, ", what.c_str(), c.rel_err,
                (long)c.bad_outputs) + shape);
  };
  // float16/bfloat16 weights are cached as cuSPARSELt's operand; float32 goes to the fallback,
  // which caches the decompressed weight for cuBLAS (more than kPlainMaxRows rows of x) and runs
  // the plain kernel, uncached, for fewer rows. The same cache logic is checked on either form.
  const bool lt = gpu::lt_unsupported_reason(t, K, N).empty();
  int want_plain = 0, want_dense = 0;  // fallback calls made so far, by path
  // One op call on p through `cache` (y poisoned first, in stream order); checks y unless wait
  // is false.
  auto call_on = [&](gpu::SparseMatMul& cache, Problem& p, const std::string& what,
                     bool wait = true, int64_t rows = 0) {
    if (rows == 0) rows = M;
    CUDA_OK(cudaMemsetAsync(y.p, 0xff, y.bytes, stream));
    const gpu::MatMulArgs args{t, p.x.p, p.values.p, p.meta.get<uint8_t>(), rows, K, N, y.p};
    const gpu::Status status = cache.run(args, alloc, stream);
    if (!status.ok()) {
      verdict(false, "SparseMatMul " + what + ": " + status.message + ", " + shape);
      return status;
    }
    if (wait) check_y(p, rows, what);
    return status;
  };
  // The same through `mm`, counting its fallback calls by path.
  auto call = [&](Problem& p, const std::string& what, bool wait = true, int64_t rows = 0) {
    const gpu::Status status = call_on(mm, p, what, wait, rows);
    if (status.ok() && !lt) {
      ++((rows == 0 ? M : rows) > gpu::SparseMatMul::kPlainMaxRows ? want_dense : want_plain);
    }
    return status;
  };
  // `made`: weights put into the cache's form so far (compressed, or decompressed for cuBLAS).
  auto stats_are = [&](size_t cached, int made, const std::string& what) {
    const gpu::SparseMatMul::Stats s = mm.stats();
    const int compressions = lt ? made : 0, decompressions = lt ? 0 : made;
    verdict(s.cached_weights == cached && s.compressions == compressions &&
                s.decompressions == decompressions && s.plain_calls == want_plain &&
                s.dense_calls == want_dense,
            fmt("SparseMatMul %s: %zu cached / %d compressions / %d decompressions / %d plain / "
                "%d dense calls (want %zu / %d / %d / %d / %d), ", what.c_str(),
                s.cached_weights, s.compressions, s.decompressions, s.plain_calls, s.dense_calls,
                cached, compressions, decompressions, want_plain, want_dense) + shape);
  };
  auto fresh = [&] {
    auto q = std::make_unique<Problem>(t, M, K, N);
    q->compress_2to4();
    return q;
  };
  std::unique_ptr<Problem> p = fresh(), other = fresh(), bad = fresh();
  std::vector<std::unique_ptr<Problem>> more;
  call(*p, "first call (cached)");
  stats_are(1, 1, "first call");
  if (!lt) {
    verdict(!logs.empty() && logs[0].find("dense cuBLAS matmul") != std::string::npos,
            "SparseMatMul logs the fallback, " + shape);
  }
  call(*p, "cached call");
  stats_are(1, 1, "cached call");
  // Changed in place (same buffers): this call must repair y on the device...
  overwrite_weight(*p, *other);
  call(*p, "call after an in-place change (repaired)");
  stats_are(1, 1, "in-place change");
  // ...and the next one, having seen the fingerprint, makes the cached form again.
  call(*p, "next call (cached again)");
  stats_are(1, 2, "cached again");
  // A call whose predecessor's fingerprint copy has not landed yet (the stream is held by a
  // spinning kernel): the not-ready event must not fail it, and its y must be right. Needs the
  // stream-ordered allocator: a cudaFree inside the first call would wait for the spin.
  if (!g_memory_pools) {
    skipped("not-ready fingerprint event: this device has no memory pools, " + shape);
  } else {
    spin_kernel<<<1, 1, 0, stream>>>(200);
    LAUNCH_OK();
    call(*p, "queued call", /*wait=*/false);
    call(*p, "call while the previous fingerprint is in flight", /*wait=*/false);
    const cudaError_t busy = cudaStreamQuery(stream);
    (void)cudaGetLastError();  // cudaErrorNotReady is recorded as the last error
    verdict(busy == cudaErrorNotReady,
            "the spinning kernel still held the stream (the not-ready path ran), " + shape);
    check_y(*p, M, "call while the previous fingerprint was in flight");
    const gpu::Status later = call(*p, "the call after that");
    verdict(later.ok(), "SparseMatMul: a not-ready fingerprint event is not an error, " + shape);
  }
  // More weights than the cache holds, p used again just before the last one: least recently
  // used goes (more[0]), not first inserted (p).
  for (size_t i = 0; i < capacity; ++i) {
    more.push_back(fresh());
    if (i + 1 == capacity) call(*p, "cached call between new weights");
    call(*more.back(), fmt("new weight %zu", i + 1));
  }
  const int inserted = 2 + static_cast<int>(capacity);
  stats_are(capacity, inserted, "cache full");
  call(*p, "recently used weight (kept)");
  stats_are(capacity, inserted, "recently used weight kept");
  call(*more[0], "least recently used weight (evicted, cached again)");
  stats_are(capacity, inserted + 1, "least recently used weight cached again");
  if (!lt) {  // few rows: the plain kernel on the stored format, beside the cache
    call(*p, "fallback, plain kernel", true, gpu::SparseMatMul::kPlainMaxRows);
    stats_are(capacity, inserted + 1, "fallback, plain kernel");
  }
  auto prepared = [](const gpu::SparseMatMul::Stats& s) {
    return s.compressions + s.decompressions;  // weights made into the cache's form
  };
  // A byte limit of two and a half weights keeps two, the least recently used going first: p,
  // other, more[1] leave other and more[1]; p again is prepared again and leaves more[1] and p.
  const size_t per_weight = mm.stats().cached_bytes / capacity;
  {
    gpu::SparseMatMul small([](const std::string&, const std::string&) {}, false,
                            gpu::CacheLimits{capacity, per_weight * 5 / 2});
    for (Problem* q : {p.get(), other.get(), more[1].get(), p.get()}) {
      call_on(small, *q, "under a byte limit");
    }
    const gpu::SparseMatMul::Stats s = small.stats();
    verdict(per_weight > 0 && s.cached_weights == 2 && s.cached_bytes == 2 * per_weight &&
                prepared(s) == 4,
            fmt("SparseMatMul under a byte limit of %zu: %zu cached, %zu bytes, %d prepared "
                "(want 2, %zu, 4), ", per_weight * 5 / 2, s.cached_weights, s.cached_bytes,
                prepared(s), 2 * per_weight) + shape);
  }
  // The default limits keep a model's worth of weights, as one eager kernel serves them all: p,
  // other and every `more` weight (10, more than the 8 of the first version), then p again (a hit).
  {
    gpu::SparseMatMul whole([](const std::string&, const std::string&) {}, false);
    std::vector<Problem*> order{p.get(), other.get()};
    for (const auto& q : more) order.push_back(q.get());
    for (Problem* q : order) call_on(whole, *q, "under the default limits");
    call_on(whole, *p, "under the default limits, first weight again");
    const gpu::SparseMatMul::Stats s = whole.stats();
    verdict(s.cached_weights == order.size() && prepared(s) == static_cast<int>(order.size()),
            fmt("SparseMatMul under the default limits: %zu cached, %d prepared (want %zu, %zu), ",
                s.cached_weights, prepared(s), order.size(), order.size()) + shape);
  }
  // Invalid meta on a new weight (row n=N-1, group g=1): named, before any result.
  const uint8_t invalid = 0x5e;  // byte 0: group 0 at positions (2, 3), group 1 at (1, 1)
  CUDA_OK(cudaMemcpy(bad->meta.get<uint8_t>() + (N - 1) * ((K + 7) / 8), &invalid, 1,
                     cudaMemcpyHostToDevice));
  const gpu::MatMulArgs bad_args{t, bad->x.p, bad->values.p, bad->meta.get<uint8_t>(),
                                 M, K, N, y.p};
  const gpu::Status status = mm.run(bad_args, alloc, stream);
  const std::string want = fmt("Sparse24MatMul: invalid meta: row n=%ld, group g=1 ", (long)(N - 1));
  verdict(status.code == gpu::Status::kInvalidArgument &&
              status.message.find(want) != std::string::npos,
          "SparseMatMul names invalid meta (\"" + status.message + "\"), " + shape);
  // Sparse24Decompress: the same meta refused and named, nothing written; valid meta decompressed
  // like the unchecked kernel (checked against the CPU reference in check_format).
  Buf w_checked(K * N * esize(t)), w_plain(K * N * esize(t));
  w_checked.poison();
  const std::vector<uint8_t> poisoned = w_checked.host();
  const gpu::Status refused = gpu::decompress_checked(t, bad->values.p, bad->meta.get<uint8_t>(),
                                                      K, N, w_checked.p, alloc, stream);
  const std::string want_d = fmt("Sparse24Decompress: invalid meta: row n=%ld, group g=1 ",
                                 (long)(N - 1));
  CUDA_OK(cudaStreamSynchronize(stream));
  verdict(refused.code == gpu::Status::kInvalidArgument &&
              refused.message.find(want_d) != std::string::npos && w_checked.host() == poisoned,
          "decompress_checked names invalid meta, writes nothing (\"" + refused.message + "\"), " +
              shape);
  w_plain.poison();
  const gpu::Status accepted = gpu::decompress_checked(t, p->values.p, p->meta.get<uint8_t>(), K,
                                                       N, w_checked.p, alloc, stream);
  CUDA_OK(gpu::decompress(t, p->values.p, p->meta.get<uint8_t>(), K, N, false, w_plain.p, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  verdict(accepted.ok() && w_checked.host() == w_plain.host(),
          "decompress_checked == decompress on valid meta (" + accepted.message + "), " + shape);
  // compress_checked names the first non-2:4 group like format.compress.
  const float half = 0.5f;
  const uint16_t half16 = t == DType::kBFloat16 ? 0x3f00 : 0x3800;
  for (int r = 0; r < 3; ++r) {  // three non-zeros in group g=2 of column n=5
    CUDA_OK(cudaMemcpy(bad->w.get<uint8_t>() + ((8 + r) * N + 5) * esize(t),
                       t == DType::kFloat32 ? static_cast<const void*>(&half) : &half16,
                       esize(t), cudaMemcpyHostToDevice));
  }
  const gpu::Status compress_status = gpu::compress_checked(
      t, bad->w.p, K, N, bad->values.p, bad->meta.get<uint8_t>(), alloc, stream);
  verdict(compress_status.code == gpu::Status::kInvalidArgument &&
              compress_status.message.find("group g=2 (rows k=8..11) of column n=5") !=
                  std::string::npos,
          "compress_checked names the group (\"" + compress_status.message + "\"), " + shape);
  CUDA_OK(cudaStreamSynchronize(stream));
}

// The op's fallback on one shape, two calls: cuBLAS on the decompressed weight (made on the first
// call, cached for the second) above kPlainMaxRows rows of x, the plain kernel up to it; each y
// against float64, and the path taken.
void check_fallback(DType t, int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
  const std::string shape = fmt("%s M=%ld K=%ld N=%ld", dname(t), (long)M, (long)K, (long)N);
  if (gpu::lt_unsupported_reason(t, K, N).empty()) die(1, "check_fallback: cuSPARSELt takes " + shape);
  Problem p(t, M, K, N);
  p.compress_2to4();
  Buf y(M * N * esize(t));
  // One op call into poisoned y; its status, y against float64, and the op's counters after it.
  auto call = [&](gpu::SparseMatMul& mm, const gpu::Allocator& alloc, gpu::Status* status) {
    CUDA_OK(cudaMemsetAsync(y.p, 0xff, y.bytes, stream));
    const gpu::MatMulArgs args{t, p.x.p, p.values.p, p.meta.get<uint8_t>(), M, K, N, y.p};
    *status = mm.run(args, alloc, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    return std::make_pair(check_product(p, y, M, static_cast<int>(std::min<int64_t>(M, 16))),
                          mm.stats());
  };
  gpu::SparseMatMul mm([](const std::string&, const std::string&) {}, false);
  const bool dense = M > gpu::SparseMatMul::kPlainMaxRows;
  for (int n_call = 1; n_call <= 2; ++n_call) {
    gpu::Status status;
    const auto [c, s] = call(mm, stream_allocator(stream), &status);
    const bool path_ok = dense ? s.dense_calls == n_call && s.plain_calls == 0 &&
                                     s.decompressions == 1 && s.cached_weights == 1
                               : s.plain_calls == n_call && s.dense_calls == 0 &&
                                     s.decompressions == 0 && s.cached_weights == 0;
    verdict(status.ok() && correct(c, t) && path_ok,
            fmt("SparseMatMul fallback call %d (%s) rel err %.2e, unwritten %ld, %d dense / %d "
                "plain calls, %d decompressions, %zu cached, %s", n_call,
                dense ? "cuBLAS on the cached decompressed weight" : "plain kernel", c.rel_err,
                (long)c.bad_outputs, s.dense_calls, s.plain_calls, s.decompressions,
                s.cached_weights, status.message.c_str()) + shape);
  }
  if (!dense) return;
  // No memory for the dense weight (an allocator refusing that size): the plain kernel computes y.
  const size_t dense_bytes = K * N * esize(t);
  const gpu::Allocator full = stream_allocator(stream);
  const gpu::Allocator tight = [&](size_t bytes, gpu::DeviceBuffer* out) -> gpu::Status {
    if (bytes >= dense_bytes) return {gpu::Status::kResourceExhausted, "refused by the harness"};
    return full(bytes, out);
  };
  std::vector<std::string> logs;
  gpu::SparseMatMul tight_mm([&](const std::string&, const std::string& m) { logs.push_back(m); },
                             false);
  gpu::Status status;
  const auto [c, s] = call(tight_mm, tight, &status);
  const bool logged =
      !logs.empty() && logs.back().find("no memory for the decompressed weight") != std::string::npos;
  verdict(status.ok() && correct(c, t) && s.plain_calls == 1 &&
              s.dense_calls == 0 && s.cached_weights == 0 && logged,
          fmt("SparseMatMul fallback without memory for the dense weight: plain kernel, rel err "
              "%.2e, unwritten %ld, %d plain calls, %zu cached, logged %d, %s", c.rel_err,
              (long)c.bad_outputs, s.plain_calls, s.cached_weights, (int)logged,
              status.message.c_str()) + shape);
}

// NaN/Inf in x through the op (SparseMatMul::run), whichever path the shape takes: y must be NaN,
// +Inf or -Inf exactly where a float64 dense x @ W is (0 * Inf = NaN at W's zeros, which the
// 2:4 kernels skip), and every finite output within check_product's per-element bound.
void check_nonfinite(DType t, int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
  Problem p(t, M, K, N);
  p.compress_2to4();
  const uint32_t nan = t == DType::kFloat32 ? 0x7fc00000u : t == DType::kFloat16 ? 0x7e00u : 0x7fc0u;
  const uint32_t inf = t == DType::kFloat32 ? 0x7f800000u : t == DType::kFloat16 ? 0x7c00u : 0x7f80u;
  const uint32_t minus = t == DType::kFloat32 ? 0x80000000u : 0x8000u;
  struct Poke { int64_t m, k; uint32_t bits; };
  for (const Poke& q : {Poke{1, 5, nan}, Poke{2, 9, inf}, Poke{3, 12, inf}, Poke{3, 13, inf | minus},
                        Poke{M - 1, K - 1, inf | minus}}) {  // little-endian: the low bytes
    CUDA_OK(cudaMemcpy(p.x.get<uint8_t>() + (q.m * K + q.k) * esize(t), &q.bits, esize(t),
                       cudaMemcpyHostToDevice));
  }
  Buf y(M * N * esize(t));
  CUDA_OK(cudaMemsetAsync(y.p, 0xff, y.bytes, stream));
  gpu::SparseMatMul mm([](const std::string&, const std::string&) {}, false);
  const gpu::MatMulArgs args{t, p.x.p, p.values.p, p.meta.get<uint8_t>(), M, K, N, y.p};
  const gpu::Status status = mm.run(args, stream_allocator(stream), stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  const gpu::SparseMatMul::Stats s = mm.stats();
  const char* path = s.dense_calls ? "cuBLAS" : s.plain_calls ? "plain kernel" : "cuSPARSELt";
  const std::vector<uint8_t> hw = p.w.host(), hx = p.x.host(), hy = y.host();
  auto kind = [](double v) { return std::isnan(v) ? 'N' : std::isinf(v) ? (v > 0 ? '+' : '-') : 'f'; };
  int64_t nans = 0, infs = 0, misclassified = 0, outliers = 0, bad_m = -1, bad_n = -1;
  std::vector<double> acc, mag;
  for (int64_t m = 0; m < M; ++m) {
    reference_row(p, hx, hw, m, &acc, &mag);
    for (int64_t n = 0; n < N; ++n) {
      const double got = to_double(t, hy.data(), m * N + n);
      nans += std::isnan(acc[n]);
      infs += std::isinf(acc[n]);
      if (kind(got) != kind(acc[n])) {
        if (misclassified++ == 0) bad_m = m, bad_n = n;
      } else if (kind(got) == 'f' && !(std::fabs(got - acc[n]) <= element_bound(t, K, acc[n], mag[n]))) {
        ++outliers;
      }
    }
  }
  verdict(status.ok() && misclassified == 0 && outliers == 0 && nans > 0 && infs > 0,
          fmt("SparseMatMul (%s) with NaN/Inf in x: %ld NaN and %ld +-Inf outputs in float64, "
              "%ld classified otherwise (first: row %ld, column %ld), %ld finite ones beyond the "
              "bound %s, ", path, (long)nans, (long)infs, (long)misclassified, (long)bad_m,
              (long)bad_n, (long)outliers, status.message.c_str()) +
              fmt("%s M=%ld K=%ld N=%ld", dname(t), (long)M, (long)K, (long)N));
}

// ---------------------------------------------------------------------------------------------
// Timing: median over `reps` batches of `per` launches each, CUDA events, after warm-up.

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[v.size() / 2];
}

double time_ms(const std::function<void(int)>& launch, int copies, int warmup, int reps) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  int i = 0;
  for (int w = 0; w < warmup; ++w) launch(i++ % copies);
  CUDA_OK(cudaEventRecord(a));
  launch(i++ % copies);
  CUDA_OK(cudaEventRecord(b));
  CUDA_OK(cudaEventSynchronize(b));
  float one = 0;
  CUDA_OK(cudaEventElapsedTime(&one, a, b));
  const int per = std::clamp(static_cast<int>(0.5 / std::max(one, 1e-4f)), 1, 200);
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    CUDA_OK(cudaEventRecord(a));
    for (int j = 0; j < per; ++j) launch(i++ % copies);
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    samples.push_back(ms / per);
  }
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  return median(samples);
}

struct Row {
  std::string dtype;
  int64_t M, K, N;
  double dense_ms, lt_ms, lt_search_ms, op_ms, err;
  int config, copies;
};

void print_header() {
  out("%-5s %6s %6s %6s | %10s %10s %10s %10s | %8s %8s %8s | %8s %8s | %8s %6s\n", "dtype", "M",
      "K", "N", "cuBLAS ms", "Lt ms", "Lt* ms", "op ms", "Lt/dense", "Lt*/dns", "op/dns",
      "TF/s dns", "TF/s Lt*", "rel err", "copies");
}

// One table row to the log, and to the CSV (flushed: a later fatal error keeps what was measured).
void print_row(const Row& r, FILE* csv) {
  const double flop = 2.0 * r.M * r.K * r.N;
  out("%-5s %6ld %6ld %6ld | %10.4f %10.4f %10.4f %10.4f | %7.2fx %7.2fx %7.2fx | %8.1f %8.1f | "
      "%8.1e %6d\n",
      r.dtype.c_str(), (long)r.M, (long)r.K, (long)r.N, r.dense_ms, r.lt_ms, r.lt_search_ms,
      r.op_ms, r.dense_ms / r.lt_ms, r.dense_ms / r.lt_search_ms, r.dense_ms / r.op_ms,
      flop / r.dense_ms / 1e9, flop / r.lt_search_ms / 1e9, r.err, r.copies);
  if (csv) {
    fprintf(csv, "%s,%ld,%ld,%ld,%.6f,%.6f,%.6f,%d,%.3e,%d,%.6f\n", r.dtype.c_str(), (long)r.M,
            (long)r.K, (long)r.N, r.dense_ms, r.lt_ms, r.lt_search_ms, r.config, r.err, r.copies,
            r.op_ms);
    fflush(csv);
  }
}

Row bench(gpu::LtContext* ctx, DType t, int64_t M, int64_t K, int64_t N,
          int warmup, int reps, int check_rows, size_t l2_bytes) {
  const int64_t m_pad = gpu::lt_padded_rows(M), es = esize(t);
  // Enough copies of the operands, used in turn, that the timed calls read them from memory
  // rather than from L2 (> 3x L2 in all; 38 copies of a batch-1 768x3072 bf16 problem on an H200).
  const size_t set_bytes = (K * N + m_pad * K + m_pad * N) * es;
  const int copies = static_cast<int>(std::clamp<size_t>(3 * l2_bytes / set_bytes + 1, 1, 64));
  std::vector<Problem> ps;  // x has m_pad rows; cuBLAS uses and the check reads the first M
  ps.reserve(copies);
  std::vector<std::unique_ptr<LtRunner>> lts;
  std::vector<Buf> ys;
  for (int c = 0; c < copies; ++c) {
    ps.emplace_back(t, m_pad, K, N);
    ps.back().compress_2to4();
    lts.push_back(std::make_unique<LtRunner>(ctx, ps.back(), /*with_plan=*/c == 0));
    ys.emplace_back(m_pad * N * es);
  }
  CUDA_OK(cudaDeviceSynchronize());
  Row row{dname(t), M, K, N, 0, NAN, NAN, NAN, NAN, -1, copies};
  row.dense_ms = time_ms(
      [&](int i) { cublas_run(ps[i], M, ps[i].w.p, ps[i].x.p, ys[i].p, /*exact_reduction=*/false); },
      copies, warmup, reps);
  const std::string shape =
      fmt("bench shape %s M=%ld K=%ld N=%ld: ", dname(t), (long)M, (long)K, (long)N);
  for (auto& lt : lts) {
    if (lt->error.empty()) continue;
    verdict(false, shape + "cuSPARSELt refused it: " + lt->error);
    return row;
  }
  LtRunner& lt0 = *lts[0];  // its plan and workspace serve every copy
  // A failing cusparseLtMatmul ends this row (a failed check), not the whole run.
  std::string lt_error;
  auto lt_launch = [&](int i) {
    if (!lt_error.empty()) return;
    lt_error = lt0.plan.run(lts[i]->compressed.p, ps[i].x.p, ys[i].p, lt0.workspace.p, 0);
  };
  auto lt_failed = [&] {
    if (lt_error.empty()) return false;
    verdict(false, shape + "cuSPARSELt matmul failed: " + lt_error);
    row.lt_ms = row.op_ms = row.lt_search_ms = NAN;
    return true;
  };
  // Correctness of this very shape: copy 0's cuSPARSELt output, poisoned first, against float64.
  auto check_copy0 = [&] {
    ys[0].poison();
    lt_launch(0);
    CUDA_OK(cudaDeviceSynchronize());
    return check_product(ps[0], ys[0], M, check_rows);
  };
  Check c = check_copy0();
  if (lt_failed()) return row;
  row.err = c.bad_outputs || c.outliers ? INFINITY : c.rel_err;
  verdict(correct(c, t),
          shape + fmt("cuSPARSELt rel err %.2e on %d rows, unwritten %ld", c.rel_err, check_rows,
                      (long)c.bad_outputs));
  row.lt_ms = time_ms(lt_launch, copies, warmup, reps);
  if (lt_failed()) return row;
  // The TensorFlow op's device work per call on a cached, unchanged weight (docs/GPU.md): this
  // call's fingerprint of values+meta, the default-config matmul, then the repair kernel, which
  // finds the fingerprint unchanged and leaves y alone, and the NaN/Inf kernel, which reads x and
  // finds it finite. Not in it: the copies padding x and unpadding y, the fingerprint's copy to
  // the host and its event, the host's cache lookup. Timed before the search below changes copy
  // 0's plan.
  Buf checks(copies * sizeof(unsigned long long));
  auto fingerprint_into = [&](int i) {
    CUDA_OK(gpu::fingerprint_weight(ps[i].values.p, ps[i].values.bytes,
                                    ps[i].meta.get<uint8_t>(), ps[i].meta.bytes,
                                    checks.get<unsigned long long>() + i, 0));
  };
  for (int i = 0; i < copies; ++i) fingerprint_into(i);
  std::vector<unsigned long long> expected(copies);
  CUDA_OK(cudaMemcpy(expected.data(), checks.p, checks.bytes, cudaMemcpyDeviceToHost));
  auto op_launch = [&](int i) {
    fingerprint_into(i);
    lt_launch(i);
    CUDA_OK(gpu::spmm_simple_unless(t, ps[i].x.p, ps[i].values.p, ps[i].meta.get<uint8_t>(), M,
                                    K, N, ys[i].p, checks.get<unsigned long long>() + i,
                                    expected[i], 0));
    CUDA_OK(gpu::propagate_nonfinite(t, ps[i].x.p, ps[i].values.p, ps[i].meta.get<uint8_t>(), M,
                                     K, N, ys[i].p, 0));
  };
  ys[0].poison();
  op_launch(0);
  CUDA_OK(cudaDeviceSynchronize());
  c = check_product(ps[0], ys[0], M, check_rows);
  verdict(correct(c, t),
          shape + fmt("op path (fingerprint, matmul, repair skipped, NaN/Inf scan) rel err %.2e, "
                      "unwritten %ld",
                      c.rel_err, (long)c.bad_outputs));
  row.op_ms = time_ms(op_launch, copies, warmup, reps);
  if (lt_failed()) return row;
  // cusparseLtMatmulSearch once, on copy 0; the chosen configuration is reported.
  const std::string error = lt0.plan.search(lt0.compressed.p, ps[0].x.p, ys[0].p, lt0.workspace.p,
                                            0, &row.config);
  if (!error.empty()) {
    verdict(false, shape + error);
    return row;
  }
  lt0.workspace = Buf(lt0.plan.workspace_bytes());
  // The searched configuration must compute the same product.
  c = check_copy0();
  if (lt_failed()) return row;
  verdict(correct(c, t),
          shape + fmt("searched config %d rel err %.2e, unwritten %ld", row.config, c.rel_err,
                      (long)c.bad_outputs));
  row.lt_search_ms = time_ms(lt_launch, copies, warmup, reps);
  if (lt_failed()) return row;
  return row;
}

// ---------------------------------------------------------------------------------------------
// Arguments.

struct Args {
  std::vector<int64_t> sizes{4096, 8192, 16384};
  std::vector<std::pair<int64_t, int64_t>> ffn{{768, 3072}, {3072, 768}, {4096, 11008}, {11008, 4096}};
  std::vector<int64_t> batches{1, 16, 64};
  std::vector<DType> dtypes{DType::kBFloat16, DType::kFloat16};
  int warmup = 10, reps = 30, check_rows = 8;
  std::string cusparselt, cublas, out_dir;
  bool dry_run = false, skip_checks = false, skip_bench = false, small_checks = false;
};

void usage() {
  out("usage: gpu_check [--sizes 4096,8192,16384] [--ffn 768x3072,...(KxN)] [--batches 1,16,64]\n"
      "                 [--dtypes bf16,fp16] [--warmup N] [--reps N] [--check-rows N]\n"
      "                 [--cusparselt PATH/libcusparseLt.so.0] [--cublas PATH/libcublas.so.N]\n"
      "                 [--out DIR] [--skip-checks] [--skip-bench] [--small-checks] [--dry-run]\n"
      "  --dry-run: parse, load the libraries, print the plan; no GPU needed.\n"
      "  --small-checks: the checks' large shapes scaled down, same paths (for the CPU emulation\n"
      "    of tests/test_gpu_on_cpu.py; a GPU run uses the full ones).\n");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(sep, start);
    parts.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return parts;
}

int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < lo || v > hi) {
    usage();
    die(2, flag + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
               "]. Received: '" + s + "'");
  }
  return v;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) { usage(); die(2, flag + " needs a value"); }
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") { usage(); exit(0); }
    else if (flag == "--dry-run") a.dry_run = true;
    else if (flag == "--skip-checks") a.skip_checks = true;
    else if (flag == "--skip-bench") a.skip_bench = true;
    else if (flag == "--small-checks") a.small_checks = true;
    else if (flag == "--sizes") { a.sizes.clear(); for (auto& s : split(value(), ',')) if (!s.empty()) a.sizes.push_back(parse_int(flag, s, 16, 65536)); }
    else if (flag == "--batches") { a.batches.clear(); for (auto& s : split(value(), ',')) if (!s.empty()) a.batches.push_back(parse_int(flag, s, 1, 65536)); }
    else if (flag == "--ffn") {
      a.ffn.clear();
      for (auto& s : split(value(), ',')) {
        if (s.empty()) continue;
        auto kn = split(s, 'x');
        if (kn.size() != 2) { usage(); die(2, "--ffn: expected KxN pairs like 768x3072. Received: '" + s + "'"); }
        a.ffn.emplace_back(parse_int(flag, kn[0], 16, 65536), parse_int(flag, kn[1], 16, 65536));
      }
    } else if (flag == "--dtypes") {
      a.dtypes.clear();
      for (auto& s : split(value(), ',')) {
        if (s == "bf16") a.dtypes.push_back(DType::kBFloat16);
        else if (s == "fp16") a.dtypes.push_back(DType::kFloat16);
        else if (!s.empty()) { usage(); die(2, "--dtypes: bf16 or fp16. Received: '" + s + "'"); }
      }
    }
    else if (flag == "--warmup") a.warmup = static_cast<int>(parse_int(flag, value(), 0, 10000));
    else if (flag == "--reps") a.reps = static_cast<int>(parse_int(flag, value(), 1, 10000));
    else if (flag == "--check-rows") a.check_rows = static_cast<int>(parse_int(flag, value(), 1, 4096));
    else if (flag == "--cusparselt") a.cusparselt = value();
    else if (flag == "--cublas") a.cublas = value();
    else if (flag == "--out") a.out_dir = value();
    else { usage(); die(2, "unknown argument '" + flag + "'"); }
  }
  for (int64_t s : a.sizes) if (s % 16) die(2, "--sizes: each size must be a multiple of 16. Received: " + std::to_string(s));
  for (auto [k, n] : a.ffn) if (k % 16 || n % 16) die(2, "--ffn: K and N must be multiples of 16. Received: " + std::to_string(k) + "x" + std::to_string(n));
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse_args(argc, argv);
  if (!args.out_dir.empty()) {
    const std::string path = args.out_dir + "/gpu_check.log";
    g_log = fopen(path.c_str(), "w");
    if (!g_log) die(2, "--out: cannot write " + path);
  }
  if (!args.cusparselt.empty()) setenv("TF_SPARSE24_CUSPARSELT", args.cusparselt.c_str(), 1);

  out("gpu_check: sizes");
  for (auto s : args.sizes) out(" %ld", (long)s);
  out("; ffn (KxN)");
  for (auto [k, n] : args.ffn) out(" %ldx%ld", (long)k, (long)n);
  out("; batches");
  for (auto b : args.batches) out(" %ld", (long)b);
  out("; dtypes");
  for (auto t : args.dtypes) out(" %s", dname(t));
  out("; warmup %d, reps %d\n", args.warmup, args.reps);

  // Without cuSPARSELt a dry run fails at once; a real run still checks everything that does not
  // need it (compress, decompress, the plain kernel, cuBLAS, the fallback paths, NaN/Inf), skips
  // the rest and the benchmark, and exits 3.
  std::string lt_error;
  const bool lt_loaded = sparse24::lt::load_cusparselt(&lt_error);
  if (!lt_loaded && args.dry_run) die(3, lt_error);
  if (lt_loaded) {
    out("cuSPARSELt: loaded (%s)\n", args.cusparselt.empty() ? "default search path" : args.cusparselt.c_str());
  } else {
    out("cuSPARSELt: NOT LOADED: %s\n  (its checks and the benchmark are skipped; the rest runs)\n",
        lt_error.c_str());
  }
  if (!args.cublas.empty()) setenv("TF_SPARSE24_CUBLAS", args.cublas.c_str(), 1);
  std::string cublas_where;
  if (!gpu::load_cublas(&cublas_where)) die(3, cublas_where + " (pass --cublas PATH)");
  out("cuBLAS: loaded %s\n", cublas_where.c_str());
  if (args.dry_run) { out("dry run: arguments and libraries OK; no GPU work done\n"); return 0; }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) die(3, "no CUDA device visible");
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  CUDA_OK(cudaDriverGetVersion(&driver));
  CUDA_OK(cudaRuntimeGetVersion(&runtime));
  out("device: %s, sm_%d%d, %d SMs, L2 %d MiB, %.0f GiB; driver %d, runtime %d\n", prop.name,
      prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20,
      prop.totalGlobalMem / 1073741824.0, driver, runtime);
  if (prop.major < 8) die(3, "the Sparse Tensor Cores need compute capability 8.0 or newer");
  int pools = 0;
  CUDA_OK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0));
  g_memory_pools = pools != 0;
  out("stream-ordered allocation (memory pools): %s\n", g_memory_pools ? "yes" : "no");
  gpu::LtContext* ctx = nullptr;
  if (lt_loaded) {
    ctx = gpu::LtContext::get(&lt_error);
    if (ctx) out("cuSPARSELt version %d\n", ctx->version());
    else out("cuSPARSELt: NOT USABLE: %s\n  (its checks and the benchmark are skipped)\n", lt_error.c_str());
  }

  if (!args.skip_checks) {
    out("\n== checks (fresh random inputs each run; outputs poisoned with NaN first)\n");
    // big(full, small): a large check shape's dimension, or its --small-checks stand-in (the
    // same paths: multiples of 16 stay multiples of 16, padded row counts stay padded).
    auto big = [&](int64_t full, int64_t small) { return args.small_checks ? small : full; };
    for (DType t : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (auto [K, N] : std::vector<std::pair<int64_t, int64_t>>{
               {20, 12}, {200, 48}, {big(1024, 64), big(4096, 96)}}) {
        check_format(t, K, N);
      }
    }
    for (DType t : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      check_matmul(ctx, t, 3, 20, 12);      // unaligned: fallback only
      check_matmul(ctx, t, 37, 200, 48);    // K not a multiple of 16: fallback only
      check_matmul(ctx, t, 1, big(768, 64), big(3072, 48));    // batch 1, padded to 16 rows
      check_matmul(ctx, t, 50, big(1024, 64), big(256, 32));   // padded to 64 rows
      check_matmul(ctx, t, big(256, 32), big(4096, 128), big(4096, 64));
    }
    cudaStream_t stream;  // outlives each check's SparseMatMul, whose buffers are freed on it
    CUDA_OK(cudaStreamCreate(&stream));
    for (DType t : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      if (ctx != nullptr || t == DType::kFloat32) check_tf_op_logic(t, stream);
      else skipped(std::string("SparseMatMul's cache of cuSPARSELt operands, ") + dname(t));
      check_fallback(t, 3, 20, 12, stream);    // unaligned, plain kernel
      check_fallback(t, 8, 200, 48, stream);   // K % 16 != 0, up to 8 rows: plain kernel
      check_fallback(t, 37, 200, 48, stream);  // the same, cuBLAS on the decompressed weight
    }
    check_fallback(DType::kFloat32, 64, big(1024, 128), big(256, 32), stream);
    for (DType t : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      if (ctx != nullptr || t == DType::kFloat32) {
        check_nonfinite(t, 40, 512, 256, stream);  // cuSPARSELt (fp32: cuBLAS)
        check_nonfinite(t, 8, 512, 256, stream);   // cuSPARSELt, 16 padded rows (fp32: plain)
      } else {
        skipped(std::string("NaN/Inf through cuSPARSELt, ") + dname(t));
      }
      check_nonfinite(t, 37, 200, 48, stream);   // cuBLAS on the decompressed weight
      check_nonfinite(t, 8, 200, 48, stream);    // plain kernel
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamDestroy(stream));
  }

  std::vector<Row> rows;
  if (!args.skip_bench && ctx == nullptr) skipped("benchmark (needs cuSPARSELt)");
  if (!args.skip_bench && ctx != nullptr) {
    out("\n== benchmark: cuSPARSELt 2:4 vs cuBLAS dense (median ms of %d timed batches); each row\n"
        "   as it is measured, the whole table again at the end\n", args.reps);
    FILE* csv = nullptr;
    if (!args.out_dir.empty()) csv = fopen((args.out_dir + "/gpu_check.csv").c_str(), "w");
    if (csv) fprintf(csv, "dtype,M,K,N,cublas_ms,cusparselt_ms,cusparselt_search_ms,config,rel_err,copies,op_ms\n");
    print_header();
    auto measure = [&](DType t, int64_t M, int64_t K, int64_t N) {
      rows.push_back(bench(ctx, t, M, K, N, args.warmup, args.reps, args.check_rows, prop.l2CacheSize));
      print_row(rows.back(), csv);
    };
    for (DType t : args.dtypes) {
      for (int64_t s : args.sizes) measure(t, s, s, s);
      for (auto [K, N] : args.ffn) {
        for (int64_t b : args.batches) measure(t, b, K, N);
      }
    }
    if (csv) fclose(csv);
    out("\n== benchmark table\n");
    print_header();
    for (const Row& r : rows) print_row(r, nullptr);
    out("Lt = cuSPARSELt default config; Lt* = after cusparseLtMatmulSearch. Ratios > 1: 2:4 faster.\n"
        "op = the TF op's device work per call on a cached weight: fingerprint of values+meta, Lt,\n"
        "the repair kernel that finds the weight unchanged (TRUST_WEIGHT_ADDRESS=1 skips these two)\n"
        "and the NaN/Inf kernel that scans x and finds it finite;\n"
        "not in it: copies padding x / unpadding y, the 8-byte fingerprint copy and its event.\n"
        "TF/s counts the dense-equivalent 2*M*K*N flops. Lt runs M rounded up to a multiple of\n"
        "%ld (the op copies x into such a padded buffer; that copy is not in these times).\n"
        "copies: operand sets used in turn so that each call reads from memory, not L2. Calls are\n"
        "launched back to back from the host: times of a few microseconds may be launch-bound.\n",
        (long)gpu::kLtRowMultiple);
  }
  out("\ngpu_check: %s (%d failed check%s, %d skipped)\n",
      g_failures ? "FAILED" : g_skipped ? "INCOMPLETE" : "all checks passed", g_failures,
      g_failures == 1 ? "" : "s", g_skipped);
  if (g_log) fclose(g_log);
  return g_failures ? 1 : g_skipped ? 3 : 0;
}
