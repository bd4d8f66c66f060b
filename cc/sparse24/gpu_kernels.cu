// CUDA kernels on the sparse24/v1 format: compress, meta check, decompress, a plain SpMM and a
// content fingerprint (see gpu_kernels.h). Compress and decompress move raw bits (no arithmetic),
// so one kernel serves float16 and bfloat16 and the result matches format.py bit for bit.
#include "cc/sparse24/gpu_kernels.h"

#include <cuda_fp16.h>

#include <algorithm>

namespace sparse24 {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

int blocks_for(int64_t total) {
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxBlocks, (total + kThreads - 1) / kThreads)));
}

// Raw storage of an element and its "is non-zero" test (NaN and inf are non-zeros, -0.0 is zero).
template <typename Bits> __device__ __forceinline__ bool nonzero(Bits b);
template <> __device__ __forceinline__ bool nonzero<uint32_t>(uint32_t b) { return (b & 0x7fffffffu) != 0; }
template <> __device__ __forceinline__ bool nonzero<uint16_t>(uint16_t b) { return (b & 0x7fffu) != 0; }

// One thread per (meta byte b, column n), n fastest so the reads of W rows are coalesced.
template <typename Bits>
__global__ void compress_kernel(const Bits* __restrict__ w, int64_t K, int64_t N,
                                Bits* __restrict__ values, uint8_t* __restrict__ meta,
                                unsigned long long* first_bad) {
  const int64_t groups = K / 4, bytes = (K + 7) / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes * N;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i % N, b = i / N;
    uint8_t byte = 0;
    for (int half = 0; half < 2; ++half) {
      const int64_t g = 2 * b + half;
      if (g >= groups) break;
      Bits e[4];
      bool nz[4];
      int count = 0;
      for (int r = 0; r < 4; ++r) {
        e[r] = w[(4 * g + r) * N + n];
        nz[r] = nonzero(e[r]);
        count += nz[r];
      }
      if (count > 2) atomicMin(first_bad, static_cast<unsigned long long>(g * N + n));
      // Non-zeros first, then the lowest unused positions; then ascending.
      int p[2], kept = 0;
      for (int r = 0; r < 4 && kept < 2; ++r) if (nz[r]) p[kept++] = r;
      for (int r = 0; r < 4 && kept < 2; ++r) if (!nz[r]) p[kept++] = r;
      if (p[0] > p[1]) { const int t = p[0]; p[0] = p[1]; p[1] = t; }
      Bits* out = values + n * (K / 2) + 2 * g;
      out[0] = nz[p[0]] ? e[p[0]] : Bits(0);
      out[1] = nz[p[1]] ? e[p[1]] : Bits(0);
      byte |= static_cast<uint8_t>((p[0] | (p[1] << 2)) << (4 * half));
    }
    meta[n * bytes + b] = byte;
  }
}

__global__ void check_meta_kernel(const uint8_t* __restrict__ meta, int64_t K, int64_t N,
                                  unsigned long long* slots) {
  const int64_t groups = K / 4, bytes = (K + 7) / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes * N;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / bytes, b = i % bytes;
    const uint8_t byte = meta[i];
    for (int half = 0; half < 2; ++half) {
      const int64_t g = 2 * b + half;
      const int nib = (byte >> (4 * half)) & 0xF;
      if (g >= groups) {
        if (nib != 0) atomicMin(&slots[1], static_cast<unsigned long long>(n));
      } else if ((nib & 3) >= (nib >> 2)) {
        atomicMin(&slots[0], static_cast<unsigned long long>(n * groups + g));
      }
    }
  }
}

