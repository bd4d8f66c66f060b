// A CPU stand-in for libcusparseLt.so.0, for running the GPU path's host code on a machine without
// a GPU (tests/test_gpu_on_cpu.py). Written from the cuSPARSELt documentation, not from our use of
// it: descriptors hold what the API says they describe, SpMMACompress2 stores the structured
// operand's kept values in a layout of its own (so a caller that read the compressed buffer as
// anything else would fail), and Matmul computes D = alpha op(A) op(B) + beta C for the described
// orders, leading dimensions and operations, accumulating in float32.
//
// Strictness, to surface misuse as errors: uninitialised or destroyed descriptors, operands whose
// shapes do not chain, a structured operand that is not 2:4 along k, a plan whose A (order,
// leading dimension, operation) is not the one the operand was compressed with, pointers not
// 16-byte aligned, a missing workspace, dimensions that are not multiples of 16
// (CUSPARSE_STATUS_NOT_SUPPORTED). FAKE_CUSPARSELT_REFUSE_M = m makes plans with that many rows of
// op(A) unsupported; FAKE_CUSPARSELT_VERSION sets the version code (default 800). Built with
// -DFAKE_CUSPARSELT_0_7 it is the API of 0.6 / 0.7: no cusparseLtMatmulAlgSelectionDestroy (0.8.0
// introduced it, and says it must then be called) and version code 700.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "tests/cuda_on_cpu/cuda_elements.h"

