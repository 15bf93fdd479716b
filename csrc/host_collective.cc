// The collectives of CPU tensors: the protocol of layout.h run by one thread (peers on this host through shared
// memory, network peers through the proxy's mailbox), one call (a piece) at a time.
//   1. push:  write the call word, then our data (Lamport: sanitized; int32, all-gathers and all-to-alls: as
//             lines) into our area of this call's buffer in every peer's region (network peers: in our image of
//             it, then ring the proxy's doorbell, layout.h's Mailbox): our whole input (one-shot), each peer's
//             shard of it (two-shot's first exchange, reduce-scatter, all-to-all) or our shard (all-gather);
//   2. reset: write kEmpty over the previous call's buffer of our own region;
//   3. pull:  wait for every peer's call word (network peers: once their arrival word says the delivery is
//             whole), then block by block for every peer's data, combine all inputs in rank order and write the
//             output (one-shot: all of it; two-shot: our shard, also sent to every peer, then the peers' reduced
//             shards as they arrive; reduce-scatter: our shard), or copy the peers' shards out (all-gather: each
//             peer's own; all-to-all: the one each peer sent us, and our own block from our input).
//
// Element atomicity (layout.h relies on it): every word a peer polls is written by one aligned store that
// covers it whole, and read by one aligned load that covers it whole:
//   - Lamport data and resets travel as 16-byte chunks, one aligned vector access each (put_chunk/get_chunk):
//     through a volatile pointer, so the compiler emits exactly one vector instruction per chunk (movaps and
//     movdqa on x86-64, str q and ldr q on AArch64, as the generated code shows) and never splits it, merges it
//     or turns a loop of them into memcpy/memset (whose byte-granular copies may tear a word). The hardware then
//     moves each aligned 32-bit element of it whole: processors with AVX carry out an aligned 16-byte SSE access
//     atomically (Intel SDM vol. 3A, "Guaranteed Atomic Operations"; older x86 may split it into several
//     accesses, aligned quadwords in practice); AArch64 carries out a 16-byte-aligned 128-bit SIMD access as two
//     single-copy-atomic 64-bit accesses (Arm ARM, "Single-copy atomicity").
//   - Line halves {data, flag} (int32) and call words are C++ atomics (8 and 4 bytes).
// Placement order is never relied on: a block is reduced only once every one of its words has arrived.
#include "host_collective.h"

#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "chunk_reduce.h"
#include "cpu_relax.h"
#include "fault.h"

namespace rocenante {
namespace {

// One 16-byte chunk in a vector register (GCC/Clang vector extensions: SSE2 on x86-64, NEON on AArch64), as
// four 32-bit words, four floats, four int32 or eight 16-bit halves.
using Words = uint32_t __attribute__((vector_size(kChunkBytes)));
using Floats = float __attribute__((vector_size(kChunkBytes)));
using Ints = int32_t __attribute__((vector_size(kChunkBytes)));
using Halves = uint16_t __attribute__((vector_size(kChunkBytes)));
static_assert(sizeof(Words) == kChunkBytes && alignof(Words) == kChunkBytes, "a chunk is one aligned vector");

constexpr Words kEmptyChunk = {kEmpty, kEmpty, kEmpty, kEmpty};

inline void put_chunk(uint32_t* dst, Words v) { *reinterpret_cast<volatile Words*>(dst) = v; }
inline Words get_chunk(const uint32_t* src) { return *reinterpret_cast<const volatile Words*>(src); }

inline void store_word(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline uint32_t load_word(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
// A line's 8-byte half {data, flag} is one atomic 64-bit access.
inline void store_half(uint32_t* half, uint32_t data, uint32_t flag) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(half), (uint64_t(flag) << 32) | data, __ATOMIC_RELAXED);
}
inline uint64_t load_half(const uint32_t* half) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(half), __ATOMIC_RELAXED);
}

using Quads = uint64_t __attribute__((vector_size(kChunkBytes)));
inline bool any_lane(Words m) {
  const Quads q = Quads(m);
  return (q[0] | q[1]) != 0;
}

// A chunk as it is sent in format F, and as every rank reduces its own input: for the Lamport format
// sanitize_word() on every word (-0.0 elements become +0.0, so no sent word is kEmpty); lines as it is.
template <DType D, Format F = format_of(D)>
Words sanitize(Words w) {
  if constexpr (F == Format::kLines) {
    return w;
  } else if constexpr (D == DType::kFloat32) {
    return w & ~Words(w == kEmpty);
  } else {
    const Halves h = Halves(w);
    return Words(h & ~Halves(h == uint16_t(0x8000)));
  }
}

