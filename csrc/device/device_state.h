// What the collective kernels (collective_kernels.cu) and its host-side launcher (launch.cc) share: the state the
// kernel keeps between launches, which the launcher allocates, and the kernels' addresses, by which the launcher
// launches them without compiling device code.
#pragma once

#include <cstdint>

#include "../call_args.h"
#include "../fault.h"
#include "../layout.h"

namespace rocenante {

// Most CTAs one launch may use; the launch shape also keeps every CTA resident at once (launch.cc, launch_bounds()).
constexpr int kMaxBlocks = 1024;

// Per-communicator state the kernel keeps on the device between launches, so that a captured CUDA graph
// replays correctly: nothing per call comes from the host except the launch parameters.
struct DeviceState {
  // The call counter, one copy per CTA index. CTA b reads epochs[b] when it starts and, when it ends, writes
  // epoch+1 to every copy j with j % gridDim == b. Every copy is thus advanced exactly once per call, by the
  // only CTA that reads it, so all copies stay equal without any synchronisation between CTAs.
  uint32_t* epochs;
  int copies;  // epoch copies in use: the most CTAs a launch of this communicator has
  // Device word, never cleared: kFaulted | kNotATimeout? (collective_kernels.cu) | bit mask of peers a thread
  // gave up on. Threads poll it at their timer reads; a launch that finds it set poisons its whole output.
  uint32_t* fault_mask;
  // footprints[b]: footprint_of() the last call that used buffer b, which the next call resets (layout.h).
  uint32_t* footprints;
  // Mapped host memory: the first fault (for timeouts, the union of missing peers), read by the host; written
  // only under record_lock (0: free), a device word.
  FaultRecord* record;
  uint32_t* record_lock;
  // Sharded calls: CTAs of the launch that have finished (collective_kernels.cu, poison_if_faulted()).
  uint32_t* finished;
  // Network peers, per call of the launch (calls_of(): sent[0], sent[1]): CTAs that have finished their stores of
  // that call into the images, and those of them that sent nothing (collective_kernels.cu, ring_doorbell()).
  uint32_t* sent;
  // Launches that make two calls: the last call of the latest one whose every CTA had reduced its part (the
  // gate before the second call's polls, sharded_kernel); kNoEpoch at first.
  uint32_t* reduced;
};

// The kernels: one-shot all-reduce, plain or with the add + RMSNorm epilogue (oneshot_allreduce_kernel), and the
// sharded collectives (sharded_kernel).
enum class Variant : int { kOneShot = 0, kFused, kTwoShot, kReduceScatter, kAllGather, kAllToAll, kAllToAllV };
constexpr int kNumVariants = 7;
inline Variant variant_of(const CallArgs& a) {
  switch (a.collective) {
    case Collective::kFusedAllReduce: return Variant::kFused;
    case Collective::kAllGather: return Variant::kAllGather;
    case Collective::kReduceScatter: return Variant::kReduceScatter;
    case Collective::kAllToAll: return Variant::kAllToAll;
    case Collective::kAllToAllV: return Variant::kAllToAllV;
    case Collective::kAllReduce: break;
  }
  return a.algorithm == Algorithm::kTwoShot ? Variant::kTwoShot : Variant::kOneShot;
}

// The kernel that serves calls of `variant`, `dtype` and `op` at `world`, as cudaLaunchKernelExC and the occupancy
// queries take it; nullptr where there is none (int32 avg; a fused call that is not a sum of a float dtype).
const void* kernel_entry(DType dtype, ReduceOp op, int world, Variant variant);
// Tests only: two CTAs of one thread recording two faults at once (collective_kernels.cu, record_race_kernel),
// launched with (DeviceState, uint64_t first, uint64_t second, uint32_t epoch).
const void* record_race_kernel_entry();

}  // namespace rocenante
