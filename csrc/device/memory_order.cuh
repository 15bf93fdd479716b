// Every memory access of the kernel that another grid, GPU or the host observes, with the ordering it needs.
// Areas and call words: see layout.h for why volatile accesses of whole words (Lamport) or whole 8-byte halves
// (lines) need no fence: every word a peer stores validates itself, whatever order the words land in. Epoch and
// footprints: read by a CTA at its start and written at its end, seen by the next launch on this GPU. Fault record
// and abort words: seen by the host and by peer GPUs (system scope); the release orders what a thread wrote
// before them (e.g. the record's epoch) first. Mailbox (network peers, layout.h): the ring is stored with
// release at system scope, since the proxy thread on the host is the other side; the arrival words (a peer's
// flag in our region, or the mailbox's), like every word a host thread or NIC writes, are loaded with .cv and
// fenced once they match (load_polled).
#pragma once

#include <cstdint>

#include "../layout.h"

namespace rocenante {

// Stores to a peer's region (remote memory through CUDA IPC). volatile: not combined, not cached.
__device__ __forceinline__ void store_remote(uint32_t* p, const uint32_t (&w)[4]) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}
__device__ __forceinline__ void store_remote(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_line(Line* p, uint32_t d0, uint32_t d1, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag), "r"(d1), "r"(flag)
               : "memory");
}

// Loads from our own region; volatile so that every poll reads memory again instead of a cached copy. Words that
// a host thread or a NIC writes into mapped host memory (`host`: a network peer's call word, area and flag, the
// mailbox's arrival words, abort words in a host region) are loaded with the .cv cache operator instead, which
// takes a cached copy of a system-memory line as stale and fetches the line again (PTX ISA, "Cache Operators").
// Volatile and acquire loads did not always: on one H200, two ranks sharing it over the TCP wire, 1,000 iterations
// of calls on two streams timed out on both ranks in 2 of 13 runs after the line split (kLineBytes), part of one
// launch's threads reading, until the timeout, the arrival word (and, in a diagnosis build, the call word and
// area) as it was three calls earlier, while the launch's other threads had read the call whole
// (benchmarks/logs/h200-two-streams-arrival-lost.log); with .cv, 0 of 21 runs
// (benchmarks/logs/h200-two-streams-cv.log, h200-gpu-suite-398a6a3.log). A host thread's writes and a GPU's
// polls alone showed no stale read (benchmarks/host_line_probe.cu).
__device__ __forceinline__ void load_polled(const uint32_t* p, uint32_t (&w)[4], bool host) {
  if (host) {
    asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p)
                 : "memory");
  } else {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p)
                 : "memory");
  }
}
__device__ __forceinline__ uint32_t load_polled(const uint32_t* p, bool host) {
  uint32_t v;
  if (host) {
    asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}
// A 64-bit word in host memory that another agent writes (an abort word), loaded as above. The acquire that such a
// load stands in for: once a value is one the caller acts on, fence_acquire_sys() before the caller's later loads.
__device__ __forceinline__ uint64_t load_host_word(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.global.cv.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acquire_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// The reset of our own region (layout.h), 16 bytes of an area or one call word, ordered before any peer's next
// write to these words by the end of this kernel, which comes before we send the data that lets a peer make that
// write. In device memory (peers store through CUDA IPC) plain stores do. In host memory (`host`: the region of
// network peers, which a wire's receiver thread or the NIC writes, not a GPU) they are relaxed at system scope,
// and the kernel fences them before it ends: a plain store to mapped host memory is not promised to be there,
// for another agent, by the end of the kernel.
__device__ __forceinline__ void store_empty(uint32_t* p, bool host) {
  if (host) {
    asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(p), "r"(kEmpty) : "memory");
  } else {
    asm volatile("st.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(p), "r"(kEmpty) : "memory");
  }
}
__device__ __forceinline__ void store_empty_word(uint32_t* p, bool host) {
  if (host) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(kEmpty) : "memory");
  } else {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(kEmpty) : "memory");
  }
}

// The epoch and footprints are relaxed (yet strong, GPU scope: no data race in PTX's model) on purpose. Within a
// launch an epoch copy is read and written only by one CTA, its read and its write separated by __syncthreads,
// and a launch writes only the span of its own buffer while it reads the previous buffer's; between launches
// the kernel boundary (with PDL, griddepcontrol.wait: the previous grid has completed and its writes are
// visible) orders them. Acquire/release would order nothing more, and cost 1.2 us per call at 1 KiB on
// 2 x H200 (median of 5 alternated runs, benchmarks/results/h200x2-ordering-ab-rejected.json), presumably
// because the release store waits for the thread's NVLink stores to complete.
__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Generic addressing: these words live in device memory (ours or a peer's) or in mapped host memory.
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Writes `word` and its check into abort slot `source` of `region` (layout.h, Abort words), each whole.
__device__ __forceinline__ void store_abort_sys(uint32_t* region, int source, uint64_t word) {
  store_release_sys(abort_word(region, source), word);
  store_release_sys(abort_check(region, source), ~word);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace rocenante
