// The proxy: one thread per communicator that drives a network wire (transport.h) for the reducer. A kernel
// cannot drive it (under CUDA-graph replay no host code runs per call), so the kernel and the proxy meet in a
// mailbox (layout.h, Mailbox); the host loop uses the same mailbox, so that one path serves CPU and GPU tensors
// and is tested with both.
//
// The thread polls, in a loop, under one mutex (post_abort() from other threads takes it too):
//   send:    when ring[e % 3] holds e, the next epoch to send: deliver to every peer this rank's call word of e
//            and what that peer reads of its area in the image (delivery_range(), layout.h), and signal(e) (with
//            Signal::kFlag, the flag that tells the peer's reducer); e + 1 may follow before e's writes have landed, up to kRoundsInFlight rounds
//            (transport.h; ibverbs.cc says why no stale write can follow), and delivered() until true reports
//            them all landed.
//   receive: p's delivery of e_p is seen, by its flag reading e_p (kFlag: the reducer reads the same flag, the
//            proxy only follows), or by arrived(p) (kCompletion: then arrived[e_p % 3][p][*] = e_p, release, for the
//            reducer, and consume(p)); e_p moves on to the next epoch (every call is delivered to every peer once,
//            so p's n-th delivery is its n-th call's).
//   liveness: every kProbeInterval while the reducer's current call waits for a peer's delivery, probe(p)
//            (transport.h), so that a peer whose host went down fails the wait within about kLivenessBudgetS.
//   idle:    for spin_s after its last work it polls hot (the CPU's pause instruction between polls), then it
//            sleeps kNap between polls, so a first call after a longer idle waits up to about kNap for each of its
//            two proxy steps (ring taken, arrival seen) on top of its usual time.
//   fault:   a wire failure is written into this rank's own abort word (the reducer's waits stop with it: the
//            host loop raises it, the kernel records it for the watchdog), and into every peer's; then the
//            thread stops. A connection that closed is no failure by itself (a peer closes after its last call):
//            it becomes one when this rank was rung for a call the closed peer has not delivered.
// The reducer's address space: the host's for the host loop; for a kernel the wire's region and image and the
// mailbox are pinned and mapped (MapHost, transport.h), and the thread keeps using the host addresses.
#include <sys/mman.h>
#include <sys/prctl.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "../cpu_relax.h"
#include "../errors.h"
#include "transport.h"

namespace rocenante {
namespace {

// After the hot polling (spin_s, transport.h), each poll is followed by a kNap sleep, with the thread's timer
// slack cut to 1 us so that the sleep ends close to kNap.
constexpr std::chrono::microseconds kNap{50};
// On close, the thread first finishes sending what the reducer rang: a rank whose reducer returned may not have
// delivered its own data yet (its peers' data is all it waits for), and its peers still need it. Bounded, so
// that closing beside a stopped peer does not hang: a live peer acknowledges within a round trip.
constexpr std::chrono::milliseconds kDrain{1000};
constexpr unsigned long kTimerSlackNs = 1000;
// How often a peer whose delivery the reducer waits for is probed (transport.h): a tenth of the budget, so that a
// host gone while this rank waits is seen within kLivenessBudgetS plus one interval.
constexpr std::chrono::milliseconds kProbeInterval{100};

class Proxy final : public Transport {
 public:
  Proxy(int rank, const RegionLayout& layout, uint32_t first_epoch, std::unique_ptr<Wire> wire, const MapHost& map_host,
        Timeline* timeline, double spin_s)
      : rank_(rank), layout_(layout), first_epoch_(first_epoch), wire_(std::move(wire)), timeline_(timeline),
        spin_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(spin_s))) {
    void* page = mmap(nullptr, sizeof(Mailbox), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) throw_system_error("mmap", __FILE__, __LINE__);
    mailbox_ = new (page) Mailbox{};
    for (uint64_t& r : mailbox_->ring) r = ring_word(0, kNoEpoch);
    for (auto& per_buffer : mailbox_->arrived)
      for (auto& per_source : per_buffer)
        for (uint32_t& e : per_source) e = kNoEpoch;
    try {
      region_ = wire_->local_region();
      image_ = wire_->peer_region(rank == 0 ? 1 : 0);
      mapped_mailbox_ = mailbox_;
      host_region_ = region_;  // before region_ becomes the reducer's
      flags_ = arrival_flags(region_);
      if (map_host) {
        void* address = nullptr;
        mappings_[0] = map_host(region_, layout_.region_bytes(), address);
        region_ = static_cast<uint32_t*>(address);
        mappings_[1] = map_host(image_, layout_.region_bytes(), address);
        image_ = static_cast<uint32_t*>(address);
        mappings_[2] = map_host(mailbox_, sizeof(Mailbox), address);
        mapped_mailbox_ = static_cast<Mailbox*>(address);
      }
      arrivals_ = wire_->signal_mode() == Signal::kCompletion ? &mapped_mailbox_->arrived[0][0][0] : arrival_flags(region_);
    } catch (...) {
      release();
      throw;
    }
  }

