// The collective kernels: one launch does a whole call, in the formats of layout.h. First the one-shot all-reduce
// (oneshot_allreduce_kernel), below it the sharded collectives (sharded_kernel).
//
//   push:  each thread reads its 16-byte chunks of the input and stores each (Lamport: sanitized; int32: as two
//          lines) into this rank's area of the call's buffer in every peer's region (over NVLink via CUDA IPC
//          mappings); one thread also stores the call word;
//   reset: while the data travels, the threads write kEmpty over the previous call's buffer of our own region;
//   pull:  each thread polls its own region for the same chunks from every peer until every word has arrived
//          and the peer's call word equals ours, combines all inputs in rank order (fp32 accumulation) and
//          writes the output chunk.
//
// The same kernel, instantiated with kFused, adds the residual and applies RMSNorm (CallArgs::norm) as an
// epilogue of the pull: its CTAs take whole rows instead of strided chunks, keep a row's sums in registers,
// and add up the row's squares across the CTA before they write the norm (row_norm.cuh). The push, the reset
// and the receive of each chunk are the same code for both.
//
// Network peers (RDMA, the TCP wire: CallArgs::network) are served by the same loop: the push goes into this
// rank's image of their regions in pinned host memory, the last CTA to finish its stores rings the proxy's
// doorbell (if the launch sent the whole call), and a thread reads a network peer's call word and chunks only
// after that peer's arrival word says its delivery of this call is whole (layout.h, Mailbox). The kernel serves direct and network peers side by
// side; the communicator does not build such mixed communicators yet.
//
// No CTA waits for another CTA and no thread waits for anything but its own chunks and the call words, so there
// is no barrier round (the doorbell's counter only counts CTAs that are done storing; none waits on it; a fused
// row's barrier joins only the threads of one CTA), but one: a launch that makes two calls (sharded_kernel) holds
// its second call's polls until every CTA has reduced, or the timeout passed (a delay only, never a fault).
// A thread that waits past the timeout, sees a call mismatch or reads an abort word records the fault and tells
// every peer (abort words); from then on every chunk it and any later launch would have computed is poisoned
// instead, decided here on the device, so graph replays after a fault produce NaN (int32: INT32_MIN), never a
// stale or partial sum. A fused row is computed whole or poisoned whole (residual_out and
// norm_out alike); a sharded call, its whole output (poison_if_faulted()).
#include "../chunk_reduce.h"
#include "../fault.h"
#include "chunk_io.cuh"
#include "device_state.h"
#include "collective_kernel.h"
#include "row_norm.cuh"
#include "memory_order.cuh"

