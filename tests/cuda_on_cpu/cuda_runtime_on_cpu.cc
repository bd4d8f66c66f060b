// The CUDA runtime calls the GPU sources make, for running them on the CPU (see cuda_on_cpu.h):
// device and pinned memory are host memory, streams run each call as it is made, events complete
// at once. Like the real runtime, a failing call is recorded as the thread's last error, which
// cudaGetLastError (which every launcher calls) returns and clears; sim_events_not_ready makes
// event queries answer cudaErrorNotReady, which the runtime also records that way.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {

thread_local cudaError_t last_error = cudaSuccess;
std::atomic<int> events_not_ready{0};
std::atomic<long long> live_pinned{0}, live_events{0};

cudaError_t record(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

}  // namespace

extern "C" {

// The next `count` cudaEventQuery calls answer cudaErrorNotReady (the copy has not happened yet).
void sim_events_not_ready(int count) { events_not_ready = count; }
long long sim_live_pinned() { return live_pinned; }
long long sim_live_events() { return live_events; }

cudaError_t cudaGetLastError() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorNotReady ? "cudaErrorNotReady (emulated)" : "CUDA error (emulated)";
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind,
                            cudaStream_t) {
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
  *ptr = std::malloc(size);
  if (*ptr == nullptr) return record(cudaErrorMemoryAllocation);
  ++live_pinned;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  std::free(ptr);
  --live_pinned;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new char);
  ++live_events;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<char*>(event);
  --live_events;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }

cudaError_t cudaEventQuery(cudaEvent_t) {
  for (int left = events_not_ready; left > 0;) {
    if (events_not_ready.compare_exchange_weak(left, left - 1)) return record(cudaErrorNotReady);
  }
  return cudaSuccess;
}

}  // extern "C"
