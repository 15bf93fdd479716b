// The timeline of a build configured with -DROCENANTE_TIMELINE=ON (off by default: the hooks compile to nothing):
// per call, when its steps happened, on the GPU's %globaltimer (the kernel's events) and on the host's
// CLOCK_REALTIME (the proxy's events, and the host loop's, which records the kernel's events for CPU tensors),
// both in nanoseconds. benchmarks/net_breakdown.py reads it (Communicator.timeline()) to split a
// call's time into staging, doorbell, wire and arrival; CollectiveKernel::clock_offset_ns() relates the two clocks.
// A slot is overwritten kTimelineSlots calls later; events of a call that did not happen stay 0.
#pragma once

#include <time.h>

#include <cstdint>

#include "layout.h"

namespace rocenante {

#ifdef ROCENANTE_TIMELINE
constexpr bool kTimeline = true;
#else
constexpr bool kTimeline = false;
#endif

enum TimelineEvent : int {
  kKernelStart,     // CTA 0 passed griddepcontrol.wait: the call's data may move (host loop: the call began)
  kKernelRing,      // network peers: the last CTA stored the doorbell (every store into the image visible)
  kKernelArrived,   // thread 0 of CTA 0 has every peer's first chunk (network peers: after their arrival word);
                    // host loop: every peer's call word
  kKernelEnd,       // thread 0 of CTA 0 wrote its last output chunk (host loop: the last one)
  kProxyRing,       // the proxy took the doorbell and posted the call's deliveries
  kProxyDelivered,  // ... and the wire reported them landed
  kProxyArrival,    // the proxy saw a peer's delivery of this call arrive (the last peer's): its flag, or with
                    // the completion signal the arrival word the proxy stored
  kProxyTook,       // the proxy saw the doorbell, before posting: kProxyRing - kProxyTook is the wire's post
                    // (last, so that the events before it keep the indices earlier builds gave them)
  kTimelineEvents
};
constexpr int kTimelineSlots = 4096;  // calls kept; call (epoch) e is in slot e % kTimelineSlots

// A slot's kernel events (the GPU's) and proxy events (the host's) lie on lines of their own (layout.h,
// kLineBytes).
struct Timeline {
  struct alignas(kLineBytes) Slot {
    uint64_t kernel[kLineBytes / sizeof(uint64_t)];
    uint64_t proxy[kLineBytes / sizeof(uint64_t)];
  };
  Slot slots[kTimelineSlots];
};
static_assert(kProxyRing <= int(kLineBytes / sizeof(uint64_t)) &&
                  kTimelineEvents - kProxyRing <= int(kLineBytes / sizeof(uint64_t)),
              "each half of a slot holds its events");
// Where `event` of call `epoch` is recorded (T: Timeline, or const Timeline to read).
template <typename T>
ROCENANTE_HD auto timeline_entry(T* t, uint32_t epoch, int event) {
  auto& s = t->slots[epoch % kTimelineSlots];
  return event < kProxyRing ? &s.kernel[event] : &s.proxy[event - kProxyRing];
}

// The host's clock of the timeline: CLOCK_REALTIME in nanoseconds.
inline int64_t realtime_ns() {
  timespec t{};
  clock_gettime(CLOCK_REALTIME, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Timeline builds, on the host: records `event` of call `epoch` now, where `timeline` is not null.
inline void note(Timeline* timeline, uint32_t epoch, TimelineEvent event) {
  if constexpr (kTimeline)
    if (timeline != nullptr) *timeline_entry(timeline, epoch, event) = uint64_t(realtime_ns());
}

}  // namespace rocenante