namespace rocenante {
namespace {

// Bits of DeviceState::fault_mask besides the missing peers.
constexpr uint32_t kFaulted = 0x80000000u;       // some thread of this or an earlier launch faulted
constexpr uint32_t kNotATimeout = 0x40000000u;   // ... with a fault other than a timeout (it is kept as is)

constexpr int kPollsPerClockRead = 64;  // polls between reads of the global timer and the fault words

// Timeline builds: records `event` of call `epoch` on %globaltimer (timeline.h).
__device__ __forceinline__ void note(const CallArgs& a, uint32_t epoch, TimelineEvent event) {
  if constexpr (kTimeline)
    if (a.timeline != nullptr) *reinterpret_cast<volatile uint64_t*>(timeline_entry(a.timeline, epoch, event)) = global_timer_ns();
}

// Records `fault` (a timeout's peers are merged across threads) and, for the first fault of the
// communicator, writes our abort word into every peer's region. The record is written under the record lock, its
// sequence odd meanwhile (FaultRecord, fault.h): threads of one launch may record at once, for two calls of it.
// A rare path: a spinning thread lets the holder's warp go on (independent thread scheduling, sm_70 and up).
// `test_hold_ns`: tests only (record_race_kernel), how long the record stays half written.
__device__ void record_fault(const CallArgs& a, const DeviceState& s, uint64_t fault, uint32_t epoch,
                             uint64_t test_hold_ns = 0) {
  const bool timeout = fault_kind(fault) == Fault::kPeerTimeout;
  const uint32_t missing = timeout ? fault_detail(fault) : 0;
  while (atomicCAS(s.record_lock, 0u, 1u) != 0u) {
  }
  __threadfence();  // the previous holder's writes, before ours
  const uint32_t before = atomicOr(s.fault_mask, kFaulted | (timeout ? 0 : kNotATimeout) | missing);
  if (!(before & kNotATimeout)) {
    if (timeout) fault = encode_fault(Fault::kPeerTimeout, (before | missing) & 0xFFFFFFu, 0);
    const uint32_t sequence = load_acquire_sys(&s.record->sequence);  // only a lock holder writes it
    store_release_sys(&s.record->sequence, sequence + 1);
    __threadfence_system();  // odd, before the fields change
    store_release_sys(&s.record->epoch, epoch);
    if (test_hold_ns != 0)
      for (const uint64_t until = global_timer_ns() + test_hold_ns; global_timer_ns() < until;) {
      }
    store_release_sys(&s.record->word, fault);
    store_release_sys(&s.record->sequence, sequence + 2);
  }
  __threadfence_system();
  atomicExch(s.record_lock, 0u);
  if (before != 0) return;
  // Network peers are told by the host, which reads this record (Communicator::current_fault()).
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p)
    if (p < a.world && p != a.rank && !(a.network & (1u << p)))
      store_abort_sys(a.peer[p], a.rank, abort_from(fault, epoch, a.rank));
}

// DeviceState::sent counts each CTA once, plus kUnsent for a CTA of which some thread sent nothing.
constexpr uint32_t kUnsent = 1u << 16;  // above any CTA count (kMaxBlocks)
static_assert(kMaxBlocks < kUnsent, "the low half of DeviceState::sent counts CTAs");

// Network peers: the last CTA to finish its stores into the images rings this call's doorbell, once every
// CTA's stores are visible to the proxy, and only if every thread of the launch sent its chunks (`sent`: a
// thread that found the communicator faulted sent nothing; CTAs read the fault mask at different times): a
// call not written whole is never delivered (layout.h, Mailbox). Every thread of the launch takes part.
// `index`: which call of the launch this is (calls_of()), each counted apart (a CTA may be done with the second
// while another still stores for the first). Returns true in the one thread that counted the last CTA.
__device__ bool ring_doorbell(const CallArgs& a, const DeviceState& s, int index, uint32_t epoch, int buffer,
                              uint32_t delivery, bool sent) {
  __threadfence_system();  // this thread's image stores, before its CTA is counted
  const bool all_sent = __syncthreads_and(sent);
  if (threadIdx.x != 0) return false;
  uint32_t* const counter = s.sent + index;
  const uint32_t before = atomicAdd(counter, all_sent ? 1u : 1u + kUnsent);
  if (before % kUnsent != gridDim.x - 1) return false;
  *counter = 0;  // for the next launch, which starts after this one completed
  if (all_sent && before < kUnsent) {
    __threadfence_system();  // every CTA's stores (each fenced before its count), before the ring
    note(a, epoch, kKernelRing);
    store_release_sys(&a.mailbox->ring[buffer], ring_word(delivery, epoch));
  }
  return true;
}

// At a timer read: 0 to keep waiting, or the fault that ends the wait (an earlier fault of this launch is
// reported as already recorded: kFaulted).
__device__ uint64_t check_waiting(const CallArgs& a, const DeviceState& s, uint32_t epoch, uint64_t now,
                                  uint64_t deadline, uint32_t pending) {
  if (*reinterpret_cast<volatile uint32_t*>(s.fault_mask) != 0) return kFaulted;
  const bool host = a.network != 0;  // the region is host memory (memory_order.cuh)
  if (const uint64_t f = abort_seen(a, epoch, pending, [host](const uint64_t* w) {
        if (!host) return load_acquire_sys(w);
        const uint64_t v = load_host_word(w);
        if (v != 0) fence_acquire_sys();
        return v;
      }))
    return f;
  return now > deadline ? encode_fault(Fault::kPeerTimeout, pending, 0) : 0;
}

// Waits until chunk `c` of each peer in `pending` (its area of buffer b in our region) has arrived, its words in
// got[p], and that peer's call word equals ours (peers in `calls_seen` were seen equal already; this adds those
// seen now). A round issues all of its loads before it looks at any, so it costs one memory round trip whatever
// the world; indices into `got` are compile-time constants after unrolling, so the words stay in registers.
// Returns false once the call failed: a mismatch, an abort word, a timeout (recorded), or a fault another thread
// recorded. `deadline` is set at the first timer read, so a call whose peers are already there never reads it.
template <Format F, int W>
__device__ __forceinline__ bool receive(const CallArgs& a, const DeviceState& s, uint32_t epoch, int buffer,
                                        uint32_t call, size_t c, uint32_t pending, uint32_t& calls_seen,
                                        uint64_t& deadline, uint32_t (&got)[W][kWireWords<F>]) {
  // A fault found at a timer read ends the wait after one more poll: a peer whose call differs writes its call
  // word before it aborts, and this rank should name that call rather than relay the abort.
  uint64_t fault = 0;
  for (int polls = 1;; ++polls) {
    uint32_t theirs[W];  // the peer's call word as read this round (ours once seen; kEmpty: not read)
    bool landed[W];      // every word of its chunk has arrived
#pragma unroll
    for (int p = 0; p < W; ++p) {
      theirs[p] = calls_seen & (1u << p) ? call : kEmpty;
      landed[p] = false;
      if (!(pending & (1u << p))) continue;
      // A network peer's words are read only once its delivery of this call has arrived whole (layout.h).
      const bool network = a.network & (1u << p);
      if (network && !(calls_seen & (1u << p))) {
        if (!arrived_whole(a.arrivals + arrival_index(buffer, p), epoch,
                           [](const uint32_t* w) { return load_polled(w, true); }))
          continue;
        fence_acquire_sys();
      }
      if (!(calls_seen & (1u << p))) theirs[p] = load_polled(call_word(a.local, buffer, p), network);
      landed[p] = poll_chunk<F>(area(a.local, a.layout, buffer, a.rank, p), c, call, got[p], network);
    }
#pragma unroll
    for (int p = 0; p < W; ++p) {
      if (!(pending & (1u << p))) continue;
      if (theirs[p] == call) {
        calls_seen |= 1u << p;
      } else if (theirs[p] != kEmpty) {  // the peer made a different call: say which
        record_fault(a, s, encode_fault(Fault::kCallMismatch, p, flag_signature(theirs[p], epoch)), epoch);
        return false;
      }
      if (landed[p] && (calls_seen & (1u << p))) pending &= ~(1u << p);
    }
    if (pending == 0) return true;
    if (fault != 0) {
      if (fault != kFaulted) record_fault(a, s, fault, epoch);
      return false;
    }
    if (polls % kPollsPerClockRead == 0) {
      const uint64_t now = global_timer_ns();
      if (deadline == 0) deadline = now + a.timeout_ns;
      fault = check_waiting(a, s, epoch, now, deadline, pending);
    }
  }
}

// Resets the buffer of the call before this launch's first (`epoch`) in our own region while our data travels
// (layout.h says why it is free by now): what that call wrote into each area (its footprint,
// DeviceState::footprints), and the call words; then records the footprint of this launch's last call, which uses
// `buffer`. With network peers the region is host memory, and the reset must be there before this kernel ends
// (memory_order.cuh). Every thread of the launch takes part.
__device__ __forceinline__ void reset_previous(const CallArgs& a, const DeviceState& s, uint32_t epoch,
                                               int buffer, size_t first, size_t stride) {
  const int previous = previous_buffer(epoch);
  const uint32_t footprint = load_relaxed(&s.footprints[previous]);
  const bool host_region = a.network != 0;
  for (int q = 0; q < a.world - 1; ++q) {
    const int source = q < a.rank ? q : q + 1;
    uint32_t* base = a.local + a.layout.area_offset(previous, a.rank, source) / sizeof(uint32_t);
    size_t begin[2], end[2];
    const int ranges = footprint_ranges(footprint, a.rank, source, begin, end);
    for (int i = 0; i < ranges; ++i)
      for (size_t u = begin[i] / kChunkBytes + first; u < end[i] / kChunkBytes; u += stride)
        store_empty(base + u * (kChunkBytes / sizeof(uint32_t)), host_region);
  }
  if (first < kMaxRanks) store_empty_word(call_word(a.local, previous, int(first)), host_region);
  if (host_region) __threadfence_system();  // its cost hides behind the wait for the peers' data
  if (first == 0) store_relaxed(&s.footprints[buffer], footprint_of(a));
}

// The reduction of one chunk: our own (sanitized) and every peer's as received, in rank order with fp32
// accumulation, rounded to the dtype and sanitized as inputs are (layout.h: two-shot sends it on, and one-shot
// returns the same bits).
template <DType D, ReduceOp Op, int W>
__device__ __forceinline__ void reduce_chunk(const CallArgs& a, const uint32_t (&own)[4],
                                             const uint32_t (&got)[W][kWireWords<format_of(D)>], uint32_t (&w)[4]) {
  typename Chunk<D>::Acc acc[Chunk<D>::kElems];
#pragma unroll
  for (int p = 0; p < W; ++p) {
    if (p >= a.world) continue;
    uint32_t x[4];
    if (p == a.rank) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = own[i];
    } else {
      payload<format_of(D)>(got[p], x);
    }
    accumulate<D, Op>(acc, x, p == 0);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = 0;
  finish<D, Op>(acc, a.world, w);
  sanitize<D>(w);
}

// Our call word into every peer's region we store to (one thread of the launch).
template <int W>
__device__ __forceinline__ void send_call_word(const CallArgs& a, int buffer, uint32_t call) {
#pragma unroll
  for (int p = 0; p < W; ++p)
    if (p < a.world && (a.stores & (1u << p))) store_remote(call_word(a.peer[p], buffer, a.rank), call);
}

// Launched with programmatic stream serialization (launch.cc): a grid may be scheduled while the previous kernel
// of the stream is still running. griddepcontrol.wait returns once that kernel has completed and its writes (the
// caller's input, our epoch, footprints and reset) are visible; launch_dependents then lets the next kernel be
// scheduled, and that kernel in turn waits for our completion. No data moves before the wait. Returns this
// call's number.
__device__ __forceinline__ uint32_t begin_launch(const DeviceState& s) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  return load_relaxed(&s.epochs[blockIdx.x]);
}