// One thread per (column n, meta byte b). Writes the 8 rows 8b..8b+7 (those < K) of column n.
template <typename Bits, bool kTransposed>
__global__ void decompress_kernel(const Bits* __restrict__ values, const uint8_t* __restrict__ meta,
                                  int64_t K, int64_t N, Bits* __restrict__ out) {
  const int64_t groups = K / 4, bytes = (K + 7) / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes * N;
       i += int64_t(gridDim.x) * blockDim.x) {
    // [N, K] output: b fastest (each thread writes a contiguous run); [K, N]: n fastest.
    const int64_t n = kTransposed ? i / bytes : i % N;
    const int64_t b = kTransposed ? i % bytes : i / N;
    const uint8_t byte = meta[n * bytes + b];
    for (int half = 0; half < 2; ++half) {
      const int64_t g = 2 * b + half;
      if (g >= groups) break;
      const int nib = (byte >> (4 * half)) & 0xF;
      const Bits v0 = values[n * (K / 2) + 2 * g], v1 = values[n * (K / 2) + 2 * g + 1];
      for (int r = 0; r < 4; ++r) {
        const Bits v = r == (nib & 3) ? v0 : (r == (nib >> 2) ? v1 : Bits(0));
        const int64_t k = 4 * g + r;
        out[kTransposed ? n * K + k : k * N + n] = v;
      }
    }
  }
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {  // round to nearest even
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct F32 { using T = float; static __device__ float load(const T* p, int64_t i) { return p[i]; }
             static __device__ void store(T* p, int64_t i, float v) { p[i] = v; } };
struct F16 { using T = __half; static __device__ float load(const T* p, int64_t i) { return __half2float(p[i]); }
             static __device__ void store(T* p, int64_t i, float v) { p[i] = __float2half_rn(v); } };
struct BF16 { using T = uint16_t; static __device__ float load(const T* p, int64_t i) { return bf16_bits_to_float(p[i]); }
              static __device__ void store(T* p, int64_t i, float v) { p[i] = float_to_bf16_bits(v); } };

// One warp per (column n, tile of kRowsPerWarp rows of x), n fastest: the lanes split n's groups,
// so a warp reads row n of values/meta as consecutive words (coalesced) once per tile, and x's rows
// within 128-element spans; then one warp reduction per row. float32 accumulation.
constexpr int kRowsPerWarp = 4;

template <typename E>
__global__ void spmm_simple_kernel(const typename E::T* __restrict__ x,
                                   const typename E::T* __restrict__ values,
                                   const uint8_t* __restrict__ meta, int64_t M, int64_t K, int64_t N,
                                   typename E::T* __restrict__ y,
                                   const unsigned long long* fingerprint,
                                   unsigned long long expected) {
  if (fingerprint != nullptr && *fingerprint == expected) return;
  const int lane = threadIdx.x & 31;
  const int64_t groups = K / 4, bytes = (K + 7) / 8;
  const int64_t tiles = N * ((M + kRowsPerWarp - 1) / kRowsPerWarp);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  // Warp-uniform loop: every lane of a warp takes the same tiles, so the shuffles below see all 32.
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; t < tiles; t += warps) {
    const int64_t n = t % N, m0 = (t / N) * kRowsPerWarp;
    const int rows = static_cast<int>(min(int64_t(kRowsPerWarp), M - m0));
    const typename E::T* vr = values + n * (K / 2);
    const uint8_t* mr = meta + n * bytes;
    float acc[kRowsPerWarp] = {};
    for (int64_t g = lane; g < groups; g += 32) {
      const int nib = (mr[g / 2] >> (4 * (g % 2))) & 0xF;
      const float v0 = E::load(vr, 2 * g), v1 = E::load(vr, 2 * g + 1);
      const int64_t k0 = 4 * g + (nib & 3), k1 = 4 * g + (nib >> 2);
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (r < rows) {
          const typename E::T* xr = x + (m0 + r) * K;
          acc[r] += E::load(xr, k0) * v0;
          acc[r] += E::load(xr, k1) * v1;
        }
      }
    }
    for (int r = 0; r < kRowsPerWarp; ++r) {
      float sum = acc[r];
      for (int off = 16; off > 0; off /= 2) sum += __shfl_down_sync(0xffffffffu, sum, off);
      if (lane == 0 && r < rows) E::store(y, (m0 + r) * N + n, sum);
    }
  }
}

// Whether an element is NaN/Inf: its exponent bits kExp all ones.
template <typename Bits, Bits kExp>
__device__ __forceinline__ bool nonfinite(Bits b) {
  return (b & kExp) == kExp;
}

// Whether one of the elements packed in an 8-byte word of x is NaN/Inf.
template <typename Bits, Bits kExp>
__device__ __forceinline__ bool any_nonfinite(uint64_t word) {
  bool any = false;
  for (int i = 0; i < 8 / static_cast<int>(sizeof(Bits)); ++i) {
    any |= nonfinite<Bits, kExp>(static_cast<Bits>(word >> (8 * sizeof(Bits) * i)));
  }
  return any;
}