namespace {

constexpr int kSuccess = 0, kInvalidValue = 3, kNotSupported = 10;
using cuda_on_cpu::kR32F;
constexpr int kOpN = 0, kOpT = 1, kOrderCol = 1, kOrderRow = 2;
constexpr uint32_t kMagic = 0x5e1f24a1, kDead = 0xdeadbeef;

struct Mat {  // cusparseLtMatDescriptor_t
  uint32_t magic;
  int64_t rows, cols, ld;
  int type, order;
  bool structured;
};
struct Matmul {  // cusparseLtMatmulDescriptor_t: copies of the descriptors
  uint32_t magic;
  int op_a, op_b;
  Mat a, b, c, d;
  int64_t m, n, k;  // op(A) m x k, op(B) k x n, C and D m x n
};
struct Alg {
  uint32_t magic;
  Matmul matmul;
  int config;
};
struct Plan {
  uint32_t magic;
  Matmul matmul;
  int config;
};
// The real opaque structs are 512 bytes (cuSPARSELt 0.6-0.10): ours must fit in them.
static_assert(sizeof(Mat) <= 512 && sizeof(Matmul) <= 512 && sizeof(Alg) <= 512 &&
              sizeof(Plan) <= 512, "a fake descriptor larger than the real one");

template <typename T>
T* as(void* p) {
  return static_cast<T*>(p);
}

bool live(const void* p) { return p != nullptr && *static_cast<const uint32_t*>(p) == kMagic; }

// Element (r, c) of a described matrix, as float.
int64_t index(const Mat& m, int64_t r, int64_t c) {
  return m.order == kOrderRow ? r * m.ld + c : c * m.ld + r;
}

float load(const Mat& m, const void* data, int64_t r, int64_t c) {
  return cuda_on_cpu::load_element(m.type, data, index(m, r, c));
}

void store(const Mat& m, void* data, int64_t r, int64_t c, float v) {
  cuda_on_cpu::store_element(m.type, data, index(m, r, c), v);
}

// op(X) (r, c): the described matrix or its transpose.
float load_op(const Mat& m, int op, const void* data, int64_t r, int64_t c) {
  return op == kOpN ? load(m, data, r, c) : load(m, data, c, r);
}

int64_t op_rows(const Mat& m, int op) { return op == kOpN ? m.rows : m.cols; }
int64_t op_cols(const Mat& m, int op) { return op == kOpN ? m.cols : m.rows; }

// The compressed structured operand: a header saying how it was compressed (Matmul refuses a plan
// whose A is described or operated on otherwise), then per row i of op(A): for each group g of 4
// along k its two kept values as float32, then one byte per group of their positions (lo | hi << 2).
struct Header {
  uint32_t magic;
  Mat a;
  int op;
};
constexpr int64_t kHeaderBytes = 128;
static_assert(sizeof(Header) <= kHeaderBytes, "header too large");
constexpr int64_t kGroupBytes = 2 * sizeof(float) + 1;

bool same(const Mat& x, const Mat& y) {
  return x.rows == y.rows && x.cols == y.cols && x.ld == y.ld && x.type == y.type &&
         x.order == y.order && x.structured == y.structured;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int dense_init(const Mat& init, void* desc) {
  if (desc == nullptr || init.rows <= 0 || init.cols <= 0) return kInvalidValue;
  if (init.order != kOrderRow && init.order != kOrderCol) return kInvalidValue;
  if (init.ld < (init.order == kOrderRow ? init.cols : init.rows)) return kInvalidValue;
  if (!cuda_on_cpu::known_type(init.type)) return kInvalidValue;
  *as<Mat>(desc) = init;
  return kSuccess;
}

int matmul_run(const Plan* plan, const float* alpha, const void* a, const void* b,
               const float* beta, const void* c, void* d, void* workspace) {
  if (!live(plan) || alpha == nullptr || beta == nullptr || !a || !b || !d || !workspace) {
    return kInvalidValue;
  }
  const Matmul& mm = plan->matmul;
  Header header;
  std::memcpy(&header, a, sizeof(header));
  if (header.magic != kMagic || !same(header.a, mm.a) || header.op != mm.op_a) {
    return kInvalidValue;  // compressed for another description of A
  }
  if (!aligned16(a) || !aligned16(b) || !aligned16(d) || (c != nullptr && !aligned16(c))) {
    return kInvalidValue;  // the descriptors promised 16-byte alignment
  }
  const auto* packed = static_cast<const unsigned char*>(a) + kHeaderBytes;
  const int64_t groups = mm.k / 4, row_bytes = groups * kGroupBytes;
  std::vector<float> column(mm.k);
  std::vector<float> out(mm.m * mm.n);
  for (int64_t j = 0; j < mm.n; ++j) {
    for (int64_t l = 0; l < mm.k; ++l) column[l] = load_op(mm.b, mm.op_b, b, l, j);
    for (int64_t i = 0; i < mm.m; ++i) {
      const unsigned char* row = packed + i * row_bytes;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float v[2];
        std::memcpy(v, row + g * 2 * sizeof(float), sizeof(v));
        const unsigned char pos = row[groups * 2 * sizeof(float) + g];
        acc += v[0] * column[4 * g + (pos & 3)];
        acc += v[1] * column[4 * g + (pos >> 2)];
      }
      out[i * mm.n + j] = *alpha * acc + (*beta != 0.f ? *beta * load(mm.c, c, i, j) : 0.f);
    }
  }
  for (int64_t i = 0; i < mm.m; ++i) {
    for (int64_t j = 0; j < mm.n; ++j) store(mm.d, d, i, j, out[i * mm.n + j]);
  }
  return kSuccess;
}

}  // namespace