// Advances the epoch: every thread of this CTA has read epochs[blockIdx.x] (begin_launch()) before this barrier.
// The CTA's threads share the copies it owns (j % gridDim == blockIdx), so no thread stores many.
__device__ __forceinline__ void end_launch(const CallArgs& a, const DeviceState& s, uint32_t epoch, size_t first) {
  if (first == 0) note(a, epoch, kKernelEnd);
  __syncthreads();
  for (int j = blockIdx.x + gridDim.x * threadIdx.x; j < s.copies; j += gridDim.x * blockDim.x)
    store_relaxed(&s.epochs[j], next_epoch(epoch));
}

// Which chunks a thread sends and then receives: the same ones, so that a thread reads its own input chunk
// before it writes any output at that chunk's place, and in-place calls (outputs equal to the input or the
// residual) need no CTA to wait for another. A walk goes through a thread's chunks kSendBatch at a time from a
// cursor: chunk(at, i) is the i-th chunk from `at`, or a value >= the call's chunk count where there is none.
// Plain calls: chunk first + k * stride, one per thread of the grid in turn; the cursor is the chunk itself.
struct Strided {
  static constexpr bool kGaps = false;  // once a chunk is past the end, so are all later ones
  size_t first, stride, chunks;
  __device__ size_t start() const { return first; }
  __device__ bool done(size_t at) const { return at >= chunks; }
  __device__ size_t chunk(size_t at, int i) const { return at + i * stride; }
  __device__ size_t next(size_t at) const { return at + kSendBatch * stride; }
};
// Fused calls: Rows (row_norm.cuh).