// One block per row of x (grid-stride): the block scans the row (8-byte loads when `aligned`);
// if it holds NaN/Inf, each thread takes columns n and sets y[m, n] = kNan when such an x[m, k]
// meets a zero of W (see propagate_nonfinite).
template <typename Bits, Bits kExp, Bits kNan>
__global__ void nonfinite_kernel(const Bits* __restrict__ x, const Bits* __restrict__ values,
                                 const uint8_t* __restrict__ meta, int64_t M, int64_t K, int64_t N,
                                 bool aligned, Bits* __restrict__ y) {
  const int64_t groups = K / 4, bytes = (K + 7) / 8;
  constexpr int kPerWord = 8 / sizeof(Bits);
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const Bits* xr = x + m * K;
    const int64_t words = aligned ? K / kPerWord : 0;  // K % 4 == 0: rows are whole words
    bool found = false;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
      found |= any_nonfinite<Bits, kExp>(reinterpret_cast<const uint64_t*>(xr)[i]);
    }
    for (int64_t k = words * kPerWord + threadIdx.x; k < K; k += blockDim.x) {
      found |= nonfinite<Bits, kExp>(xr[k]);
    }
    if (!__syncthreads_or(found)) continue;  // the block's common answer: no thread diverges
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
      const Bits* vr = values + n * (K / 2);
      const uint8_t* mr = meta + n * bytes;
      bool meets_zero = false;
      for (int64_t g = 0; g < groups && !meets_zero; ++g) {
        const int nib = (mr[g / 2] >> (4 * (g % 2))) & 0xF;
        for (int r = 0; r < 4; ++r) {
          if (!nonfinite<Bits, kExp>(xr[4 * g + r])) continue;
          const Bits w = r == (nib & 3) ? vr[2 * g] : (r == (nib >> 2) ? vr[2 * g + 1] : Bits(0));
          meets_zero |= !nonzero(w);
        }
      }
      if (meets_zero) y[m * N + n] = kNan;
    }
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {  // splitmix64 finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Sum over 8-byte words of mix(word ^ key): order-independent, so any grid and the atomics give
// the same sum. Keys are (4 * position + salt) times an odd constant (salt 1..3), so two buffers
// with different salts never share a key and structured data cannot cancel a key's bits. Loads
// are 16 bytes and each word costs three 64-bit multiplies, so the pass runs at memory speed (it
// runs on every call of the op on a cached weight). Each block adds its total with one atomic:
// per-warp atomics on one address would cost more than the pass itself on a large weight.
constexpr int kFingerprintMaxBlocks = 1024;  // about one wave of 256-thread blocks on an H100/H200

__device__ __forceinline__ uint64_t fingerprint_term(uint64_t word, uint64_t position,
                                                     uint64_t salt) {
  return mix64(word ^ ((4 * position + salt) * 0x9e3779b97f4a7c15ull));
}

__global__ void fingerprint_kernel(const uint8_t* __restrict__ data, int64_t bytes, bool aligned,
                                   uint64_t salt, unsigned long long* out) {
  const int64_t chunks = aligned ? bytes / 16 : 0;  // 16-byte loads when data is 16-aligned
  uint64_t sum = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += stride) {
    const ulonglong2 v = reinterpret_cast<const ulonglong2*>(data)[i];
    sum += fingerprint_term(v.x, 2 * i, salt) + fingerprint_term(v.y, 2 * i + 1, salt);
  }
  // Bytes after the last whole chunk (all of them when unaligned), one key per byte position
  // (positions above any word's, so never a word's key).
  for (int64_t j = chunks * 16 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < bytes;
       j += stride) {
    sum += fingerprint_term(data[j], bytes / 8 + 1 + j, salt);
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_down_sync(0xffffffffu, sum, off);
  __shared__ uint64_t warp_sums[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t block_sum = 0;
    for (int w = 0; w < kThreads / 32; ++w) block_sum += warp_sums[w];
    atomicAdd(out, static_cast<unsigned long long>(block_sum));
  }
}

// Adds the fingerprint of `bytes` bytes at `data` to *out (launch only).
void fingerprint_add(const void* data, int64_t bytes, uint64_t salt, unsigned long long* out,
                     cudaStream_t stream) {
  if (bytes == 0) return;
  const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  const int grid = std::min(kFingerprintMaxBlocks, blocks_for(aligned ? bytes / 16 + 1 : bytes));
  fingerprint_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(data), bytes,
                                                   aligned, salt, out);
}

template <typename Bits>
cudaError_t decompress_typed(const void* values, const uint8_t* meta, int64_t K, int64_t N,
                             bool transposed, void* out, cudaStream_t stream) {
  const int grid = blocks_for(N * ((K + 7) / 8));
  if (transposed) {
    decompress_kernel<Bits, true><<<grid, kThreads, 0, stream>>>(
        static_cast<const Bits*>(values), meta, K, N, static_cast<Bits*>(out));
  } else {
    decompress_kernel<Bits, false><<<grid, kThreads, 0, stream>>>(
        static_cast<const Bits*>(values), meta, K, N, static_cast<Bits*>(out));
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t reset_error_slots(unsigned long long* slots, int count, cudaStream_t stream) {
  return cudaMemsetAsync(slots, 0xff, sizeof(unsigned long long) * count, stream);
}

cudaError_t compress(DType dtype, const void* w, int64_t K, int64_t N, void* values, uint8_t* meta,
                     unsigned long long* first_bad, cudaStream_t stream) {
  if (K == 0 || N == 0) return cudaSuccess;
  const int grid = blocks_for(N * ((K + 7) / 8));
  if (dtype == DType::kFloat32) {
    compress_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(w), K, N, static_cast<uint32_t*>(values), meta, first_bad);
  } else {
    compress_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint16_t*>(w), K, N, static_cast<uint16_t*>(values), meta, first_bad);
  }
  return cudaGetLastError();
}