extern "C" {

int cusparseLtInit(void* handle) {
  if (handle == nullptr) return kInvalidValue;
  *as<uint32_t>(handle) = kMagic;
  return kSuccess;
}

int cusparseLtDestroy(const void* handle) { return live(handle) ? kSuccess : kInvalidValue; }

int cusparseLtGetVersion(const void* handle, int* version) {
  if (!live(handle)) return kInvalidValue;
  const char* v = std::getenv("FAKE_CUSPARSELT_VERSION");
#ifdef FAKE_CUSPARSELT_0_7
  *version = v ? std::atoi(v) : 700;
#else
  *version = v ? std::atoi(v) : 800;
#endif
  return kSuccess;
}

int cusparseLtDenseDescriptorInit(const void* handle, void* desc, int64_t rows, int64_t cols,
                                  int64_t ld, uint32_t alignment, int type, int order) {
  if (!live(handle) || alignment % 16 != 0) return kInvalidValue;
  return dense_init({kMagic, rows, cols, ld, type, order, false}, desc);
}

int cusparseLtStructuredDescriptorInit(const void* handle, void* desc, int64_t rows,
                                       int64_t cols, int64_t ld, uint32_t alignment, int type,
                                       int order, int sparsity) {
  if (!live(handle) || alignment % 16 != 0 || sparsity != 0) return kInvalidValue;
  return dense_init({kMagic, rows, cols, ld, type, order, true}, desc);
}

int cusparseLtMatDescriptorDestroy(const void* desc) {
  if (!live(desc)) return kInvalidValue;
  *as<uint32_t>(const_cast<void*>(desc)) = kDead;
  return kSuccess;
}

int cusparseLtMatmulDescriptorInit(const void* handle, void* matmul, int op_a, int op_b,
                                   const void* a, const void* b, const void* c, const void* d,
                                   int compute) {
  if (!live(handle) || !live(a) || !live(b) || !live(c) || !live(d)) return kInvalidValue;
  Matmul mm{kMagic, op_a, op_b, *static_cast<const Mat*>(a), *static_cast<const Mat*>(b),
            *static_cast<const Mat*>(c), *static_cast<const Mat*>(d), 0, 0, 0};
  if (!mm.a.structured || mm.b.structured) return kNotSupported;  // only A structured here
  if ((op_a != kOpN && op_a != kOpT) || (op_b != kOpN && op_b != kOpT)) return kInvalidValue;
  mm.m = op_rows(mm.a, op_a);
  mm.k = op_cols(mm.a, op_a);
  mm.n = op_cols(mm.b, op_b);
  if (op_rows(mm.b, op_b) != mm.k || mm.c.rows != mm.m || mm.c.cols != mm.n ||
      mm.d.rows != mm.m || mm.d.cols != mm.n) {
    return kInvalidValue;  // shapes do not chain
  }
  if (mm.a.type != mm.b.type || mm.c.type != mm.d.type) return kInvalidValue;
  // CUSPARSE_COMPUTE_32F (2) with 16-bit inputs; float32 inputs are not the 2:4 mode.
  if (compute != 2 || mm.a.type == kR32F) return kNotSupported;
  if (mm.m % 16 || mm.n % 16 || mm.k % 16) return kNotSupported;
  const char* refuse = std::getenv("FAKE_CUSPARSELT_REFUSE_M");
  if (refuse && std::atoll(refuse) == mm.m) return kNotSupported;
  *as<Matmul>(matmul) = mm;
  return kSuccess;
}

int cusparseLtMatmulAlgSelectionInit(const void* handle, void* alg, const void* matmul, int id) {
  if (!live(handle) || !live(matmul) || id != 0) return kInvalidValue;
  *as<Alg>(alg) = {kMagic, *static_cast<const Matmul*>(matmul), 0};
  return kSuccess;
}

#ifndef FAKE_CUSPARSELT_0_7
int cusparseLtMatmulAlgSelectionDestroy(const void* alg) {
  if (!live(alg)) return kInvalidValue;
  *as<uint32_t>(const_cast<void*>(alg)) = kDead;
  return kSuccess;
}
#endif

int cusparseLtMatmulAlgGetAttribute(const void* handle, const void* alg, int attribute,
                                    void* data, size_t size) {
  if (!live(handle) || !live(alg) || size != sizeof(int) || attribute != 0) return kInvalidValue;
  *static_cast<int*>(data) = static_cast<const Alg*>(alg)->config;
  return kSuccess;
}

int cusparseLtMatmulPlanInit(const void* handle, void* plan, const void* matmul, const void* alg) {
  if (!live(handle) || !live(matmul) || !live(alg)) return kInvalidValue;
  *as<Plan>(plan) = {kMagic, *static_cast<const Matmul*>(matmul), 0};
  return kSuccess;
}

int cusparseLtMatmulPlanDestroy(const void* plan) {
  if (!live(plan)) return kInvalidValue;
  *as<uint32_t>(const_cast<void*>(plan)) = kDead;
  return kSuccess;
}

int cusparseLtMatmulGetWorkspace(const void* handle, const void* plan, size_t* size) {
  if (!live(handle) || !live(plan)) return kInvalidValue;
  *size = 4096;
  return kSuccess;
}

int cusparseLtSpMMACompressedSize2(const void* handle, const void* sparse, size_t* compressed,
                                   size_t* buffer) {
  if (!live(handle) || !live(sparse) || !static_cast<const Mat*>(sparse)->structured) {
    return kInvalidValue;
  }
  const Mat& a = *static_cast<const Mat*>(sparse);
  *compressed = kHeaderBytes + a.rows * a.cols / 4 * kGroupBytes;  // m x k either way round
  *buffer = 256;
  return kSuccess;
}

// The structured operand op(A) [m, k] -> its kept values and positions (see kGroupBytes). Fails
// with INVALID_VALUE if a group of 4 along k holds more than two non-zeros.
int cusparseLtSpMMACompress2(const void* handle, const void* sparse, int is_sparse_a, int op,
                             const void* dense, void* compressed, void* buffer, void*) {
  if (!live(handle) || !live(sparse) || is_sparse_a != 1 || !dense || !compressed || !buffer) {
    return kInvalidValue;
  }
  const Mat& a = *static_cast<const Mat*>(sparse);
  const int64_t m = op_rows(a, op), k = op_cols(a, op), groups = k / 4;
  if (k % 4) return kInvalidValue;
  const Header header{kMagic, a, op};
  std::memcpy(compressed, &header, sizeof(header));
  auto* out = static_cast<unsigned char*>(compressed) + kHeaderBytes;
  const int64_t row_bytes = groups * kGroupBytes;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      float v[2] = {0.f, 0.f};
      int pos[2] = {0, 1}, kept = 0;
      for (int r = 0; r < 4; ++r) {
        const float x = load_op(a, op, dense, i, 4 * g + r);
        if (x == 0.f && !std::isnan(x)) continue;
        if (kept == 2) return kInvalidValue;  // not 2:4
        v[kept] = x;
        pos[kept++] = r;
      }
      if (kept == 1) pos[1] = pos[0] == 3 ? 2 : 3;  // a zero partner at an unused position
      if (kept == 1 && pos[1] < pos[0]) {
        std::swap(pos[0], pos[1]);
        std::swap(v[0], v[1]);
      }
      std::memcpy(out + i * row_bytes + g * 2 * sizeof(float), v, sizeof(v));
      out[i * row_bytes + groups * 2 * sizeof(float) + g] =
          static_cast<unsigned char>(pos[0] | pos[1] << 2);
    }
  }
  return kSuccess;
}

int cusparseLtMatmul(const void* handle, const void* plan, const void* alpha, const void* a,
                     const void* b, const void* beta, const void* c, void* d, void* workspace,
                     void** streams, int32_t num_streams) {
  if (!live(handle) || num_streams < 0 || (num_streams > 0 && streams == nullptr)) {
    return kInvalidValue;
  }
  return matmul_run(static_cast<const Plan*>(plan), static_cast<const float*>(alpha), a, b,
                    static_cast<const float*>(beta), c, d, workspace);
}

int cusparseLtMatmulSearch(const void* handle, void* plan, const void* alpha, const void* a,
                           const void* b, const void* beta, const void* c, void* d,
                           void* workspace, void** streams, int32_t num_streams) {
  return cusparseLtMatmul(handle, plan, alpha, a, b, beta, c, d, workspace, streams, num_streams);
}

}  // extern "C"
