// One-shot all-reduce between processes of one host, on the CPU: the protocol of layout.h run by one thread.
//   1. push:  write the call word, then our input (Lamport: sanitized; int32: as lines) into our area of this
//             call's buffer in every peer's region;
//   2. reset: write kEmpty over the previous call's buffer of our own region;
//   3. pull:  wait for every peer's call word, then chunk by chunk for every peer's data, combine all inputs in
//             rank order and write the output.
// Every word a peer polls is written with one aligned atomic store (layout.h: element atomicity).
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "allreduce_args.h"
#include "chunk_reduce.h"

namespace rocenante {
namespace {

inline void store_word(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline uint32_t load_word(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
// A line's 8-byte half {data, flag} is written as one atomic 64-bit store.
inline void store_half(uint32_t* half, uint32_t data, uint32_t flag) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(half), (uint64_t(flag) << 32) | data, __ATOMIC_RELAXED);
}

// Waits with backoff that yields the core: spin briefly (a peer usually arrives within microseconds),
// then yield, then sleep in growing steps of at most 100 us so a late peer costs no CPU. Past the spinning
// every pause reads the clock, the abort words and (every 10 ms) whether a signal asks us to stop.
class Backoff {
 public:
  Backoff(const AllReduceArgs& a, InterruptCheck interrupted)
      : a_(a), interrupted_(interrupted), deadline_(Clock::now() + std::chrono::nanoseconds(a.timeout_ns)) {}
  // 0 to keep waiting, or the fault that ends the wait (kPeerTimeout's detail is left for the caller).
  uint64_t pause() {
    ++rounds_;
    if (rounds_ < 2000) return 0;  // ~a few microseconds of pure spinning
    if (rounds_ < 2100) {
      sched_yield();
    } else {
      sleep_us_ = std::min<uint32_t>(sleep_us_ * 2 + 1, 100);
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    }
    if (const uint64_t f = abort_seen(a_, [](uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); })) return f;
    const Clock::time_point now = Clock::now();
    if (interrupted_ != nullptr && now >= next_signal_check_) {
      next_signal_check_ = now + std::chrono::milliseconds(10);
      if (interrupted_()) return encode_fault(Fault::kInterrupted, a_.rank, 0);
    }
    return now < deadline_ ? 0 : encode_fault(Fault::kPeerTimeout, 0, 0);
  }

 private:
  using Clock = std::chrono::steady_clock;
  const AllReduceArgs& a_;
  InterruptCheck interrupted_;
  Clock::time_point deadline_;
  Clock::time_point next_signal_check_{};
  uint32_t rounds_ = 0;
  uint32_t sleep_us_ = 0;
};

void load_chunk(const AllReduceArgs& a, size_t chunk, uint32_t (&w)[4]) {
  const size_t begin = chunk * kChunkBytes;
  const size_t n = std::min(kChunkBytes, a.bytes - begin);
  std::memset(w, 0, sizeof(w));
  std::memcpy(w, static_cast<const char*>(a.in) + begin, n);
}

void store_chunk(const AllReduceArgs& a, size_t chunk, const uint32_t (&w)[4]) {
  const size_t begin = chunk * kChunkBytes;
  std::memcpy(static_cast<char*>(a.out) + begin, w, std::min(kChunkBytes, a.bytes - begin));
}

// One look at a peer's chunk: true once all of it has arrived, its payload then in `w`.
template <DType D>
bool chunk_arrived(const uint32_t* src, size_t c, uint32_t call, uint32_t (&w)[4]) {
  if constexpr (format_of(D) == Format::kLamport) {
    for (int i = 0; i < 4; ++i)
      if ((w[i] = load_word(src + c * 4 + i)) == kEmpty) return false;
    return true;
  } else {
    for (int h = 0; h < int(kLinesPerChunk); ++h) {
      const uint32_t* line = src + chunk_line(c, h) * 4;
      for (int half = 0; half < 2; ++half) {
        const uint64_t v = __atomic_load_n(reinterpret_cast<const uint64_t*>(line + 2 * half), __ATOMIC_RELAXED);
        if (uint32_t(v >> 32) != call) return false;
        w[2 * h + half] = uint32_t(v);
      }
    }
    return true;
  }
}

template <DType D>
void sanitize(uint32_t (&w)[4]) {
  if constexpr (format_of(D) == Format::kLamport)
    for (uint32_t& x : w) x = sanitize_word(x, D);
}

// Waits until `arrived()` for `source`: 0, or the fault that ended the wait (a timeout names `source`).
template <class Arrived>
uint64_t wait_for(const AllReduceArgs& a, int source, InterruptCheck interrupted, Arrived arrived) {
  if (arrived()) return 0;  // the common case: no clock read
  Backoff backoff(a, interrupted);
  // A fault ends the wait only after one more look: a peer whose call differs writes its call word before it
  // aborts, and this rank should name that call rather than relay the peer's abort.
  for (uint64_t fault = 0;; fault = backoff.pause()) {
    if (arrived()) return 0;
    if (fault_kind(fault) == Fault::kPeerTimeout) return encode_fault(Fault::kPeerTimeout, 1u << source, 0);
    if (fault != 0) return fault;
  }
}

template <DType D, ReduceOp Op>
uint64_t pull_and_reduce(const AllReduceArgs& a, uint32_t epoch, size_t chunks, InterruptCheck interrupted,
                         size_t& done) {
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  done = 0;
  // Every peer's call word first: no output before each one says the peer makes this very call.
  for (int s = 0; s < a.world; ++s) {
    if (s == a.rank) continue;
    const uint32_t* word = call_word(a.local, buffer, s);
    uint32_t theirs = kEmpty;
    uint64_t fault = wait_for(a, s, interrupted, [&] { return (theirs = load_word(word)) != kEmpty; });
    if (fault == 0 && theirs != call) fault = encode_fault(Fault::kCallMismatch, s, flag_signature(theirs, epoch));
    if (fault != 0) {
      if (fault_kind(fault) != Fault::kPeerTimeout) return fault;
      uint32_t missing = 0;  // name every peer still missing, not only the first one we waited for
      for (int t = s; t < a.world; ++t)
        if (t != a.rank && load_word(call_word(a.local, buffer, t)) == kEmpty) missing |= 1u << t;
      return encode_fault(Fault::kPeerTimeout, missing, 0);
    }
  }
  // Then the data: whatever has arrived is this call's (layout.h).
  for (; done < chunks; ++done) {
    const size_t c = done;
    typename Chunk<D>::Acc acc[Chunk<D>::kElems];
    for (int s = 0; s < a.world; ++s) {
      uint32_t w[4];
      if (s == a.rank) {
        load_chunk(a, c, w);
        sanitize<D>(w);
      } else {
        const uint32_t* src = area(a.local, a.layout, buffer, a.rank, s);
        if (const uint64_t fault = wait_for(a, s, interrupted, [&] { return chunk_arrived<D>(src, c, call, w); }))
          return fault;
      }
      accumulate<D, Op>(acc, w, s == 0);
    }
    uint32_t w[4] = {0, 0, 0, 0};
    finish<D, Op>(acc, a.world, w);
    store_chunk(a, c, w);
  }
  return 0;
}

}  // namespace

