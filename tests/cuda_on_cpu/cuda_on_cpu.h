// Runs CUDA C++ kernels on the CPU, for tests on machines without a GPU: force-included (g++
// -include) ahead of a .cu file whose launches `kernel<<<grid, block[, shmem, stream]>>>(args)`
// were rewritten to `cuda_on_cpu::launch(grid, block[, shmem, stream], &kernel)(args)`
// (tests/test_gpu_on_cpu.py does both).
//
// Each CUDA thread of a block is a fiber (ucontext) with its own stack, and the blocks run one
// after another. Every barrier is made of yields to a scheduler (__syncthreads: 1,
// __syncthreads_or: 3, a warp shuffle: 2), and a round of the scheduler resumes every live thread
// once, so a thread passes its k-th yield only after every thread of the block has reached its
// k-th. That is a block-wide barrier wherever all threads meet the same barriers in the same order,
// which CUDA requires of __syncthreads and of full-warp shuffles, and which every kernel run here
// does (a kernel whose warps met different kinds of barriers would fall out of step unnoticed).
// Each round resumes the threads in another order (a fixed-seed shuffle), so a read that lacks its
// barrier sees a writer's old value whichever thread reads. Stronger than a GPU: a warp shuffle is
// also a barrier for the whole block here, so a missing __syncthreads between a shared-memory
// write and a read that has a shuffle between them is not caught. __shared__ variables are
// function statics, shared by the threads of the one running block. Device memory is host memory
// and a launch completes before launch() returns. Not modelled: timing, coalescing, occupancy.
#ifndef TF_SPARSE24_TESTS_CUDA_ON_CPU_H_
#define TF_SPARSE24_TESTS_CUDA_ON_CPU_H_

#include <cuda_fp16.h>     // __half and its host conversions
#include <cuda_runtime.h>  // before the macros below (its headers name threadIdx etc.)

#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

// The CUDA headers define the execution-space keywords as attributes g++ ignores (and warns
// about); here they are plain C++. __shared__: one instance per kernel, see above.
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline

namespace cuda_on_cpu {

struct Dim {
  unsigned x = 0, y = 1, z = 1;
};

// The running launch: the scheduler's context, the block's threads and what they share.
struct Launch {
  struct Thread {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    bool done = false;
  };
  static constexpr size_t kStackBytes = 256 << 10;
  ucontext_t scheduler;
  std::vector<Thread> threads;
  const void* body = nullptr;  // the kernel call, as run_body's argument
  void (*run_body)(const void*) = nullptr;
  Dim thread, block, block_dim, grid_dim;  // the coordinates of the thread now running
  std::vector<uint64_t> lanes;             // one shuffle slot per thread
  int any = 0;                             // __syncthreads_or
};
inline Launch* current = nullptr;
inline std::mutex one_launch_at_a_time;  // `current` and the __shared__ statics are global

// Back to the scheduler; returns when every thread of the block has reached this point.
inline void barrier() {
  Launch& l = *current;
  swapcontext(&l.threads[l.thread.x].context, &l.scheduler);
}

inline void thread_main() {
  Launch& l = *current;
  l.run_body(l.body);
  l.threads[l.thread.x].done = true;  // then uc_link resumes the scheduler
}

// Runs body() as every thread of a grid x block launch.
template <typename Body>
void run(int grid, int block, const Body& body) {
  if (grid <= 0 || block <= 0 || block % 32 != 0) {
    throw std::runtime_error("cuda_on_cpu: a launch needs grid > 0 and a block of whole warps");
  }
  std::lock_guard<std::mutex> lock(one_launch_at_a_time);
  Launch l;
  l.body = &body;
  l.run_body = [](const void* b) { (*static_cast<const Body*>(b))(); };
  l.block_dim = {static_cast<unsigned>(block)};
  l.grid_dim = {static_cast<unsigned>(grid)};
  l.threads.resize(block);
  l.lanes.resize(block);
  for (Launch::Thread& t : l.threads) t.stack.reset(new char[Launch::kStackBytes]);
  std::vector<int> order(block);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rounds(20261201);  // the same interleavings every run
  current = &l;
  for (int b = 0; b < grid; ++b) {
    l.block = {static_cast<unsigned>(b)};
    for (Launch::Thread& t : l.threads) {
      getcontext(&t.context);
      t.context.uc_stack = {t.stack.get(), 0, Launch::kStackBytes};
      t.context.uc_link = &l.scheduler;
      makecontext(&t.context, thread_main, 0);
      t.done = false;
    }
    for (int live = block; live > 0;) {
      std::shuffle(order.begin(), order.end(), rounds);
      for (int t : order) {
        if (l.threads[t].done) continue;
        l.thread = {static_cast<unsigned>(t)};
        swapcontext(&l.scheduler, &l.threads[t].context);
        live -= l.threads[t].done;
      }
    }
  }
  current = nullptr;
}

// launch(grid, block, shmem, stream, &kernel)(args...): the rewritten <<<...>>> launch.
template <typename... Params>
struct Launcher {
  int grid, block;
  void (*kernel)(Params...);
  template <typename... Args>
  void operator()(Args&&... args) const {
    run(grid, block, [&] { kernel(args...); });
  }
};

template <typename... Params>
Launcher<Params...> launch(int grid, int block, size_t shmem, cudaStream_t,
                           void (*kernel)(Params...)) {
  if (shmem != 0) throw std::runtime_error("cuda_on_cpu: dynamic shared memory is not modelled");
  return {grid, block, kernel};
}

template <typename... Params>  // <<<grid, block>>>
Launcher<Params...> launch(int grid, int block, void (*kernel)(Params...)) {
  return launch(grid, block, 0, nullptr, kernel);
}

}  // namespace cuda_on_cpu

#define threadIdx (::cuda_on_cpu::current->thread)
#define blockIdx (::cuda_on_cpu::current->block)
#define blockDim (::cuda_on_cpu::current->block_dim)
#define gridDim (::cuda_on_cpu::current->grid_dim)

using std::max;
using std::min;

inline void __syncthreads() { ::cuda_on_cpu::barrier(); }

inline int __syncthreads_or(int predicate) {
  ::cuda_on_cpu::Launch& l = *::cuda_on_cpu::current;
  if (predicate) l.any = 1;
  ::cuda_on_cpu::barrier();
  const int any = l.any;
  ::cuda_on_cpu::barrier();
  if (l.thread.x == 0) l.any = 0;
  ::cuda_on_cpu::barrier();  // reset before any thread's next call
  return any;
}

// Lane i gets lane i + delta's value (its own when that is past the warp). Every lane of the warp
// calls it, as mask = all lanes says.
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 8 bytes");
  if (mask != 0xffffffffu) throw std::runtime_error("cuda_on_cpu: only full-warp shuffles");
  ::cuda_on_cpu::Launch& l = *::cuda_on_cpu::current;
  const unsigned t = l.thread.x;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  l.lanes[t] = bits;
  ::cuda_on_cpu::barrier();
  T out = value;
  if (t % 32 + delta < 32) std::memcpy(&out, &l.lanes[t + delta], sizeof(T));
  ::cuda_on_cpu::barrier();  // no slot is overwritten before its readers are done
  return out;
}

inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  unsigned long long old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value < old &&
         !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
  }
  return old;
}

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

inline float __uint_as_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline unsigned __float_as_uint(float f) {
  unsigned bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

#endif  // TF_SPARSE24_TESTS_CUDA_ON_CPU_H_