// Chunks per block: the pull waits once per peer and block, and the caller's input and output pass through
// aligned staging of one block (1 KiB) that stays in L1 with the block's partial results (at most 2 KiB).
constexpr size_t kBlockChunks = 64;

// Chunks [c0, c0 + n) of the `bytes` bytes at `base` (a caller's tensor, or a shard of it), staged: the caller's
// buffers are aligned to their element size only, and the last chunk may be partial (its missing bytes read as
// zero). The caller's memory is private to this rank, so libc's memcpy moves it.
inline void load_block(const void* base, size_t bytes, size_t c0, size_t n, Words* staged) {
  const size_t begin = c0 * kChunkBytes, have = std::min(n * kChunkBytes, bytes - begin);
  std::memcpy(staged, static_cast<const char*>(base) + begin, have);
  std::memset(reinterpret_cast<char*>(staged) + have, 0, n * kChunkBytes - have);
}
inline void store_block(void* base, size_t bytes, size_t c0, size_t n, const Words* staged) {
  const size_t begin = c0 * kChunkBytes;
  std::memcpy(static_cast<char*>(base) + begin, staged, std::min(n * kChunkBytes, bytes - begin));
}

// Waits with backoff that yields the core: spin (a peer running on another core arrives within microseconds),
// then yield 100 times (which costs nothing when no other thread wants this core, and lets the peer run when
// it shares it), then sleep in growing steps of at most 100 us so a late peer costs no CPU. Past the spinning
// every pause reads the clock, the abort words and (every 10 ms) whether a signal asks us to stop.
// How long to spin adapts, per thread, to where the peers run (as an adaptive mutex does): a wait that ends
// while spinning doubles the next spin, up to kMaxSpin; one that ends only after yielding (the peer shares our
// core, or is descheduled: spinning only delays it) halves it, down to kMinSpin.
class Backoff {
 public:
  Backoff(const CallArgs& a, uint32_t epoch, InterruptCheck interrupted)
      : a_(a), epoch_(epoch), interrupted_(interrupted), start_(Clock::now()),
        deadline_(start_ + std::chrono::nanoseconds(a.timeout_ns)) {}
  // 0 to keep waiting for the peers in `pending`, or the fault that ends the wait (kPeerTimeout's detail is left
  // for the caller).
  uint64_t pause(uint32_t pending) {
    if (spinning_) {
      cpu_relax();
      if (++spins_ % kSpinsPerClockRead != 0 || Clock::now() < start_ + spin_) return 0;
      spinning_ = false;
    }
    if (yields_ < 100) {
      ++yields_;
      sched_yield();
    } else {
      sleep_us_ = std::min<uint32_t>(sleep_us_ * 2 + 1, 100);
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    }
    const auto acquire = [](uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); };
    if (const uint64_t f = abort_seen(a_, epoch_, pending, acquire)) return f;
    const Clock::time_point now = Clock::now();
    if (interrupted_ != nullptr && now >= next_signal_check_) {
      next_signal_check_ = now + std::chrono::milliseconds(10);
      if (interrupted_()) return encode_fault(Fault::kInterrupted, a_.rank, 0);
    }
    return now < deadline_ ? 0 : encode_fault(Fault::kPeerTimeout, 0, 0);
  }
  // The wait is over: adapt the next one's spin.
  void arrived() { spin_ = spinning_ ? std::min(spin_ * 2, kMaxSpin) : std::max(spin_ / 2, kMinSpin); }

 private:
  using Clock = std::chrono::steady_clock;
  // 50 us: several times a small call, short against a scheduler time slice (milliseconds); 1 us: a few polls.
  static constexpr std::chrono::nanoseconds kMinSpin{1000}, kMaxSpin{50000};
  static constexpr uint32_t kSpinsPerClockRead = 16;  // a clock read costs about as much as 16 polls
  static thread_local std::chrono::nanoseconds spin_;
  const CallArgs& a_;
  uint32_t epoch_;  // the call that waits
  InterruptCheck interrupted_;
  Clock::time_point start_, deadline_;
  Clock::time_point next_signal_check_{};
  bool spinning_ = true;
  uint32_t spins_ = 0;
  uint32_t yields_ = 0;
  uint32_t sleep_us_ = 0;
};
thread_local std::chrono::nanoseconds Backoff::spin_{Backoff::kMaxSpin};

