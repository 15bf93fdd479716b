// The GPU engine of a communicator, seen from CUDA-free host code: it owns the kernel's device state and
// launches one kernel per call (a piece of any collective). Without CUDA, make_collective_kernel throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "../call_args.h"
#include "../fault.h"

namespace rocenante {

// Most threads per CTA (the kernel's launch bound); small plain calls use fewer, a multiple of a warp.
constexpr int kThreads = 256;

// The fused add + RMSNorm (CallArgs::norm): a CTA reduces whole rows, and keeps a row in registers until
// its sum of squares is known; each of its threads holds at most kMaxRowChunks of the row's 16-byte chunks.
// 8 keeps the row at 32 registers a thread (beside the peers' words of the chunk it waits for: up to 32 at
// world 8) and takes rows of up to 32 KiB: hidden 16384 in bf16/fp16, 8192 in fp32. Longer rows are not fused.
constexpr int kMaxRowChunks = 8;

// How a row maps onto a CTA: thread t holds the row's chunks t + m * threads (m < per_thread, within the row).
struct RowSplit {
  uint32_t row_chunks;  // 16-byte chunks of a row
  uint32_t per_thread;  // chunks a thread holds, at most: ceil(row_chunks / kThreads)
  uint32_t threads;     // threads that hold any: ceil(row_chunks / per_thread), at most kThreads
};
ROCENANTE_HD RowSplit row_split(uint32_t row_chunks) {
  const uint32_t per_thread = (row_chunks + kThreads - 1) / kThreads;
  return {row_chunks, per_thread, (row_chunks + per_thread - 1) / per_thread};
}

// Whether the kernel fuses the add + RMSNorm into a call of `count` elements of `dtype` in rows of `hidden`:
// a float dtype (the op is sum), rows of whole 16-byte chunks within kMaxRowChunks per thread, and one piece
// (`piece_bytes`: the communicator's). It depends only on what every rank's call shares, never on pointers.
inline bool fuses_add_rmsnorm(size_t count, size_t hidden, DType dtype, size_t piece_bytes) {
  const size_t row_bytes = hidden * dtype_size(dtype);
  return format_of(dtype) == Format::kLamport && hidden > 0 && count > 0 && count % hidden == 0 &&
         row_bytes % kChunkBytes == 0 && row_bytes <= kThreads * kMaxRowChunks * kChunkBytes &&
         count * dtype_size(dtype) <= piece_bytes;
}

class CollectiveKernel {
 public:
  virtual ~CollectiveKernel() = default;
  // Enqueues the whole call as one kernel on `stream` (a cudaStream_t as an integer), ordered after the
  // previous call whatever its stream (the caller serialises calls to launch()); with the add + RMSNorm fused
  // when args.norm.hidden != 0 (only for calls fuses_add_rmsnorm() accepts). True if `stream` is capturing a
  // graph (the call then runs at each replay).
  virtual bool launch(const CallArgs& args, uintptr_t stream) = 0;
  // True once everything enqueued on `stream` so far has completed; false while it captures a graph.
  virtual bool stream_done(uintptr_t stream) const = 0;
  // The first fault a kernel recorded (word 0 if none). Any thread may call it.
  virtual FaultRecord fault() const = 0;
  // Returns once this communicator's launches so far have completed: with `next_epoch` the call number that
  // follows the last one launched (every launch was eager), by watching the device's call counter, so that other
  // work on the device (the user's, other communicators') is not waited for; with kNoEpoch (calls were captured,
  // and a graph may replay them on any stream), or if the counter has not got there within `bound_s`, by waiting
  // for the whole device. Returns the device's call counter then (the number the next call would take), or
  // kNoEpoch if CUDA failed. Never throws. The object may be destroyed only after it returned.
  virtual uint32_t wait_idle(uint32_t next_epoch, double bound_s) noexcept = 0;
  // Network transports: pins host memory [host, host + bytes) and maps it for the kernel (the receive region, the
  // image, the mailbox), its device address in `device_address`. The mapping lasts as long as the returned
  // handle (which may outlive this object); release it before the memory is freed, and after our kernels ended.
  virtual std::shared_ptr<void> map_host(void* host, size_t bytes, void*& device_address) = 0;
#ifdef ROCENANTE_TIMELINE
  // %globaltimer minus CLOCK_REALTIME, in nanoseconds, from the fastest of many GPU-host round trips.
  virtual int64_t clock_offset_ns() = 0;
#endif
};

// Its first launch is call `first_epoch`.
std::unique_ptr<CollectiveKernel> make_collective_kernel(int device, int world, uint32_t first_epoch);

// Tests only: two threads of one launch record `first` at `epoch` and `second` at epoch + 1 at once, each holding
// the record half written for milliseconds (record_race_kernel), while this thread reads it as fault() does.
// Returns each record read that differs from the one before (word 0: none), then the one left at the end.
std::vector<FaultRecord> test_fault_record_race(int device, uint64_t first, uint64_t second, uint32_t epoch);

}  // namespace rocenante
