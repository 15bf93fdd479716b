// One-shot all-reduce between processes of one host, on the CPU: the protocol of layout.h run by one thread.
//   1. push: write our input, as lines carrying this call's flag, into our source slot of every peer's region;
//   2. pull: for each chunk, wait for every peer's two lines, combine all inputs in rank order, write the
//      output, and zero the lines we read (so no stale flag survives into a later call).
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

// Each 8-byte half {data, flag} of a line is written and read as one atomic 64-bit access.
inline uint64_t* half_ptr(Line* line, int half) { return reinterpret_cast<uint64_t*>(line) + half; }
inline void store_half(Line* line, int half, uint32_t data, uint32_t flag) {
  __atomic_store_n(half_ptr(line, half), (uint64_t(flag) << 32) | data, __ATOMIC_RELAXED);
}
inline uint64_t load_half(Line* line, int half) { return __atomic_load_n(half_ptr(line, half), __ATOMIC_RELAXED); }

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

// Waits for both halves of one line from `source`. Returns 0 with the data in (lo, hi), or a fault word.
uint64_t receive_line(const AllReduceArgs& a, Line* line, int source, uint32_t flag, uint32_t epoch,
                      InterruptCheck interrupted, uint32_t& lo, uint32_t& hi) {
  uint64_t v[2];
  for (int h = 0; h < 2; ++h) {
    v[h] = load_half(line, h);
    if (uint32_t(v[h] >> 32) == flag) continue;  // the common case: arrived, no clock read
    Backoff backoff(a, interrupted);
    // A fault ends the wait only after one more read of the line: a peer whose call differs writes its lines
    // before it aborts, and this rank should name that call rather than relay the peer's abort.
    for (uint64_t fault = 0;; fault = backoff.pause(), v[h] = load_half(line, h)) {
      const uint32_t got = uint32_t(v[h] >> 32);
      if (got == flag) break;
      if (got != 0) return encode_fault(Fault::kCallMismatch, source, flag_signature(got, epoch));
      if (fault_kind(fault) == Fault::kPeerTimeout) return encode_fault(Fault::kPeerTimeout, 1u << source, 0);
      if (fault != 0) return fault;
    }
  }
  // The data travelled in the same atomic halves as the flags; the fence orders our later zeroing and reads
  // after these polls all the same.
  std::atomic_thread_fence(std::memory_order_acquire);
  lo = uint32_t(v[0]);
  hi = uint32_t(v[1]);
  return 0;
}

template <DType D, ReduceOp Op>
uint64_t pull_and_reduce(const AllReduceArgs& a, uint32_t epoch, uint32_t flag, size_t chunks,
                         InterruptCheck interrupted, size_t& done) {
  const int slot = epoch & 1;
  for (done = 0; done < chunks; ++done) {
    const size_t c = done;
    typename Chunk<D>::Acc acc[Chunk<D>::kElems];
    for (int s = 0; s < a.world; ++s) {
      uint32_t w[4];
      if (s == a.rank) {
        load_chunk(a, c, w);
      } else {
        Line* lines = a.local + a.layout.line_index(slot, s);
        for (int l = 0; l < int(kLinesPerChunk); ++l) {
          const uint64_t fault =
              receive_line(a, lines + chunk_line(c, l), s, flag, epoch, interrupted, w[2 * l], w[2 * l + 1]);
          if (fault != 0) {
            if (fault_kind(fault) != Fault::kPeerTimeout) return fault;
            // Name every peer still missing at this chunk, not only the first one we waited for.
            uint32_t missing = fault_detail(fault);
            for (int t = s + 1; t < a.world; ++t) {
              Line* other = a.local + a.layout.line_index(slot, t) + chunk_line(c, 0);
              if (t != a.rank && uint32_t(load_half(other, 0) >> 32) != flag) missing |= 1u << t;
            }
            return encode_fault(Fault::kPeerTimeout, missing, 0);
          }
        }
        for (int l = 0; l < int(kLinesPerChunk); ++l) {
          store_half(lines + chunk_line(c, l), 0, 0, 0);
          store_half(lines + chunk_line(c, l), 1, 0, 0);
        }
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

uint64_t host_allreduce(const AllReduceArgs& a, uint32_t epoch, InterruptCheck interrupted) {
  const int slot = epoch & 1;
  const uint32_t flag = make_flag(a.signature, epoch);
  const size_t chunks = (a.bytes + kChunkBytes - 1) / kChunkBytes;

  // Our zeroing of the previous call's lines must not be overtaken by what a peer sends after seeing the
  // lines we are about to push: release orders those earlier stores before the pushes below.
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t c = 0; c < chunks; ++c) {
    uint32_t w[4];
    load_chunk(a, c, w);
    for (int p = 0; p < a.world; ++p) {
      if (p == a.rank) continue;
      Line* lines = a.peer[p] + a.layout.line_index(slot, a.rank);
      for (int l = 0; l < int(kLinesPerChunk); ++l) {
        store_half(lines + chunk_line(c, l), 0, w[2 * l], flag);
        store_half(lines + chunk_line(c, l), 1, w[2 * l + 1], flag);
      }
    }
  }

  uint64_t fault = 0;
  size_t done = 0;
  dispatch_dtype_op(a.dtype, a.op, [&]<DType D, ReduceOp Op>() {
    fault = pull_and_reduce<D, Op>(a, epoch, flag, chunks, interrupted, done);
  });
  if (fault != 0) {
    const uint32_t p = poison_word(a.dtype);
    const uint32_t poison[4] = {p, p, p, p};
    for (size_t c = done; c < chunks; ++c) store_chunk(a, c, poison);
  }
  return fault;
}

}  // namespace rocenante