// Waits for the peers in `pending` (bit p: peer p), until `arrived(pending)`, which clears the bits of those
// that arrived, has cleared them all: 0, or the fault that ended the wait (a timeout names the peers still
// pending). The set, not one peer at a time: a peer whose process ended fails a wait while it is in the set, so a
// wait that also needs a late but live peer still fails at once (the kernel's receive() likewise).
template <class Arrived>
uint64_t wait_for(const CallArgs& a, uint32_t epoch, uint32_t pending, InterruptCheck interrupted, Arrived arrived) {
  arrived(pending);
  if (pending == 0) return 0;  // the common case: no clock read
  Backoff backoff(a, epoch, interrupted);
  // A fault ends the wait only after one more look: a peer whose call differs writes its call word before it
  // aborts, and this rank should name that call rather than relay the peer's abort.
  for (uint64_t fault = 0;; fault = backoff.pause(pending)) {
    arrived(pending);
    if (pending == 0) {
      backoff.arrived();
      return 0;
    }
    if (fault_kind(fault) == Fault::kPeerTimeout) return encode_fault(Fault::kPeerTimeout, pending, 0);
    if (fault != 0) return fault;
  }
}

// Chunk `c` of a peer's area, once it has arrived: the data words of its two lines in the line format.
template <Format F>
Words peer_chunk(const uint32_t* area, size_t c) {
  if constexpr (F == Format::kLamport) {
    return get_chunk(area + c * 4);
  } else {
    Words w = {0, 0, 0, 0};
    for (int h = 0; h < int(kLinesPerChunk); ++h) {
      const uint32_t* line = area + chunk_line(c, h) * 4;
      w[2 * h] = uint32_t(load_half(line));
      w[2 * h + 1] = uint32_t(load_half(line + 2));
    }
    return w;
  }
}

// One look at chunks [c, end) of a peer's area: the first chunk not yet wholly arrived, or `end`. A waiting
// rank polls from there, so it reads again neither what has arrived nor lines the peer is still writing.
template <Format F>
size_t arrived_until(const uint32_t* area, size_t c, size_t end, uint32_t call) {
  if constexpr (F == Format::kLamport) {
    for (; c + 4 <= end; c += 4) {  // a 64-byte line at a time, then the chunk that is not there
      const uint32_t* p = area + c * 4;
      if (any_lane(Words(get_chunk(p) == kEmpty) | Words(get_chunk(p + 4) == kEmpty) |
                   Words(get_chunk(p + 8) == kEmpty) | Words(get_chunk(p + 12) == kEmpty)))
        break;
    }
    for (; c < end; ++c)
      if (any_lane(Words(get_chunk(area + c * 4) == kEmpty))) return c;
  } else {
    for (; c < end; ++c)
      for (int h = 0; h < int(kLinesPerChunk); ++h) {
        const uint32_t* line = area + chunk_line(c, h) * 4;
        if (uint32_t(load_half(line) >> 32) != call || uint32_t(load_half(line + 2) >> 32) != call) return c;
      }
  }
  return end;
}

// How a chunk is combined, in vector registers: the same operations in the same order as Chunk<D>'s
// accumulate() and finish() (chunk_reduce.h), lane by lane, so the bits equal the kernel's.
// from(): the first rank's chunk; combine(): the next rank's; finish(): the output chunk.
template <ReduceOp Op, class V>
V combine_lanes(V acc, V v) {
  if constexpr (Op == ReduceOp::kMax) return ((acc > v) | (acc != acc)) ? acc : v;  // a NaN wins, as in combine()
  if constexpr (Op == ReduceOp::kMin) return ((acc < v) | (acc != acc)) ? acc : v;
  return acc + v;
}

// float16: the scalar code of chunk_reduce.h, element by element.
template <DType D, ReduceOp Op>
struct Reducer {
  struct Acc {
    typename Chunk<D>::Acc e[Chunk<D>::kElems];
  };
  static Acc from(Words w) { return fold(Acc{}, w, true); }
  static Acc combine(Acc acc, Words w) { return fold(acc, w, false); }
  static Words finish(const Acc& acc, int world) {
    uint32_t out[4] = {0, 0, 0, 0};
    rocenante::finish<D, Op>(acc.e, world, out);
    Words w = {0, 0, 0, 0};
    std::memcpy(&w, out, sizeof(w));
    return w;
  }

 private:
  static Acc fold(Acc acc, Words w, bool first) {
    uint32_t in[4];
    std::memcpy(in, &w, sizeof(in));
    accumulate<D, Op>(acc.e, in, first);
    return acc;
  }
};