cudaError_t check_meta(const uint8_t* meta, int64_t K, int64_t N, unsigned long long* slots,
                       cudaStream_t stream) {
  if (K == 0 || N == 0) return cudaSuccess;
  check_meta_kernel<<<blocks_for(N * ((K + 7) / 8)), kThreads, 0, stream>>>(meta, K, N, slots);
  return cudaGetLastError();
}

cudaError_t decompress(DType dtype, const void* values, const uint8_t* meta, int64_t K, int64_t N,
                       bool transposed, void* out, cudaStream_t stream) {
  if (K == 0 || N == 0) return cudaSuccess;
  return dtype == DType::kFloat32
             ? decompress_typed<uint32_t>(values, meta, K, N, transposed, out, stream)
             : decompress_typed<uint16_t>(values, meta, K, N, transposed, out, stream);
}

cudaError_t spmm_simple(DType dtype, const void* x, const void* values, const uint8_t* meta,
                        int64_t M, int64_t K, int64_t N, void* y, cudaStream_t stream) {
  return spmm_simple_unless(dtype, x, values, meta, M, K, N, y, nullptr, 0, stream);
}

cudaError_t spmm_simple_unless(DType dtype, const void* x, const void* values, const uint8_t* meta,
                               int64_t M, int64_t K, int64_t N, void* y,
                               const unsigned long long* fingerprint, unsigned long long expected,
                               cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  const int grid = blocks_for(N * ((M + kRowsPerWarp - 1) / kRowsPerWarp) * 32);  // a warp a tile
  switch (dtype) {
    case DType::kFloat32:
      spmm_simple_kernel<F32><<<grid, kThreads, 0, stream>>>(
          static_cast<const float*>(x), static_cast<const float*>(values), meta, M, K, N,
          static_cast<float*>(y), fingerprint, expected);
      break;
    case DType::kFloat16:
      spmm_simple_kernel<F16><<<grid, kThreads, 0, stream>>>(
          static_cast<const __half*>(x), static_cast<const __half*>(values), meta, M, K, N,
          static_cast<__half*>(y), fingerprint, expected);
      break;
    case DType::kBFloat16:
      spmm_simple_kernel<BF16><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), meta, M, K, N,
          static_cast<uint16_t*>(y), fingerprint, expected);
      break;
  }
  return cudaGetLastError();
}

cudaError_t propagate_nonfinite(DType dtype, const void* x, const void* values,
                                const uint8_t* meta, int64_t M, int64_t K, int64_t N, void* y,
                                cudaStream_t stream) {
  if (M == 0 || N == 0 || K == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>(M, kMaxBlocks));
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 8 == 0;
  switch (dtype) {
    case DType::kFloat32:
      nonfinite_kernel<uint32_t, 0x7f800000u, 0x7fc00000u><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint32_t*>(x), static_cast<const uint32_t*>(values), meta, M, K, N,
          aligned, static_cast<uint32_t*>(y));
      break;
    case DType::kFloat16:
      nonfinite_kernel<uint16_t, 0x7c00u, 0x7e00u><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), meta, M, K, N,
          aligned, static_cast<uint16_t*>(y));
      break;
    case DType::kBFloat16:
      nonfinite_kernel<uint16_t, 0x7f80u, 0x7fc0u><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), meta, M, K, N,
          aligned, static_cast<uint16_t*>(y));
      break;
  }
  return cudaGetLastError();
}

cudaError_t fingerprint_weight(const void* values, int64_t values_bytes, const uint8_t* meta,
                               int64_t meta_bytes, unsigned long long* out, cudaStream_t stream) {
  if (const cudaError_t e = cudaMemsetAsync(out, 0, sizeof(*out), stream); e != cudaSuccess) {
    return e;
  }
  fingerprint_add(values, values_bytes, /*salt=*/1, out, stream);  // own salts: keys never shared
  fingerprint_add(meta, meta_bytes, /*salt=*/2, out, stream);
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace sparse24