// Sends this thread's chunks (walk) to every peer we store to. kSendBatch chunks at a time: their input loads
// are all in flight before the first store (the stores' memory clobber keeps the compiler from moving later
// loads above them).
template <DType D, int W, class Walk>
__device__ __forceinline__ void send_chunks(const CallArgs& a, int buffer, uint32_t call, size_t chunks,
                                            const Walk& walk) {
  for (size_t at = walk.start(); !walk.done(at); at = walk.next(at)) {
    uint32_t w[kSendBatch][4];
#pragma unroll
    for (int i = 0; i < kSendBatch; ++i)
      if (walk.chunk(at, i) < chunks) load_chunk(a, walk.chunk(at, i), w[i]);
#pragma unroll
    for (int i = 0; i < kSendBatch; ++i) {
      const size_t c = walk.chunk(at, i);
      if (c >= chunks) {
        if constexpr (Walk::kGaps) continue;
        break;
      }
      sanitize<D>(w[i]);
#pragma unroll
      for (int p = 0; p < W; ++p)
        if (p < a.world && (a.stores & (1u << p)))
          send_chunk<format_of(D)>(area(a.peer[p], a.layout, buffer, p, a.rank), c, w[i], call);
    }
  }
}

// W: the world size rounded up to 2, 4 or 8, so that loops over peers unroll to what the world needs and a
// small world keeps fewer registers (more CTAs resident, more loads in flight). kFused: the add + RMSNorm
// epilogue (CallArgs::norm), its CTAs reducing whole rows.
// Launch bounds: kThreads; the fused kernels ask for 1 resident CTA per multiprocessor at least, so that ptxas
// keeps a row in registers without spilling (118-189 registers by ptxas -v; one CTA per multiprocessor serves
// the rows of decode), while for the plain kernels 0 leaves ptxas's register choice as it was.
template <DType D, ReduceOp Op, int W, bool kFused>
__global__ void __launch_bounds__(kThreads, kFused ? 1 : 0)
    oneshot_allreduce_kernel(const CallArgs a, const DeviceState s) {
  static_assert(!kFused || kFusable<D, Op>, "the fused epilogue serves sums of float dtypes");
  using C = Chunk<D>;
  const uint32_t epoch = begin_launch(s);
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  const size_t chunks = (a.bytes + kChunkBytes - 1) / kChunkBytes;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  Rows rows{};
  if constexpr (kFused)
    rows = {row_split(uint32_t(a.norm.hidden * dtype_size(D) / kChunkBytes)), a.count / a.norm.hidden};
  // A communicator that faulted before this launch sends nothing and poisons everything.
  bool failed = *reinterpret_cast<volatile uint32_t*>(s.fault_mask) != 0;
  if (first == 0) note(a, epoch, kKernelStart);

  // Every CTA sends all of its chunks before it waits for anything, so no wait of any CTA depends on a CTA
  // that has not sent yet, whatever chunks each CTA receives (below, the fused rows rely on it).
  if (!failed) {
    if (first == 0) send_call_word<W>(a, buffer, call);
    if constexpr (kFused) {
      send_chunks<D, W>(a, buffer, call, chunks, rows);
    } else {
      send_chunks<D, W>(a, buffer, call, chunks, Strided{first, stride, chunks});
    }
  }

  if (a.network != 0) ring_doorbell(a, s, 0, epoch, buffer, delivery_of(a), !failed);

  reset_previous(a, s, epoch, buffer, first, stride);

  // The pull, one loop for both variants (the receive of a chunk is written once, here). Plain: a step per
  // chunk of this thread (one slot, the chunk itself), its sum stored to the output. Fused: a step per row of
  // this CTA (rows b, b + gridDim.x, ...), its slots the thread's chunks of the row; each sum gets the residual
  // added (residual_out, stored at once) and its squares counted, and once the CTA has them all, write_norm().
  // A fused row waits for chunks that peers' CTAs of any index send: deadlock-free, as every CTA sends all of
  // its chunks first (above) and every CTA of a launch is resident at once (launch.cc, launch_bounds()).
  constexpr int kSlots = kFused ? kMaxRowChunks : 1;
  uint32_t calls_seen = 0;  // peers whose call word this thread has read equal to ours
  uint64_t deadline = 0;    // set at the first timer read, so a call whose peers are already there never reads it
  for (size_t step = kFused ? blockIdx.x : first; step < (kFused ? rows.rows : chunks);
       step += kFused ? gridDim.x : stride) {
    uint32_t v[kSlots][4];  // fused: this thread's chunks of the row, the residual, then residual_out
    float squares = 0;
    if constexpr (kFused) {
#pragma unroll
      for (uint32_t m = 0; m < kSlots; ++m)  // issued before the waits, so their latency hides behind them
        if (m < rows.split.per_thread && rows.holds(m))
          load_words(a.norm.residual_in, rows.chunk(step, m) * kChunkBytes, a.bytes, D, v[m]);
    }
    // Not unrolled: the wait below is emitted once; v[] stays in registers, indexed by constants (epilogue).
#pragma unroll 1
    for (uint32_t m = 0; m < (kFused ? rows.split.per_thread : 1); ++m) {
      if (kFused && !rows.holds(m)) continue;
      const size_t c = kFused ? rows.chunk(step, m) : step;
      if (failed) {
        if (!kFused) store_poison(a.out, c * kChunkBytes, a.bytes, a.dtype);
        continue;
      }
      uint32_t own[4];
      load_chunk(a, c, own);  // issued before the wait, so its latency hides behind it
      sanitize<D>(own);
      // Every peer's chunk (and, until it matched, its call word).
      uint32_t got[W][kWireWords<format_of(D)>];
      const uint32_t peers = peers_of(a);
      failed = !receive<format_of(D), W>(a, s, epoch, buffer, call, c, peers, calls_seen, deadline, got);
      if (failed) {
        if (!kFused) store_poison(a.out, c * kChunkBytes, a.bytes, a.dtype);
        continue;
      }
      if (c == 0) note(a, epoch, kKernelArrived);

      uint32_t w[4];
      reduce_chunk<D, Op, W>(a, own, got, w);
      if constexpr (!kFused) {
        store_chunk(a, c, w);
      } else {
        // residual_out = sum + residual, added in fp32 and rounded; its squares from the rounded values.
#pragma unroll
        for (uint32_t slot = 0; slot < kSlots; ++slot) {
          if (slot != m) continue;
#pragma unroll
          for (int i = 0; i < C::kElems; ++i) {
            C::store(v[slot], i, C::load(w, i) + C::load(v[slot], i));
            const float x = C::load(v[slot], i);
            squares += x * x;
          }
          store_words(a.norm.residual_out, c * kChunkBytes, a.bytes, D, v[slot]);
        }
      }
    }
    if constexpr (kFused) {
      // One thread's fault poisons the whole row on every thread of the CTA (residual_out it may have written
      // included), and the CTA's later rows: no thread waits for anything more.
      failed = __syncthreads_or(failed);
      if (!failed) {
        write_norm<D>(a, rows, step, v, squares);
        continue;
      }
#pragma unroll
      for (uint32_t m = 0; m < kSlots; ++m) {
        if (m >= rows.split.per_thread || !rows.holds(m)) continue;
        store_poison(a.norm.residual_out, rows.chunk(step, m) * kChunkBytes, a.bytes, D);
        store_poison(a.norm.norm_out, rows.chunk(step, m) * kChunkBytes, a.bytes, D);
      }
    }
  }

  end_launch(a, s, epoch, first);
}