template <ReduceOp Op>
struct Reducer<DType::kFloat32, Op> {
  using Acc = Floats;
  static Acc from(Words w) { return Floats(w); }
  static Acc combine(Acc acc, Words w) { return combine_lanes<Op>(acc, Floats(w)); }
  static Words finish(Acc acc, int world) {
    if constexpr (Op == ReduceOp::kAvg) acc = acc / float(world);
    return Words(acc);
  }
};

// int32 sums wrap (unsigned lanes); max and min compare signed lanes.
template <ReduceOp Op>
struct Reducer<DType::kInt32, Op> {
  using Acc = Words;
  static Acc from(Words w) { return w; }
  static Acc combine(Acc acc, Words w) {
    if constexpr (Op == ReduceOp::kSum) return acc + w;
    return Words(combine_lanes<Op>(Ints(acc), Ints(w)));
  }
  static Words finish(Acc acc, int) { return acc; }
};

// bfloat16: each word holds two elements; the low ones and the high ones accumulate in two float vectors.
template <ReduceOp Op>
struct Reducer<DType::kBFloat16, Op> {
  struct Acc {
    Floats low, high;
  };
  static Acc from(Words w) { return {Floats(w << 16), Floats(w & 0xFFFF0000u)}; }
  static Acc combine(Acc acc, Words w) {
    return {combine_lanes<Op>(acc.low, Floats(w << 16)), combine_lanes<Op>(acc.high, Floats(w & 0xFFFF0000u))};
  }
  static Words finish(Acc acc, int world) {
    if constexpr (Op == ReduceOp::kAvg) {
      acc.low = acc.low / float(world);
      acc.high = acc.high / float(world);
    }
    return to_bf16(acc.low) | (to_bf16(acc.high) << 16);
  }

