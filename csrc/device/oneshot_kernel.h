// The GPU engine of a communicator, seen from CUDA-free host code: it owns the kernel's device state and
// launches one kernel per all-reduce. Without CUDA, make_oneshot_kernel throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "../allreduce_args.h"

namespace rocenante {

class OneshotKernel {
 public:
  virtual ~OneshotKernel() = default;
  // Enqueues the whole all-reduce as one kernel on `stream` (a cudaStream_t as an integer), ordered after the
  // previous call whatever its stream (the caller serialises calls to launch()). True if `stream` is capturing
  // a graph (the call then runs at each replay).
  virtual bool launch(const AllReduceArgs& args, uintptr_t stream) = 0;
  // True once everything enqueued on `stream` so far has completed; false while it captures a graph.
  virtual bool stream_done(uintptr_t stream) const = 0;
  // The first fault a kernel recorded (word 0 if none). Any thread may call it.
  virtual FaultRecord fault() const = 0;
  // Network transports: pins host memory [host, host + bytes) and maps it for the kernel (the receive region, the
  // image, the mailbox), its device address in `device_address`. The mapping lasts as long as the returned
  // handle (which may outlive this object); release it before the memory is freed, and after our kernels ended.
  virtual std::shared_ptr<void> map_host(void* host, size_t bytes, void*& device_address) = 0;
#ifdef ROCENANTE_TIMELINE
  // %globaltimer minus CLOCK_REALTIME, in nanoseconds, from the fastest of many GPU-host round trips.
  virtual int64_t clock_offset_ns() = 0;
#endif
};

std::unique_ptr<OneshotKernel> make_oneshot_kernel(int device, int world);

}  // namespace rocenante