// A faulted sharded call poisons its whole output (docs/guarantees.md), also the chunks that threads finished
// before the fault: the launch's last CTA to finish, after which no other CTA writes, poisons all of it when the
// fault mask is set (a thread sets it before its CTA counts). Every thread of the launch takes part.
__device__ __forceinline__ void poison_if_faulted(const CallArgs& a, const DeviceState& s) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this CTA's output, before it counts
    last = atomicAdd(s.finished, 1u) == gridDim.x - 1;
    if (last) {
      *s.finished = 0;  // for the next launch, which starts after this one completed
      __threadfence();  // every CTA's output (each fenced before its count), before our poison
    }
  }
  __syncthreads();
  if (!last || *reinterpret_cast<volatile uint32_t*>(s.fault_mask) == 0) return;
  if (a.collective == Collective::kAllToAllV) {  // every block's place, and no count received
    const size_t esize = dtype_size(a.dtype);
    for (int t = 0; t < a.world; ++t) {
      const size_t bytes = recv_limit(a, t) * esize;
      for (size_t j = threadIdx.x; j < block_chunks(bytes); j += blockDim.x)
        store_poison(static_cast<char*>(a.out) + recv_offset(a, t) * esize, j * kChunkBytes, bytes, a.dtype);
      if (threadIdx.x == 0 && a.blocks.recv_counts != nullptr) a.blocks.recv_counts[t] = -1;
    }
    return;
  }
  const Shards& sh = a.shards;
  const bool own_only = a.collective == Collective::kReduceScatter;  // its output is our reduced shard
  for (int t = 0; t < a.world; ++t) {
    if (own_only && t != a.rank) continue;
    char* const shard = static_cast<char*>(a.out) + (own_only ? 0 : size_t(t) * a.stride_bytes);
    for (size_t j = threadIdx.x; j < sh.chunks_of(t); j += blockDim.x)
      store_poison(shard, j * kChunkBytes, sh.bytes_of(t), a.dtype);
  }
}