uint64_t host_allreduce(const AllReduceArgs& a, uint32_t epoch, size_t reset_span, InterruptCheck interrupted) {
  const int buffer = buffer_of(epoch);
  const uint32_t call = make_flag(a.signature, epoch);
  const size_t chunks = (a.bytes + kChunkBytes - 1) / kChunkBytes;

  // The previous call's reset (step 2) must land before what a peer sends after seeing our data of this call:
  // release orders those earlier stores before the pushes below.
  std::atomic_thread_fence(std::memory_order_release);
  for (int p = 0; p < a.world; ++p)
    if (p != a.rank) store_word(call_word(a.peer[p], buffer, a.rank), call);
  dispatch_dtype_op(a.dtype, a.op, [&]<DType D, ReduceOp>() {
    for (size_t c = 0; c < chunks; ++c) {
      uint32_t w[4];
      load_chunk(a, c, w);
      sanitize<D>(w);
      for (int p = 0; p < a.world; ++p) {
        if (p == a.rank) continue;
        uint32_t* dst = area(a.peer[p], a.layout, buffer, p, a.rank);
        if constexpr (format_of(D) == Format::kLamport) {
          for (int i = 0; i < 4; ++i) store_word(dst + c * 4 + i, w[i]);
        } else {
          for (int h = 0; h < int(kLinesPerChunk); ++h) {
            uint32_t* line = dst + chunk_line(c, h) * 4;
            store_half(line, w[2 * h], call);
            store_half(line + 2, w[2 * h + 1], call);
          }
        }
      }
    }
  });

  const int previous = previous_buffer(epoch);
  for (int s = 0; s < a.world; ++s) {
    if (s == a.rank) continue;
    store_word(call_word(a.local, previous, s), kEmpty);
    uint32_t* stale = area(a.local, a.layout, previous, a.rank, s);
    for (size_t i = 0; i < reset_span / sizeof(uint32_t); ++i) store_word(stale + i, kEmpty);
  }

  uint64_t fault = 0;
  size_t done = 0;
  dispatch_dtype_op(a.dtype, a.op, [&]<DType D, ReduceOp Op>() {
    fault = pull_and_reduce<D, Op>(a, epoch, chunks, interrupted, done);
  });
  if (fault != 0) {
    const uint32_t p = poison_word(a.dtype);
    const uint32_t poison[4] = {p, p, p, p};
    for (size_t c = done; c < chunks; ++c) store_chunk(a, c, poison);
  }
  return fault;
}

}  // namespace rocenante