  ~Proxy() override { release(); }

  std::string local_handle() const override { return wire_->local_handle(); }
  void connect(const std::vector<std::string>& handles) override { wire_->connect(handles); }
  void all_connected() override {
    wire_->all_connected();
    thread_ = std::thread([this] { run(); });
  }
  uint32_t* local_region() const override { return region_; }
  uint32_t* peer_region(int) const override { return image_; }
  Mailbox* mailbox() const override { return mapped_mailbox_; }
  const uint32_t* arrivals() const override { return arrivals_; }

  void post_abort(int peer, uint64_t word) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    tell(peer, word);
  }

 private:
  void run() {
    prctl(PR_SET_TIMERSLACK, kTimerSlackNs);
    const int world = layout_.world;
    const bool completion = wire_->signal_mode() == Signal::kCompletion;
    uint32_t send = first_epoch_;  // the next epoch to send (the reducers count from the same first call)
    int posted = 0;                // rounds posted that delivered() has not yet reported landed
    uint32_t rung = kNoEpoch;  // the last epoch rung: the reducer's current call (kNoEpoch: none yet)
    uint32_t receive[kMaxRanks];  // per peer, the epoch of its next delivery
    uint32_t closed[kMaxRanks] = {};  // per peer: 0 while its connection is open, else when it closed (1: first)
    uint32_t closures = 0;
    for (uint32_t& e : receive) e = first_epoch_;
    auto last_work = std::chrono::steady_clock::now();
    auto last_probe = last_work;
    std::chrono::steady_clock::time_point drain_until{};
    while (true) {
      const auto now = std::chrono::steady_clock::now();  // one clock read per turn, for every decision below
      if (stop_.load(std::memory_order_relaxed)) {
        if (drain_until == std::chrono::steady_clock::time_point{}) drain_until = now + kDrain;
        const uint64_t ring = __atomic_load_n(&mailbox_->ring[buffer_of(send)], __ATOMIC_ACQUIRE);
        if ((posted == 0 && uint32_t(ring) != send) || now > drain_until) return;
      }
      bool worked = false;
      uint64_t fault = 0;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        const uint64_t ring = __atomic_load_n(&mailbox_->ring[buffer_of(send)], __ATOMIC_ACQUIRE);
        if (posted < kRoundsInFlight && uint32_t(ring) == send) {
          note(timeline_, send, kProxyTook);
          rung = send;
          const int buffer = buffer_of(send);
          for (int p = 0; p < world; ++p) {
            if (p == rank_ || closed[p]) continue;
            wire_->deliver(p, call_word_offset(buffer, rank_), sizeof(uint32_t));
            size_t begin = 0, end = 0;
            delivery_range(uint32_t(ring >> 32), p, rank_, begin, end);
            wire_->deliver(p, layout_.area_offset(buffer, p, rank_) + begin, end - begin);
          }
          wire_->signal(send);
          note(timeline_, send, kProxyRing);
          send = next_epoch(send);
          ++posted;
          worked = true;
        }
        if (posted > 0) {
          uint64_t failed = 0;
          const bool done = wire_->delivered(failed);
          if (failed != 0 && !closure(failed)) fault = failed;
          if (done || failed != 0) {
            for (uint32_t e = send; posted > 0; --posted) {
              e = previous_epoch(e);
              note(timeline_, e, kProxyDelivered);
            }
            worked = true;
          }
        }
        for (int p = 0; p < world && fault == 0; ++p) {
          if (p == rank_ || closed[p]) continue;
          uint64_t failed = 0;
          bool arrived = wire_->arrived(p, failed);  // kFlag: only a failure, read before the flag (transport.h)
          if (!completion)
            arrived = arrived_whole(flags_ + arrival_index(buffer_of(receive[p]), p), receive[p],
                                    [](const uint32_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); });
          if (arrived) {
            if (completion) {
              for (uint32_t& word : mailbox_->arrived[buffer_of(receive[p])][p])
                __atomic_store_n(&word, receive[p], __ATOMIC_RELEASE);
              wire_->consume(p);
            }
            note(timeline_, receive[p], kProxyArrival);
            receive[p] = next_epoch(receive[p]);
            worked = true;
          } else if (failed != 0 && !closed_connection(failed, closed, closures)) {
            fault = failed;
          }
        }
        if (fault == 0 && rung != kNoEpoch && now - last_probe >= kProbeInterval) {
          last_probe = now;
          for (int p = 0; p < world && fault == 0; ++p) {
            if (p == rank_ || closed[p] || receive[p] != rung) continue;
            uint64_t failed = 0;
            wire_->probe(p, failed);
            if (failed != 0 && !closure(failed)) fault = failed;
          }
        }
        // A closed peer fails this rank only once this rank is in a call that peer has not delivered, unless its
        // goodbye says it never made that call: the reducer's wait names it then (abort_seen()). Of several, one
        // that closed without an abort word is named, and of those the first closed: a peer that closed on a fault
        // of its own (perhaps caused by another's end) sent its abort word first, over the same connection, and that
        // word names the cause; naming the peer would blame a rank that was alive. Closures seen in one turn are
        // ordered by rank, not time, which is why the abort words decide first.
        if (fault == 0 && rung != kNoEpoch) {
          int named = -1;
          bool named_aborted = false;
          for (int p = 0; p < world; ++p) {
            if (closed[p] == 0 || receive[p] != rung) continue;
            const uint64_t said = word_of(p);
            if (fault_kind(said) == Fault::kGoodbye && !epoch_at_or_before(rung, fault_value(said))) continue;
            const bool aborted = said != 0 && fault_kind(said) != Fault::kGoodbye;
            if (named < 0 || named_aborted > aborted || (named_aborted == aborted && closed[p] < closed[named]))
              named = p, named_aborted = aborted;
          }
          if (named >= 0) fault = encode_fault(Fault::kTransport, uint32_t(named), kConnectionClosed);
        }
        if (fault != 0) {
          tell(rank_, fault);
          for (int p = 0; p < world; ++p)
            if (p != rank_ && !closed[p]) tell(p, abort_from(fault, send, rank_));
          return;
        }
      }
      if (worked) {
        last_work = now;
      } else if (now - last_work < spin_) {
        cpu_relax();
      } else {
        std::this_thread::sleep_for(kNap);
      }
    }
  }

  // Under mutex_: a peer's abort slot is written once, with this rank's first word for it, so that no reader
  // assembles a word out of two writes (layout.h, Abort words); our own slot is host memory, stored whole.
  void tell(int peer, uint64_t word) noexcept {
    if (peer != rank_ && told_[peer]) return;
    told_[peer] = true;
    wire_->post_abort(peer, word);
  }

  // The word in peer p's abort slot of our region, once whole (layout.h, Abort words); else 0.
  uint64_t word_of(int p) const {
    return whole_abort_word(host_region_, p, [](uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); });
  }

  // Whether `fault` is a connection that closed: no failure by itself (run()).
  static bool closure(uint64_t fault) {
    return fault_kind(fault) == Fault::kTransport && fault_value(fault) == kConnectionClosed;
  }
  // A closure that arrived() reported (the receiving side: after everything the peer sent before it was placed,
  // its abort word included, transport.h; a send may see the close first) is recorded in `closed`, in the order
  // seen. True if `fault` was one.
  static bool closed_connection(uint64_t fault, uint32_t (&closed)[kMaxRanks], uint32_t& closures) {
    if (!closure(fault)) return false;
    uint32_t& order = closed[fault_detail(fault) % kMaxRanks];
    if (order == 0) order = ++closures;
    return true;
  }

  void release() noexcept {
    if (thread_.joinable()) {
      stop_.store(true);
      thread_.join();
    }
    for (auto& m : mappings_) m.reset();  // before the memory they map goes
    wire_.reset();
    if (mailbox_ != nullptr) munmap(mailbox_, sizeof(Mailbox));
    mailbox_ = nullptr;
  }

  int rank_;
  RegionLayout layout_;
  uint32_t first_epoch_;
  std::unique_ptr<Wire> wire_;
  Timeline* timeline_;  // timeline builds only
  const std::chrono::steady_clock::duration spin_;  // hot polling after the last work
  Mailbox* mailbox_ = nullptr;         // host address, the thread's
  Mailbox* mapped_mailbox_ = nullptr;  // the reducer's
  uint32_t* region_ = nullptr;         // the reducer's addresses of the wire's region and image
  uint32_t* image_ = nullptr;
  uint32_t* host_region_ = nullptr;      // the region, host address, the thread's
  const uint32_t* flags_ = nullptr;     // its arrival flags
  const uint32_t* arrivals_ = nullptr;  // the arrival words the reducer waits for, its address
  std::shared_ptr<void> mappings_[3];  // a kernel's mappings of region, image and mailbox
  std::mutex mutex_;
  bool told_[kMaxRanks] = {};  // peers whose abort slot was written (tell())
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Transport> make_proxy(int rank, const RegionLayout& layout, uint32_t first_epoch,
                                      std::unique_ptr<Wire> wire, const MapHost& map_host, Timeline* timeline,
                                      double spin_s) {
  return std::make_unique<Proxy>(rank, layout, first_epoch, std::move(wire), map_host, timeline, spin_s);
}

std::string transport_status(uint32_t status) {
  switch (status) {
    case kBadSignal: return "a delivery signal arrived out of sequence, or a malformed message (TCP wire)";
    case kConnectionClosed: return "the connection closed (the peer's process ended or it closed the communicator)";
    case kUnacknowledged:
      return "the peer's host acknowledged nothing for " + std::to_string(int(kLivenessBudgetS * 1000)) +
             " ms (it or the link to it is down)";
    default: return verbs_status(status);
  }
}

}  // namespace rocenante