// Two-shot all-reduce, reduce-scatter, all-gather and all-to-all (layout.h, Shards), one launch each:
//   push:   shard t of our input into our area of rank t's region, at slot t (a network peer's image: every shard
//           but ours, as the host loop does), and an all-to-all's own shard into its place in our output; an
//           all-gather: our shard, at our slot, into every peer's, and into our own output (no peer's data in it,
//           so it needs no peer's call word);
//   reset:  the footprint of the call before this launch, as one-shot;
//   reduce: our shard, chunk by chunk once every peer's has arrived, in rank order as one-shot (the same bits);
//           into our output, and for two-shot into every peer's region at our slot as well: with network peers
//           as the launch's second call, the next number (calls_of(); its doorbell rung once every CTA has sent
//           its part, as the first's);
//   gather: each peer's slot as it arrives (its reduced shard, or its input for an all-gather) into our output;
//           an all-to-all's: slot r of each peer's area (the block it sent us) into that peer's place.
// Deadlock-free as one-shot: every CTA pushes before it waits; the reduce waits only for pushes; the gather waits
// only for the peers' reduce, which waits for nothing else; every CTA of a launch is resident at once. A thread
// touches a chunk of the caller's tensors in one phase only (in place: it reads the input chunk before it writes
// the output there), except the gather's chunks, which the same thread pushed before: both walk the slots'
// chunks as first + k * stride. A thread that fails poisons each output chunk it had still to write, and the launch's
// last CTA then the whole output (poison_if_faulted()).
template <DType D, ReduceOp Op, int W, Collective Kind>
__global__ void __launch_bounds__(kThreads) sharded_kernel(const CallArgs a, const DeviceState s) {
  constexpr Format F = format_of(Kind, D);
  constexpr bool kGather = Kind == Collective::kAllGather;
  constexpr bool kTwoShot = Kind == Collective::kAllReduce;
  constexpr bool kAllToAll = Kind == Collective::kAllToAll;
  const uint32_t epoch = begin_launch(s);
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  // The launch's last call: with network peers two-shot's reduced shards go as a second call (calls_of()).
  const bool second = kTwoShot && calls_of(a) == 2;
  const uint32_t last = second ? next_epoch(epoch) : epoch;
  const int last_buffer = buffer_of(last);
  const uint32_t last_call = make_flag(a.signature, last);
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const Shards& sh = a.shards;
  const int r = a.rank;
  const size_t slot = sh.slot_chunks, slots = size_t(a.world) * slot;
  const char* const in = static_cast<const char*>(a.in);
  char* const out = static_cast<char*>(a.out);
  bool failed = *reinterpret_cast<volatile uint32_t*>(s.fault_mask) != 0;
  if (first == 0) note(a, epoch, kKernelStart);

  if (!failed) {
    if (first == 0) send_call_word<W>(a, buffer, call);
    if constexpr (kGather) {
      for (size_t j = first; j < sh.chunks_of(r); j += stride) {
        uint32_t w[4];
        load_words(in, j * kChunkBytes, sh.bytes_of(r), a.dtype, w);
#pragma unroll
        for (int p = 0; p < W; ++p)
          if (p < a.world && (a.stores & (1u << p)))
            send_chunk<F>(area(a.peer[p], a.layout, buffer, p, r), r * slot + j, w, call);
        store_words(out + r * a.stride_bytes, j * kChunkBytes, sh.bytes_of(r), a.dtype, w);
      }
    } else {
      for (size_t v = first; v < slots; v += stride) {
        const int t = int(v / slot);
        const size_t j = v % slot;
        if ((t == r && !kAllToAll) || j >= sh.chunks_of(t)) continue;
        uint32_t w[4];
        load_words(in + t * a.stride_bytes, j * kChunkBytes, sh.bytes_of(t), a.dtype, w);
        if (t == r) {  // all-to-all: our own block stays with us
          store_words(out + r * a.stride_bytes, j * kChunkBytes, sh.bytes_of(r), a.dtype, w);
          continue;
        }
        sanitize<D, F>(w);
#pragma unroll
        for (int p = 0; p < W; ++p)
          if (p < a.world && (a.stores & (1u << p)) && carries(a, p, t))
            send_chunk<F>(area(a.peer[p], a.layout, buffer, p, r), v, w, call);
      }
    }
  }
  // A two-shot piece's calls deliver each peer its own slot, then ours (piece_call(), delivery_of()).
  if (a.network != 0) ring_doorbell(a, s, 0, epoch, buffer, delivery_of(second ? piece_call(a, 0) : a), !failed);
  reset_previous(a, s, epoch, last_buffer, first, stride);

  uint32_t calls_seen = 0;  // peers whose call word this thread has read equal to ours
  uint64_t deadline = 0;
  if constexpr (!kGather && !kAllToAll) {
    const uint32_t peers = peers_of(a);
    char* const mine = kTwoShot ? out + r * a.stride_bytes : out;  // our reduced shard's place in the output
    if (second && first == 0 && !failed) send_call_word<W>(a, last_buffer, last_call);
    for (size_t j = first; j < sh.chunks_of(r); j += stride) {
      if (!failed) {
        uint32_t own[4];
        load_words(in + r * a.stride_bytes, j * kChunkBytes, sh.bytes_of(r), a.dtype, own);
        sanitize<D>(own);
        uint32_t got[W][kWireWords<F>];
        failed = !receive<F, W>(a, s, epoch, buffer, call, r * slot + j, peers, calls_seen, deadline, got);
        if (!failed) {
          uint32_t w[4];
          reduce_chunk<D, Op, W>(a, own, got, w);
          store_words(mine, j * kChunkBytes, sh.bytes_of(r), a.dtype, w);
          if constexpr (kTwoShot) {
#pragma unroll
            for (int p = 0; p < W; ++p)
              if (p < a.world && (a.stores & (1u << p)))
                send_chunk<F>(area(a.peer[p], a.layout, last_buffer, p, r), r * slot + j, w, last_call);
          }
          continue;
        }
      }
      store_poison(mine, j * kChunkBytes, sh.bytes_of(r), a.dtype);
    }
    if (second) {
      // The gate: no thread polls for the second call's data (pinned host memory, across PCIe on a discrete GPU)
      // while a CTA of ours still reduces: without it one launch a piece was no faster than two on one H200, with
      // it faster (benchmarks/README.md). The last CTA counted opens it; one that waits past the timeout goes on.
      if (ring_doorbell(a, s, 1, last, last_buffer, delivery_of(piece_call(a, 1)), !failed))
        store_relaxed(s.reduced, last);
      if (threadIdx.x == 0) {
        const uint64_t deadline = global_timer_ns() + a.timeout_ns;
        while (load_relaxed(s.reduced) != last && global_timer_ns() < deadline) {
        }
      }
      __syncthreads();
    }
  }
  if constexpr (kGather || kTwoShot || kAllToAll) {
    if (second) calls_seen = 0, deadline = 0;  // another call, its call words yet to be seen
    for (size_t v = first; v < slots; v += stride) {
      const int t = int(v / slot);
      const size_t j = v % slot;
      if (j >= sh.chunks_of(t) || t == r) {
        if (!kTwoShot && t == r && failed) store_poison(out + r * a.stride_bytes, j * kChunkBytes, sh.bytes_of(r), a.dtype);
        continue;
      }
      if (!failed) {
        // Peer t's shard for us: at its own slot, or at ours for an all-to-all (chunk j of either).
        const size_t c = kAllToAll ? r * slot + j : v;
        uint32_t got[W][kWireWords<F>];
        failed = !receive<F, W>(a, s, last, last_buffer, last_call, c, 1u << t, calls_seen, deadline, got);
        if (!failed) {
          uint32_t w[4];
#pragma unroll
          for (int p = 0; p < W; ++p)
            if (p == t) payload<F>(got[p], w);
          store_words(out + t * a.stride_bytes, j * kChunkBytes, sh.bytes_of(t), a.dtype, w);
          continue;
        }
      }
      store_poison(out + t * a.stride_bytes, j * kChunkBytes, sh.bytes_of(t), a.dtype);
    }
  }
  poison_if_faulted(a, s);
  end_launch(a, s, last, first);
}

