// Timeline builds only (CMakeLists.txt, csrc/timeline.h): how the GPU's %globaltimer relates to the host's
// CLOCK_REALTIME.
#include <cstdint>

#include "../cuda_check.h"
#include "../errors.h"
#include "../timeline.h"
#include "clock_offset.h"
#include "memory_order.cuh"

namespace rocenante {
namespace {

// The calibration: the host writes a sequence number, the GPU answers with its
// %globaltimer and the same number, in mapped host memory.
struct ClockPing {
  uint32_t host_seq;
  uint32_t gpu_seq;
  uint64_t gpu_time;
};
constexpr uint32_t kClockPings = 200;
constexpr uint32_t kClockStop = 0xFFFFFFFFu;

__global__ void clock_ping_kernel(ClockPing* ping) {
  volatile ClockPing* p = ping;
  for (uint32_t i = 1; i <= kClockPings; ++i) {
    uint32_t seen;
    while ((seen = p->host_seq) != i && seen != kClockStop) {}
    if (seen == kClockStop) return;
    p->gpu_time = global_timer_ns();
    __threadfence_system();
    p->gpu_seq = i;
  }
}

}  // namespace

int64_t measure_clock_offset_ns(int device) {
  DeviceGuard guard(device);
  ClockPing* ping = nullptr;
  ROCENANTE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&ping), sizeof(ClockPing), cudaHostAllocMapped));
  *ping = ClockPing{};
  ClockPing* mapped = nullptr;
  cudaStream_t stream = nullptr;
  int64_t best_round_trip = INT64_MAX, offset = 0;
  const int64_t deadline = realtime_ns() + 10'000'000'000;  // a kernel that never starts must not hang us
  try {
    ROCENANTE_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), ping, 0));
    ROCENANTE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    clock_ping_kernel<<<1, 1, 0, stream>>>(mapped);
    ROCENANTE_CHECK_CUDA(cudaGetLastError());
    for (uint32_t i = 1; i <= kClockPings; ++i) {
      const int64_t sent = realtime_ns();
      __atomic_store_n(&ping->host_seq, i, __ATOMIC_RELEASE);
      while (__atomic_load_n(&ping->gpu_seq, __ATOMIC_ACQUIRE) != i)
        if (realtime_ns() > deadline) ROCENANTE_THROW(Error, "clock calibration: the GPU did not answer within 10 s");
      const int64_t back = realtime_ns();
      if (back - sent < best_round_trip) {  // the fastest round trip bounds the offset best
        best_round_trip = back - sent;
        offset = int64_t(__atomic_load_n(&ping->gpu_time, __ATOMIC_RELAXED)) - (sent + back) / 2;
      }
    }
  } catch (...) {
    __atomic_store_n(&ping->host_seq, kClockStop, __ATOMIC_RELEASE);
    if (stream != nullptr) cudaStreamSynchronize(stream), cudaStreamDestroy(stream);
    cudaFreeHost(ping);
    throw;
  }
  ROCENANTE_CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  cudaFreeHost(ping);
  return offset;
}

}  // namespace rocenante
