// The CUDA runtime calls the GPU sources and the gpu_check harness make, for running them on the
// CPU (see cuda_on_cpu.h): one device (sm_90, no memory pools), device and pinned memory are host
// memory, streams run each call as it is made, events complete at once and time the host. Like the
// real runtime, a failing call is recorded as the thread's last error, which cudaGetLastError
// (which every launcher calls) returns and clears; sim_events_not_ready makes event queries answer
// cudaErrorNotReady, which the runtime also records that way.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace {

thread_local cudaError_t last_error = cudaSuccess;
std::atomic<int> events_not_ready{0};
std::atomic<long long> live_pinned{0}, live_events{0};

struct Event {
  double ms = 0;  // host time when last recorded
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t) {
  return cudaMemset(ptr, value, count);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(dst, src, count, kind);
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
  *event = reinterpret_cast<cudaEvent_t>(new Event);
  ++live_events;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<Event*>(event);
  --live_events;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  reinterpret_cast<Event*>(event)->ms = now_ms();
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = static_cast<float>(reinterpret_cast<Event*>(end)->ms - reinterpret_cast<Event*>(start)->ms);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t) {
  for (int left = events_not_ready; left > 0;) {
    if (events_not_ready.compare_exchange_weak(left, left - 1)) return record(cudaErrorNotReady);
  }
  return cudaSuccess;
}

// The rest only the gpu_check harness calls.

cudaError_t cudaMalloc(void** ptr, size_t size) {
  *ptr = std::malloc(size ? size : 1);
  return *ptr ? cudaSuccess : record(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t) { return cudaMalloc(ptr, size); }
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) { return cudaFree(ptr); }

cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = reinterpret_cast<cudaStream_t>(new char);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete reinterpret_cast<char*>(stream);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, "CPU emulation (tests/cuda_on_cpu)", sizeof(prop->name) - 1);
  prop->major = 9;
  prop->multiProcessorCount = 1;
  prop->l2CacheSize = 64 << 10;  // few operand copies in the harness's timing
  prop->totalGlobalMem = size_t{1} << 30;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}

// No memory pools: the harness then allocates with cudaMalloc and skips its check that needs a
// kernel holding the stream (events answering "not ready" are tested with sim_events_not_ready).
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = 0;
  return cudaSuccess;
}

}  // extern "C"