 private:
  // float_to_bf16() on four lanes: NaN stays a quiet NaN, everything else rounds to nearest even.
  static Words to_bf16(Floats f) {
    const Words b = Words(f);
    const Words nan = Words((b & 0x7FFFFFFFu) > 0x7F800000u);
    return (nan & ((b >> 16) | 0x40u)) | (~nan & ((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16));
  }
};

// Stores staged chunks (as sent: sanitize()d) as chunks [c0, c0 + n) of `dst`, an area of a peer's region (or of
// our image of it), in format F.
template <Format F>
void put_chunks(uint32_t* dst, size_t c0, size_t n, const Words* staged, uint32_t call) {
  if constexpr (F == Format::kLamport) {
    for (size_t i = 0; i < n; ++i) put_chunk(dst + (c0 + i) * 4, staged[i]);
  } else {
    for (size_t i = 0; i < n; ++i)
      for (int h = 0; h < int(kLinesPerChunk); ++h) {
        uint32_t* line = dst + chunk_line(c0 + i, h) * 4;
        store_half(line, staged[i][2 * h], call);
        store_half(line + 2, staged[i][2 * h + 1], call);
      }
  }
}

// The areas this rank writes a call into: its area of buffer b in the region of each peer in `peers`.
struct Destinations {
  uint32_t* area[kMaxRanks];
  int count = 0;
  Destinations(const CallArgs& a, int buffer, uint32_t peers) {
    for (int p = 0; p < a.world; ++p)
      if (peers & (1u << p)) area[count++] = rocenante::area(a.peer[p], a.layout, buffer, p, a.rank);
  }
};

// Sends the `bytes` bytes at `src` as chunks [at, at + ceil(bytes / 16)) of every destination's area.
template <DType D, Format F>
void send(const Destinations& to, const void* src, size_t bytes, size_t at, uint32_t call) {
  const size_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  Words staged[kBlockChunks];
  for (size_t c0 = 0; c0 < chunks; c0 += kBlockChunks) {
    const size_t n = std::min(kBlockChunks, chunks - c0);
    load_block(src, bytes, c0, n, staged);
    for (size_t i = 0; i < n; ++i) staged[i] = sanitize<D, F>(staged[i]);
    for (int p = 0; p < to.count; ++p) put_chunks<F>(to.area[p], at + c0, n, staged, call);
  }
}

// The push (step 1): this rank's data of the call, in format F, into every peer's area (layout.h, Shards): our
// whole input (one-shot), our shard at our slot (all-gather), or shard p at slot p of peer p's area (two-shot's
// first exchange, reduce-scatter, all-to-all). A network peer's area is our image of its region, one for the peers
// below us and one for those above (CallArgs::stores), so what each of those peers reads from it is written there:
// every shard but ours.
template <DType D, Format F>
void push_as(const CallArgs& a, int buffer, uint32_t call) {
  const Shards& sh = a.shards;
  if (!sharded(a)) {
    send<D, F>(Destinations(a, buffer, a.stores), a.in, a.bytes, 0, call);
  } else if (a.collective == Collective::kAllGather) {
    send<D, F>(Destinations(a, buffer, a.stores), a.in, sh.bytes_of(a.rank), a.rank * sh.slot_chunks, call);
  } else {
    for (int p = 0; p < a.world; ++p) {
      if (!(a.stores & (1u << p))) continue;
      const Destinations to(a, buffer, 1u << p);
      for (int s = 0; s < a.world; ++s)
        if (carries(a, p, s))
          send<D, F>(to, static_cast<const char*>(a.in) + s * a.stride_bytes, sh.bytes_of(s), s * sh.slot_chunks,
                     call);
    }
  }
}
// A split all-to-all's push (layout.h, kAllToAllV): block t, a header and then its elements, at slot t of peer
// t's area (and of a network peer's image, every block but ours); the counts were checked before (host_call()).
template <DType D>
void push_blocks(const CallArgs& a, int buffer, uint32_t call) {
  const size_t esize = dtype_size(a.dtype), slot = size_t(1) << a.blocks.slot_log2;
  for (int p = 0; p < a.world; ++p) {
    if (!(a.stores & (1u << p))) continue;
    const Destinations to(a, buffer, 1u << p);
    for (int t = 0; t < a.world; ++t) {
      if (!carries(a, p, t)) continue;
      size_t offset = 0, elems = 0;
      send_block(a, t, offset, elems);
      const Words header = {uint32_t(elems * esize), 0, 0, 0};
      put_chunks<Format::kLines>(to.area[0], t * slot, 1, &header, call);
      send<D, Format::kLines>(to, static_cast<const char*>(a.in) + offset * esize, elems * esize, t * slot + 1, call);
    }
  }
}
// The call's format (format_of(args)): the dtype's, or lines for what must come back bit for bit.
template <DType D>
void push(const CallArgs& a, int buffer, uint32_t call) {
  if (a.collective == Collective::kAllToAllV)
    push_blocks<D>(a, buffer, call);
  else if (format_of(a) == Format::kLines)
    push_as<D, Format::kLines>(a, buffer, call);
  else
    push_as<D, format_of(D)>(a, buffer, call);
}

// Waits until chunks [at, at + chunks) of the area of every peer in `from` (bit s: areas[s], peer s's area in our
// region) have all arrived; 0 or the fault.
template <Format F>
uint64_t wait_chunks(const CallArgs& a, const uint32_t* const* areas, uint32_t from, size_t at, size_t chunks,
                     uint32_t epoch, InterruptCheck interrupted) {
  const uint32_t call = make_flag(a.signature, epoch);
  size_t next[kMaxRanks];  // per peer, the first chunk not yet seen whole
  std::fill(next, next + kMaxRanks, at);
  const size_t end = at + chunks;
  return wait_for(a, epoch, from, interrupted, [&](uint32_t& pending) {
    for (int s = 0; s < a.world; ++s)
      if ((pending & (1u << s)) && (next[s] = arrived_until<F>(areas[s], next[s], end, call)) == end)
        pending &= ~(1u << s);
  });
}

// Reduces `bytes` bytes in rank order: ours at `in`, each peer's as chunks [at, ...) of its area (`areas[s]`,
// waited for block by block), into `out`; each block of results is also sent to `forward` (two-shot's second
// exchange). `done`: bytes of `out` written.
template <DType D, ReduceOp Op>
uint64_t reduce(const CallArgs& a, const uint32_t* const* areas, size_t at, const void* in, void* out,
                size_t bytes, uint32_t epoch, const Destinations* forward, InterruptCheck interrupted, size_t& done) {
  constexpr Format F = format_of(D);
  const uint32_t call = make_flag(a.signature, epoch);
  using R = Reducer<D, Op>;
  const size_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  for (size_t c0 = 0; c0 < chunks; c0 += kBlockChunks) {
    const size_t n = std::min(kBlockChunks, chunks - c0);
    if (const uint64_t fault = wait_chunks<F>(a, areas, peers_of(a), at + c0, n, epoch, interrupted)) return fault;
    typename R::Acc acc[kBlockChunks];
    Words staged[kBlockChunks];  // our input, then the output
    load_block(in, bytes, c0, n, staged);
    for (int s = 0; s < a.world; ++s) {
      for (size_t i = 0; i < n; ++i) {
        const Words w = s == a.rank ? sanitize<D>(staged[i]) : peer_chunk<F>(areas[s], at + c0 + i);
        acc[i] = s == 0 ? R::from(w) : R::combine(acc[i], w);
      }
    }
    // Results are sanitized as inputs are (layout.h): two-shot sends them, and one-shot returns the same bits.
    for (size_t i = 0; i < n; ++i) staged[i] = sanitize<D>(R::finish(acc[i], a.world));
    store_block(out, bytes, c0, n, staged);
    if (forward != nullptr)
      for (int p = 0; p < forward->count; ++p) put_chunks<F>(forward->area[p], at + c0, n, staged, call);
    done = std::min(bytes, (c0 + n) * kChunkBytes);
  }
  return 0;
}

// Copies what each peer s sent into dst[s]: bytes[s] bytes as chunks [at[s], ...) of its area, areas[s], in
// whatever order they arrive. One wait for the set of peers still owed, as the other phases wait: a peer that
// ended fails it at once, also while another is late. The wait starts afresh after each copy, so the timeout
// bounds the time without progress, as a wait per block would.
template <Format F>
uint64_t gather(const CallArgs& a, const uint32_t* const* areas, const size_t* at, const size_t* bytes,
                char* const* dst, uint32_t epoch, InterruptCheck interrupted) {
  const uint32_t call = make_flag(a.signature, epoch);
  size_t copied[kMaxRanks] = {};  // chunks of each peer's data copied out
  uint32_t owed = peers_of(a);
  const auto copy_arrived = [&] {  // true if it copied anything
    bool progress = false;
    for (int s = 0; s < a.world; ++s) {
      if (!(owed & (1u << s))) continue;
      const size_t chunks = block_chunks(bytes[s]);
      const size_t until = arrived_until<F>(areas[s], at[s] + copied[s], at[s] + chunks, call) - at[s];
      for (size_t n; copied[s] < until; copied[s] += n, progress = true) {
        n = std::min(kBlockChunks, until - copied[s]);
        Words staged[kBlockChunks];
        for (size_t i = 0; i < n; ++i) staged[i] = peer_chunk<F>(areas[s], at[s] + copied[s] + i);
        store_block(dst[s], bytes[s], copied[s], n, staged);
      }
      if (copied[s] == chunks) owed &= ~(1u << s);
    }
    return progress;
  };
  while (owed != 0)
    if (const uint64_t fault = wait_for(a, epoch, owed, interrupted, [&](uint32_t& pending) {
          pending = copy_arrived() ? 0 : owed;
        }))
      return fault;
  return 0;
}

// The shards of a sharded call: peer s sent sh.bytes_of(s) bytes at slot t = s (its own shard: all-gather,
// two-shot's second exchange) or t = our rank (the block it sends us: all-to-all), for out + s * stride_bytes.
template <Format F>
uint64_t gather_shards(const CallArgs& a, const uint32_t* const* areas, char* out, uint32_t epoch,
                       InterruptCheck interrupted) {
  size_t at[kMaxRanks], bytes[kMaxRanks];
  char* dst[kMaxRanks];
  for (int s = 0; s < a.world; ++s) {
    at[s] = (a.collective == Collective::kAllToAll ? a.rank : s) * a.shards.slot_chunks;
    bytes[s] = a.shards.bytes_of(s);
    dst[s] = out + s * a.stride_bytes;
  }
  return gather<F>(a, areas, at, bytes, dst, epoch, interrupted);
}

// A split all-to-all's blocks (layout.h, kAllToAllV): ours from our input, then each peer's header, checked
// against the size we expect of that peer, then its block.
uint64_t gather_blocks(const CallArgs& a, const uint32_t* const* areas, uint32_t epoch, InterruptCheck interrupted) {
  const Blocks& b = a.blocks;
  const size_t esize = dtype_size(a.dtype), at = size_t(a.rank) << b.slot_log2;
  char* const out = static_cast<char*>(a.out);
  size_t offset = 0, elems = 0;
  send_block(a, a.rank, offset, elems);
  std::memmove(out + recv_offset(a, a.rank) * esize, static_cast<const char*>(a.in) + offset * esize, elems * esize);
  if (b.recv_counts != nullptr) b.recv_counts[a.rank] = int64_t(elems / b.row);
  if (const uint64_t fault = wait_chunks<Format::kLines>(a, areas, peers_of(a), at, 1, epoch, interrupted)) return fault;
  size_t ats[kMaxRanks], bytes[kMaxRanks];
  char* dst[kMaxRanks];
  for (int s = 0; s < a.world; ++s) {
    if (s == a.rank) continue;
    const uint32_t sent = peer_chunk<Format::kLines>(areas[s], at)[0];
    if (!block_expected(a, s, sent)) return encode_fault(Fault::kSplitMismatch, s, sent);
    if (b.recv_counts != nullptr) b.recv_counts[s] = int64_t(sent / (b.row * esize));
    ats[s] = at + 1, bytes[s] = sent, dst[s] = out + recv_offset(a, s) * esize;
  }
  return gather<Format::kLines>(a, areas, ats, bytes, dst, epoch, interrupted);
}

// The pull (step 3). `done`: bytes of a one-shot call's output written (the rest is poisoned on a fault).
template <DType D, ReduceOp Op>
uint64_t pull(const CallArgs& a, uint32_t epoch, InterruptCheck interrupted, size_t& done) {
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  done = 0;
  // Every peer's call word first: no output before each one says the peer makes this very call. A network
  // peer's words are read only once its delivery of this call has arrived whole (layout.h, Mailbox).
  const auto call_of = [&](int s) {
    if ((a.network & (1u << s)) &&
        !arrived_whole(a.arrivals + arrival_index(buffer, s), epoch,
                       [](const uint32_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }))
      return kEmpty;
    return load_word(call_word(a.local, buffer, s));
  };
  // A peer making another call ends the wait at once, and is named before any fault the wait met.
  uint32_t theirs[kMaxRanks] = {};
  int differs = -1;
  const uint64_t fault = wait_for(a, epoch, peers_of(a), interrupted, [&](uint32_t& pending) {
    for (int s = 0; s < a.world; ++s) {
      if (!(pending & (1u << s)) || (theirs[s] = call_of(s)) == kEmpty) continue;
      pending &= ~(1u << s);
      if (theirs[s] != call && differs < 0) differs = s;
    }
    if (differs >= 0) pending = 0;
  });
  if (differs >= 0) return encode_fault(Fault::kCallMismatch, differs, flag_signature(theirs[differs], epoch));
  if (fault != 0) return fault;
  note(a.timeline, epoch, kKernelArrived);
  // Then the data: whatever has arrived is this call's (layout.h).
  const uint32_t* areas[kMaxRanks] = {};
  for (int s = 0; s < a.world; ++s)
    if (s != a.rank) areas[s] = area(a.local, a.layout, buffer, a.rank, s);
  if (a.collective == Collective::kAllToAllV) return gather_blocks(a, areas, epoch, interrupted);
  if (!sharded(a)) return reduce<D, Op>(a, areas, 0, a.in, a.out, a.bytes, epoch, nullptr, interrupted, done);

  const Shards& sh = a.shards;
  const int r = a.rank;
  char* const out = static_cast<char*>(a.out);
  if (a.collective == Collective::kAllGather) {
    std::memmove(out + r * a.stride_bytes, a.in, sh.bytes_of(r));  // every bit as given (in place: the same bytes)
  } else if (a.collective == Collective::kAllToAll) {  // our own block, as our input has it
    std::memmove(out + r * a.stride_bytes, static_cast<const char*>(a.in) + r * a.stride_bytes, sh.bytes_of(r));
  } else {  // our shard, reduced: a reduce-scatter's output, or sent on to every peer (two-shot)
    const bool two_shot = a.collective == Collective::kAllReduce;
    const Destinations forward(a, buffer, two_shot ? a.stores : 0);
    size_t reduced = 0;
    const char* in = static_cast<const char*>(a.in) + r * a.stride_bytes;
    if (const uint64_t fault = reduce<D, Op>(a, areas, r * sh.slot_chunks, in, two_shot ? out + r * a.stride_bytes : out,
                                             sh.bytes_of(r), epoch, two_shot ? &forward : nullptr, interrupted, reduced))
      return fault;
    if (!two_shot) return 0;
  }
  return format_of(a) == Format::kLines ? gather_shards<Format::kLines>(a, areas, out, epoch, interrupted)
                                        : gather_shards<format_of(D)>(a, areas, out, epoch, interrupted);
}

// stop_after_push(): the pushes still to make before the test's signal (0: none), and the signal.
std::atomic<uint64_t> pushes_before_signal{0};
std::atomic<int> signal_after_push{SIGSTOP};

// One call of the protocol (host_collective() runs a piece's calls).
uint64_t host_call(const CallArgs& a, uint32_t epoch, uint32_t reset, InterruptCheck interrupted) {
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  note(a.timeline, epoch, kKernelStart);
  uint64_t fault = 0;
  size_t done = 0;
  if (a.collective == Collective::kAllToAllV) {  // counts that cannot be sent: nothing is sent
    for (int t = 0; t < a.world && fault == 0; ++t) {
      size_t offset, elems;
      if (const int bad = send_block(a, t, offset, elems); bad >= 0) fault = encode_fault(Fault::kBadSplits, bad, elems);
    }
  }

  // The previous call's reset (step 2) must land before what a peer sends after seeing our data of this call:
  // release orders those earlier stores before the pushes below.
  std::atomic_thread_fence(std::memory_order_release);
  for (int p = 0; p < a.world && fault == 0; ++p)
    if (a.stores & (1u << p)) store_word(call_word(a.peer[p], buffer, a.rank), call);
  if (fault == 0) dispatch_dtype_op(a.dtype, a.op, [&]<DType D, ReduceOp>() { push<D>(a, buffer, call); });
  // Network peers: the proxy delivers what the image now holds (layout.h, Mailbox).
  if (a.mailbox != nullptr && fault == 0) {
    __atomic_store_n(&a.mailbox->ring[buffer], ring_word(delivery_of(a), epoch), __ATOMIC_RELEASE);
    note(a.timeline, epoch, kKernelRing);
  }
  if (pushes_before_signal.load(std::memory_order_relaxed) != 0 && pushes_before_signal.fetch_sub(1) == 1)
    raise(signal_after_push.load());

  const int previous = previous_buffer(epoch);
  for (int s = 0; s < a.world; ++s) {
    if (s == a.rank) continue;
    store_word(call_word(a.local, previous, s), kEmpty);
    uint32_t* stale = area(a.local, a.layout, previous, a.rank, s);
    size_t begin[2], end[2];
    for (int i = 0, n = footprint_ranges(reset, a.rank, s, begin, end); i < n; ++i)
      for (size_t b = begin[i]; b < end[i]; b += kChunkBytes) put_chunk(stale + b / sizeof(uint32_t), kEmptyChunk);
  }

  if (fault == 0)
    dispatch_dtype_op(a.dtype, a.op, [&]<DType D, ReduceOp Op>() { fault = pull<D, Op>(a, epoch, interrupted, done); });
  if (fault != 0) {  // every output byte not computed: a one-shot call's rest, a sharded call's whole output
    if (a.collective == Collective::kAllToAllV) {  // every block's place, and no count received
      for (int s = 0; s < a.world; ++s) {
        poison_host(static_cast<char*>(a.out) + recv_offset(a, s) * dtype_size(a.dtype),
                    recv_limit(a, s) * dtype_size(a.dtype), a.dtype);
        if (a.blocks.recv_counts != nullptr) a.blocks.recv_counts[s] = -1;
      }
    } else if (!sharded(a)) {
      poison_host(static_cast<char*>(a.out) + done, a.bytes - done, a.dtype);
    } else if (a.collective == Collective::kReduceScatter) {
      poison_host(a.out, a.shards.bytes_of(a.rank), a.dtype);
    } else {
      for (int s = 0; s < a.world; ++s)
        poison_host(static_cast<char*>(a.out) + s * a.stride_bytes, a.shards.bytes_of(s), a.dtype);
    }
  }
  note(a.timeline, epoch, kKernelEnd);
  return fault;
}

}  // namespace

void poison_host(void* begin, size_t bytes, DType dtype) {
  const uint32_t word = poison_word(dtype);
  for (size_t b = 0; b < bytes; b += sizeof(word))
    std::memcpy(static_cast<char*>(begin) + b, &word, std::min(sizeof(word), bytes - b));
}

void stop_after_push(uint64_t push, bool kill) {
  signal_after_push.store(kill ? SIGKILL : SIGSTOP);
  pushes_before_signal.store(push);
}

uint64_t host_collective(const CallArgs& a, uint32_t epoch, uint32_t reset, InterruptCheck interrupted) {
  if (calls_of(a) == 1) return host_call(a, epoch, reset, interrupted);
  const CallArgs scatter = piece_call(a, 0);
  if (const uint64_t fault = host_call(scatter, epoch, reset, interrupted)) return fault;
  return host_call(piece_call(a, 1), next_epoch(epoch), footprint_of(scatter), interrupted);
}

}  // namespace rocenante