// A split all-to-all (layout.h, kAllToAllV), one launch. Thread v of world * walk (block_walk(): the most chunks a
// slot of this call holds, header included) takes chunk j = v % walk of slot t = v / walk:
//   push:    block t's header (j = 0) or its chunk j - 1 into our area of rank t's region, at slot t (a network
//            peer's image: every block but ours), our own block into its place in our output; counts the
//            counts form cannot send fail the call before anything is sent (kBadSplits);
//   reset:   the footprint of the call before, as the other kernels;
//   receive: rank t's header at slot r of its area, checked against the size this rank expects of t (a size it
//            does not expect fails the call naming t, kSplitMismatch), then chunk j - 1 of its block into its
//            place in our output; the thread of j = 0 writes the counts form's received rows.
// Deadlock-free as the others: every thread sends before it waits, and waits only for the peers' sends. Input
// and output never overlap (Communicator checks), so no thread's read follows another's write.
template <int W>
__global__ void __launch_bounds__(kThreads) blocks_kernel(const CallArgs a, const DeviceState s) {
  constexpr Format F = Format::kLines;
  const uint32_t epoch = begin_launch(s);
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const int r = a.rank;
  const Blocks& b = a.blocks;
  const size_t esize = dtype_size(a.dtype), slot = size_t(1) << b.slot_log2, walk = block_walk(a);
  const size_t all = size_t(a.world) * walk;
  const char* const in = static_cast<const char*>(a.in);
  char* const out = static_cast<char*>(a.out);
  bool failed = *reinterpret_cast<volatile uint32_t*>(s.fault_mask) != 0;
  if (first == 0) note(a, epoch, kKernelStart);

  for (int t = 0; t < a.world && !failed; ++t) {
    size_t offset, elems;
    if (const int bad = send_block(a, t, offset, elems); bad >= 0) {
      if (first == 0) record_fault(a, s, encode_fault(Fault::kBadSplits, uint32_t(bad), uint32_t(elems)), epoch);
      failed = true;
    }
  }
  if (!failed) {
    if (first == 0) send_call_word<W>(a, buffer, call);
    for (size_t v = first; v < all; v += stride) {
      const int t = int(v / walk);
      const size_t j = v % walk;
      size_t offset = 0, elems = 0;
      send_block(a, t, offset, elems);
      const size_t bytes = elems * esize;
      if (j > block_chunks(bytes)) continue;
      uint32_t w[4] = {uint32_t(bytes), 0, 0, 0};
      if (j > 0) load_words(in + offset * esize, (j - 1) * kChunkBytes, bytes, a.dtype, w);
      if (t == r) {  // our own block stays with us
        if (j > 0) store_words(out + recv_offset(a, r) * esize, (j - 1) * kChunkBytes, bytes, a.dtype, w);
        else if (b.recv_counts != nullptr) b.recv_counts[r] = int64_t(elems / b.row);
        continue;
      }
#pragma unroll
      for (int p = 0; p < W; ++p)
        if (p < a.world && (a.stores & (1u << p)) && carries(a, p, t))
          send_chunk<F>(area(a.peer[p], a.layout, buffer, p, r), t * slot + j, w, call);
    }
  }
  if (a.network != 0) ring_doorbell(a, s, 0, epoch, buffer, delivery_of(a), !failed);
  reset_previous(a, s, epoch, buffer, first, stride);

  uint32_t calls_seen = 0;  // peers whose call word this thread has read equal to ours
  uint64_t deadline = 0;
  for (size_t v = first; v < all && !failed; v += stride) {
    const int t = int(v / walk);
    const size_t j = v % walk;
    if (t == r) continue;
    uint32_t got[W][kWireWords<F>];
    uint32_t w[4];
    failed = !receive<F, W>(a, s, epoch, buffer, call, r * slot, 1u << t, calls_seen, deadline, got);
    if (failed) break;
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p == t) payload<F>(got[p], w);
    const uint32_t bytes = w[0];
    if (!block_expected(a, t, bytes)) {
      if (j == 0) record_fault(a, s, encode_fault(Fault::kSplitMismatch, uint32_t(t), bytes), epoch);
      failed = true;
      break;
    }
    if (j == 0) {
      if (b.recv_counts != nullptr) b.recv_counts[t] = int64_t(bytes / (b.row * esize));
      continue;
    }
    if (j > block_chunks(bytes)) continue;
    failed = !receive<F, W>(a, s, epoch, buffer, call, r * slot + j, 1u << t, calls_seen, deadline, got);
    if (failed) break;
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p == t) payload<F>(got[p], w);
    store_words(out + recv_offset(a, t) * esize, (j - 1) * kChunkBytes, bytes, a.dtype, w);
  }
  poison_if_faulted(a, s);
  end_launch(a, s, epoch, first);
}

// Tests only (test_fault_record_race(), launch.cc), one thread per CTA: CTA 0 records `first` at `epoch` and holds
// the record half written for 20 ms; 1 ms in, CTA 1 records `second` at epoch + 1 and holds it for 5 ms, as two
// threads of a two-shot launch (its reduce and its gather) may.
__global__ void record_race_kernel(const DeviceState s, uint64_t first, uint64_t second, uint32_t epoch) {
  CallArgs a{};
  a.world = 1;  // no peer to tell
  if (blockIdx.x == 0) return record_fault(a, s, first, epoch, 20'000'000);
  for (const uint64_t until = global_timer_ns() + 1'000'000; global_timer_ns() < until;) {
  }
  record_fault(a, s, second, epoch + 1, 5'000'000);
}

// Calls f.template operator()<W>() with the kernel's world bound for `world` (see the kernel).
template <typename F>
void dispatch_world(int world, F&& f) {
  if (world <= 2) return f.template operator()<2>();
  if (world <= 4) return f.template operator()<4>();
  return f.template operator()<8>();
}

}  // namespace

const void* kernel_entry(DType dtype, ReduceOp op, int world, Variant variant) {
  const void* kernel = nullptr;
  if (variant == Variant::kAllToAllV) {  // moves bits: one kernel for every dtype
    dispatch_world(world, [&]<int W>() { kernel = reinterpret_cast<const void*>(blocks_kernel<W>); });
    return kernel;
  }
  if (variant == Variant::kAllGather || variant == Variant::kAllToAll) {  // move bits: one kernel for every dtype
    dispatch_world(world, [&]<int W>() {               // (sizes are the call's)
      kernel = variant == Variant::kAllGather
                   ? reinterpret_cast<const void*>(sharded_kernel<DType::kInt32, ReduceOp::kSum, W, Collective::kAllGather>)
                   : reinterpret_cast<const void*>(sharded_kernel<DType::kInt32, ReduceOp::kSum, W, Collective::kAllToAll>);
    });
    return kernel;
  }
  dispatch_dtype_op(dtype, op, [&]<DType D, ReduceOp Op>() {
    dispatch_world(world, [&]<int W>() {
      switch (variant) {
        case Variant::kOneShot:
          kernel = reinterpret_cast<const void*>(oneshot_allreduce_kernel<D, Op, W, false>);
          break;
        case Variant::kFused:
          if constexpr (kFusable<D, Op>) kernel = reinterpret_cast<const void*>(oneshot_allreduce_kernel<D, Op, W, true>);
          break;
        case Variant::kTwoShot:
          kernel = reinterpret_cast<const void*>(sharded_kernel<D, Op, W, Collective::kAllReduce>);
          break;
        case Variant::kReduceScatter:
          kernel = reinterpret_cast<const void*>(sharded_kernel<D, Op, W, Collective::kReduceScatter>);
          break;
        case Variant::kAllGather:
        case Variant::kAllToAll:
        case Variant::kAllToAllV: break;
      }
    });
  });
  return kernel;
}

const void* record_race_kernel_entry() { return reinterpret_cast<const void*>(record_race_kernel); }

}  // namespace rocenante
