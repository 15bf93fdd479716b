// The TCP software wire (ROCENANTE_NET=tcp): a test vehicle that carries every peer's deliveries over TCP on
// loopback, as if each peer were on another host, so that the network path (proxy, mailbox, wire) runs on any
// machine. Never chosen silently.
//
// Memory: a WireBlock (transport.h): the receive region, then the image, which is peer_region(p) for every p.
//
// Connections: one TCP connection per ordered pair of ranks. Rank s's outgoing connection to r carries, in
// order, s's messages for r (a Header, then its payload); r's receiver thread for s reads them one at a time
// and answers each signal with an ack on the same connection:
//   write   bytes [offset, offset + bytes) of s's image, for the same offset of r's region: read whole and
//           kept until the round's signal;
//   signal  seq = s's count of signals to r before this one; r checks it, places the round's writes, acks.
//           With Signal::kFlag it carries the flag (4 bytes for flag[b][s], transport.h), which r stores into
//           every rail's word of flag[b][s] (a TCP connection is one rail) after placing the round, as one RC
//           queue pair would place a write posted after the data (with kFlagFirst, a test's mutation, before);
//   abort   the 16-byte abort slot {word, check} for abort[s] of r's region (layout.h, Abort words), placed as
//           four 4-byte quarters in random order with a pause between them, so that a reader which decoded a
//           word before its slot is whole meets torn ones;
//   probe   nothing: r's TCP stack acknowledges it, as any segment (probe(), transport.h).
// Invariants, for one sender s and one receiver r:
//   1. An ack means: this signal and every write s queued for r before it were placed. TCP delivers a
//      connection's bytes once each and in order, and r's one thread for s places a round's writes when it
//      reads the round's signal, before it reads the next message; it sends the ack only after that.
//      delivered() returns true only once every signal was acked. Rounds queued before earlier ones were acked
//      (transport.h, kRoundsInFlight) are placed after them, each before its signal is seen (2), and TCP hands
//      the application no duplicate: nothing of a round lands after r saw its signal, the stale-write argument
//      ibverbs.cc makes for RDMA, more simply.
//   2. kCompletion: arrived(s) counts a signal only after its ack was written, so everything before it was
//      placed; kFlag: the flag is stored (release) after everything before it was placed. A round is placed in
//      random order: all its writes (call word and area alike) cut into segments of 1 word to a page, shuffled
//      together, then stored 16 bits at a time in two passes, one half of each word (chosen at random) in the
//      first and the other in the second, with yields in between. A reducer reads s's words only once the
//      arrival word says the delivery arrived whole (layout.h, Mailbox); one that does not, or a format relying
//      on placement order or on word atomicity, fails its tests here.
//   3. Every header is hostile input: a write must lie inside the region past the abort words and flags,
//      4-byte aligned; an abort must name s's own abort word; a signal must carry the next seq, and a flag
//      exactly when the signal is kFlag, in one of s's own three flag words. Anything else ends s's
//      connection as kBadSignal, and so do writes adding up to more than a region in one round; nothing is ever
//      placed out of bounds. A connection that breaks in the middle of a round places nothing of it.
//   4. Abort slots travel without a signal (their readers check each slot whole, layout.h), ahead of queued
//      messages not yet started.
//   5. A connection joins only with the hello {magic, its sender's rank, the receiver's nonce}: the nonce is
//      64 random bits published only through this communicator's store, so a stray process or a connection
//      meant for an earlier communicator is refused.
// Threads: the proxy serialises every call below (post_abort included); only the receiver threads run beside
// it, and they touch only the region (atomic stores), the arrival counts (release) and the closed states.
// Sends never block the proxy: a stopped peer fills its socket and stops acking, and the reducer's timeout
// names it; a dead one resets its connections, which comes back as kConnectionClosed naming it. A peer host that
// goes silent (down, unplugged) leaves what was sent to it unacknowledged: TCP_USER_TIMEOUT (kLivenessBudgetS) ends
// the connection, which comes back as kUnacknowledged; the proxy's probes make sure something is in flight while
// this rank waits for that peer. Unlike a NIC, a stopped peer's TCP stack stops taking data once its socket is
// full, and Linux applies TCP_USER_TIMEOUT to a zero window too: a stopped peer that was sent more than its
// sockets hold fails as kUnacknowledged, not at the timeout. A test vehicle's difference; over RDMA the NIC takes
// every write whatever the process does.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <random>
#include <thread>

#include "../errors.h"
#include "transport.h"

namespace rocenante {
namespace {

using Clock = std::chrono::steady_clock;

// Every rank connects right after it read every handle from the store (communicator.py), so peers meet within
// the store's skew; 30 s also covers a loaded CI machine.
constexpr double kConnectWaitS = 30.0;
// post_abort's longest wait for the socket to take an abort word: the peers of a faulted rank are usually
// told at once; one that cannot be (stopped, its socket full) times out instead.
constexpr double kAbortPushS = 0.1;
// Placement segments are 1 word to a page (4 KiB) long, log-uniformly (up to 2^k words, k uniform in
// 0..kMaxSegmentLog2), so that even a small delivery is cut between adjacent words, and large ones move whole
// pages too.
constexpr unsigned kMaxSegmentLog2 = 10;
// Yields of the receiver thread while it places one round, evenly spaced, so that a reader polling the region
// meets rounds half placed; a few per round, not one every few segments, which made 4 MiB rounds 100x slower
// beside spinning threads on 2 cores. Measured with the host loop reading a peer's words without waiting for
// its arrival word, the every-dtype and back-to-back tests over this wire (then in tests/test_cpu_net.py)
// failed 8 times in 3 runs of the 3 (int32 sums came out wrong), and 0 times in 2 runs without yields.
constexpr size_t kYieldsPerRound = 3;
// Signal::kFlagFirst (a test's mutation): the receiver thread sleeps this long after the flag and between its two
// placement passes, as a flag that overtook its data on a real fabric leaves the reader time to act on it, so
// that a reader which trusts the flag meets torn words in every run, not only when the scheduler lets it.
constexpr std::chrono::microseconds kFlagFirstPause{500};
// Between the quarters of an abort slot (rare: once per faulted peer), long enough for the waits' clock reads,
// which poll the abort words, to meet the slot torn.
constexpr std::chrono::milliseconds kAbortQuarterPause{2};
// Messages gathered into one sendmsg() (two iovecs each: header and payload): a round's writes to a peer and its
// signal go in one (its call word, its area, the signal), as ibverbs.cc posts them as one chained list.
constexpr int kBatch = 16;

// Published through the store; fixed size, no implicit padding: it travels as raw bytes.
struct TcpHandle {
  uint32_t magic;
  uint32_t world;
  uint64_t region_bytes;
  uint64_t nonce;  // random; a peer's hello must carry it back
  uint32_t port;   // of the listening socket on 127.0.0.1
  uint32_t rank;   // the publisher's
};
static_assert(sizeof(TcpHandle) == 32, "TcpHandle travels as raw bytes: no implicit padding");

// The first bytes on every connection, from the connecting rank.
struct Hello {
  uint32_t magic;
  uint32_t rank;   // the sender's
  uint64_t nonce;  // the receiver's, from its handle
};
static_assert(sizeof(Hello) == 16, "Hello travels as raw bytes: no implicit padding");

enum Kind : uint32_t { kWrite = 1, kSignal = 2, kAbort = 3, kProbe = 4 };
struct Header {
  uint32_t kind;
  uint32_t seq;  // signals: the sender's count of earlier signals to this receiver; otherwise 0
  uint64_t offset;
  uint64_t bytes;  // of payload following the header
};
static_assert(sizeof(Header) == 24, "Header travels as raw bytes: no implicit padding");
using Ack = uint32_t;  // the seq of the signal it acknowledges

// Words [src, src + count) of a round's payloads, placed at word dst of the region.
struct Segment {
  size_t dst;
  size_t src;
  size_t count;
};

// A message waiting in a send queue. Payload: image[offset, offset + bytes) for a write, `words` for an abort
// (its slot, 16 bytes) or a signal's flag (the low 4 bytes of words[0], little-endian as every rank of one host).
struct Outgoing {
  Header header;
  uint64_t words[2];
  size_t sent;  // bytes of header + payload already taken by the socket
};

// False at `deadline` (or on a poll error other than EINTR); true once `fd` is ready for `events`.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left < 0) return false;
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, int(std::min<long long>(left + 1, 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// False once the connection ended (EOF, reset, shutdown) before `bytes` arrived, or `deadline` (if any) passed;
// errno then says why (0 at EOF).
bool read_all(int fd, void* dst, size_t bytes, const Clock::time_point* deadline = nullptr) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    if (deadline != nullptr && !wait_fd(fd, POLLIN, *deadline)) return false;
    const ssize_t n = recv(fd, p, bytes, deadline != nullptr ? MSG_DONTWAIT : 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n == 0) errno = 0;
    if (n <= 0) return false;
    p += n;
    bytes -= size_t(n);
  }
  return true;
}

bool write_all(int fd, const void* src, size_t bytes) {
  const char* p = static_cast<const char*>(src);
  while (bytes > 0) {
    const ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= size_t(n);
  }
  return true;
}

// Both ends of every connection: small messages (signals, acks, call words) leave at once, and data the peer's
// host leaves unacknowledged for kLivenessBudgetS ends the connection (ETIMEDOUT).
void set_options(int fd) {
  const int one = 1;
  ROCENANTE_CHECK_SYS(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)));
  const unsigned budget_ms = unsigned(kLivenessBudgetS * 1000);
  ROCENANTE_CHECK_SYS(setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &budget_ms, sizeof(budget_ms)));
}

// Why a connection that failed a send or receive is over.
uint32_t broken_status(int error) { return error == ETIMEDOUT ? kUnacknowledged : kConnectionClosed; }

sockaddr_in loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

struct Peer {
  int out = -1;  // our connection to the peer: our messages, its acks
  int in = -1;   // its connection to us: its messages, our acks
  // Sender side (the proxy's calls only).
  std::deque<Outgoing> queue;
  bool pending = false;      // delivered to since the last signal()
  uint32_t signals = 0;      // signals queued
  uint32_t acked = 0;        // acks received
  uint32_t out_status = 0;   // 0, or why `out` is unusable (kConnectionClosed, kBadSignal): sticky
  bool lost = false;         // something posted to the peer never landed, not yet reported by delivered()
  char acks[sizeof(Ack) * 16];
  size_t ack_bytes = 0;      // of a partly received ack at the start of `acks`
  // Receiver side: written by the receiver thread, read by the proxy.
  std::thread receiver;
  std::atomic<uint32_t> arrivals{0};   // kCompletion: signals placed and acked (release: after their writes)
  std::atomic<uint32_t> in_status{0};  // 0, or why `in` ended, stored after everything before it was placed
  uint32_t consumed = 0;               // the proxy's: arrivals consume() took
};

class TcpWire final : public Wire {
 public:
  TcpWire(int rank, const RegionLayout& layout, Signal signal)
      : Wire(signal), rank_(rank), world_(layout.world), bytes_(layout.region_bytes()), peers_(layout.world) {
    if (signal != Signal::kFlag && signal != Signal::kCompletion && signal != Signal::kFlagFirst)
      ROCENANTE_THROW(InvalidArgument, "unknown signal mode " + std::to_string(uint32_t(signal)));
    block_ = std::make_unique<WireBlock>(bytes_, 0);
    try {
      std::random_device rd;
      nonce_ = (uint64_t(rd()) << 32) | rd();
      listen_ = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      ROCENANTE_CHECK_SYS(listen_);
      const sockaddr_in a = loopback(0);  // port 0: the kernel picks a free one
      ROCENANTE_CHECK_SYS(bind(listen_, reinterpret_cast<const sockaddr*>(&a), sizeof(a)));
      ROCENANTE_CHECK_SYS(listen(listen_, kMaxRanks));
      sockaddr_in bound{};
      socklen_t len = sizeof(bound);
      ROCENANTE_CHECK_SYS(getsockname(listen_, reinterpret_cast<sockaddr*>(&bound), &len));
      port_ = ntohs(bound.sin_port);
    } catch (...) {
      release();
      throw;
    }
  }

  ~TcpWire() override { release(); }

  std::string local_handle() const override {
    const TcpHandle h{kTcpHandleMagic, uint32_t(world_), bytes_, nonce_, port_, uint32_t(rank_)};
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  void connect(const std::vector<std::string>& handles) override {
    if (int(handles.size()) != world_)
      ROCENANTE_THROW(InvalidArgument, "rank " + std::to_string(rank_) + ": expected " + std::to_string(world_) +
                                           " TCP wire handles, got " + std::to_string(handles.size()));
    std::vector<TcpHandle> theirs(world_);
    for (int p = 0; p < world_; ++p)
      if (p != rank_) theirs[p] = parse(p, handles[p]);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(kConnectWaitS));
    try {
      for (int p = 0; p < world_; ++p)
        if (p != rank_) dial(p, theirs[p], deadline);
      accept_all(deadline);
      for (int p = 0; p < world_; ++p)
        if (p != rank_) peers_[p].receiver = std::thread(&TcpWire::receive, this, p);
    } catch (...) {
      disconnect();  // nothing half connected stays behind (the caller may try again)
      throw;
    }
  }

  void all_connected() override {
    if (listen_ >= 0) close(listen_);
    listen_ = -1;
  }

  uint32_t* local_region() const override { return block_->region(); }
  uint32_t* peer_region(int) const override { return block_->image(); }

  void deliver(int peer, size_t offset, size_t bytes) override {
    Peer& q = peers_[peer];
    q.pending = true;
    if (q.out_status != 0) q.lost = true;
    if (bytes == 0 || q.out_status != 0) return;
    q.queue.push_back(Outgoing{Header{kWrite, 0, offset, bytes}, {0, 0}, 0});  // signal() hands it to the socket
  }

  void signal(uint32_t epoch) override {
    const bool flag = signal_ != Signal::kCompletion;
    const Header h{kSignal, 0, flag ? arrival_flag_offset(buffer_of(epoch), rank_) : 0, flag ? sizeof(epoch) : 0};
    for (Peer& q : peers_) {
      if (!q.pending) continue;
      q.pending = false;
      if (q.out_status != 0) continue;
      q.queue.push_back(Outgoing{h, {epoch, 0}, 0});
      q.queue.back().header.seq = q.signals++;
      push(q);
    }
  }

  // True once every live peer acked everything, or with a failure: a broken connection is reported once, for
  // what was posted to it and lost (a peer that closes after its last call is no failure by itself: proxy.cc),
  // a malformed ack before a closed connection.
  bool delivered(uint64_t& fault) override {
    bool done = true;
    int failed = -1;
    for (int p = 0; p < world_; ++p) {
      Peer& q = peers_[p];
      if (q.out < 0) continue;
      push(q);
      read_acks(q);
      if (q.out_status == 0) {
        done = done && q.queue.empty() && q.acked == q.signals;
      } else if (q.lost && (failed < 0 || peers_[failed].out_status == kConnectionClosed)) {
        failed = p;
      }
    }
    if (failed < 0) return done;
    peers_[failed].lost = false;
    fault = encode_fault(Fault::kTransport, uint32_t(failed), peers_[failed].out_status);
    return true;
  }

  bool arrived(int peer, uint64_t& fault) override {
    Peer& q = peers_[peer];
    // The state first: it is stored after every arrival before it, so none of those is missed below.
    const uint32_t status = q.in_status.load(std::memory_order_acquire);
    if (q.arrivals.load(std::memory_order_acquire) != q.consumed) return true;
    if (status != 0) fault = encode_fault(Fault::kTransport, uint32_t(peer), status);
    return false;
  }

  void consume(int peer) override { ++peers_[peer].consumed; }

  // A message still queued is as good as a probe: what the socket cannot take yet, it holds unacknowledged.
  void probe(int peer, uint64_t& fault) override {
    Peer& q = peers_[peer];
    if (q.out < 0) return;
    if (q.out_status == 0 && q.queue.empty()) q.queue.push_back(Outgoing{Header{kProbe, 0, 0, 0}, {0, 0}, 0});
    push(q);
    read_acks(q);
    if (q.out_status != 0) fault = encode_fault(Fault::kTransport, uint32_t(peer), q.out_status);
  }

  void post_abort(int peer, uint64_t word) noexcept override {
    if (peer == rank_) {
      store_abort(local_region(), rank_, word);
      return;
    }
    Peer& q = peers_[peer];
    if (q.out < 0 || q.out_status != 0) return;  // never connected, or gone: it times out instead
    try {
      // Ahead of every message the socket has not started taking (a message is never interleaved).
      auto at = q.queue.begin();
      if (at != q.queue.end() && at->sent > 0) ++at;
      q.queue.insert(at, Outgoing{Header{kAbort, 0, uint64_t(rank_) * kAbortSlotBytes, kAbortSlotBytes}, {word, ~word}, 0});
    } catch (...) {
      return;
    }
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(kAbortPushS));
    const auto aborts_queued = [&q] {
      return std::any_of(q.queue.begin(), q.queue.end(), [](const Outgoing& m) { return m.header.kind == kAbort; });
    };
    for (;;) {
      push(q);
      if (q.out_status != 0 || !aborts_queued() || !wait_fd(q.out, POLLOUT, deadline)) return;
    }
  }

 private:
  std::string who(int p) const { return "rank " + std::to_string(rank_) + ": rank " + std::to_string(p); }

  TcpHandle parse(int p, const std::string& h) const {
    TcpHandle t{};
    if (h.size() != sizeof(TcpHandle))
      ROCENANTE_THROW(Error, who(p) + " published a TCP wire handle of " + std::to_string(h.size()) +
                                 " bytes, expected " + std::to_string(sizeof(TcpHandle)) +
                                 " (is every rank on the TCP wire? ROCENANTE_NET must agree)");
    std::memcpy(&t, h.data(), sizeof(t));
    if (t.magic != kTcpHandleMagic)
      ROCENANTE_THROW(Error, who(p) + " published a handle that is not a TCP wire's (is every rank on the TCP "
                                      "wire? ROCENANTE_NET must agree)");
    if (t.world != uint32_t(world_) || t.region_bytes != bytes_ || t.rank != uint32_t(p))
      ROCENANTE_THROW(Error, who(p) + " published a TCP wire handle for rank " + std::to_string(t.rank) +
                                 " of world " + std::to_string(t.world) + " with a region of " +
                                 std::to_string(t.region_bytes) + " bytes; this rank expects rank " +
                                 std::to_string(p) + " of world " + std::to_string(world_) + " with " +
                                 std::to_string(bytes_) + " bytes (configurations differ)");
    if (t.port == 0 || t.port > 65535)
      ROCENANTE_THROW(Error, who(p) + " published a TCP wire handle with port " + std::to_string(t.port) +
                                 ", not a listening port");
    return t;
  }

  // Opens our connection to p and says hello.
  void dial(int p, const TcpHandle& h, Clock::time_point deadline) {
    const std::string where = who(p) + " at 127.0.0.1:" + std::to_string(h.port);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ROCENANTE_CHECK_SYS(fd);
    peers_[p].out = fd;  // from here on disconnect() closes it
    set_options(fd);
    const sockaddr_in a = loopback(uint16_t(h.port));
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
      if (errno != EINPROGRESS)
        ROCENANTE_THROW(Error, "cannot connect to " + where + ": " + std::strerror(errno));
      if (!wait_fd(fd, POLLOUT, deadline))
        ROCENANTE_THROW(Error, "cannot connect to " + where + " within " + std::to_string(int(kConnectWaitS)) + " s");
      int err = 0;
      socklen_t len = sizeof(err);
      ROCENANTE_CHECK_SYS(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len));
      if (err != 0) ROCENANTE_THROW(Error, "cannot connect to " + where + ": " + std::strerror(err));
    }
    const Hello hello{kTcpHelloMagic, uint32_t(rank_), h.nonce};
    // A fresh connection's send buffer takes these 16 bytes at once.
    if (send(fd, &hello, sizeof(hello), MSG_DONTWAIT | MSG_NOSIGNAL) != ssize_t(sizeof(hello)))
      ROCENANTE_THROW(Error, "cannot greet " + where + ": " + std::strerror(errno));
  }

  // Accepts one connection from every peer, each with a valid hello, before `deadline`.
  void accept_all(Clock::time_point deadline) {
    for (int missing = world_ - 1; missing > 0;) {
      if (!wait_fd(listen_, POLLIN, deadline)) ROCENANTE_THROW(Error, not_connected());
      const int fd = accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) continue;
        throw_system_error("accept4", __FILE__, __LINE__);
      }
      Hello hello{};
      if (!read_all(fd, &hello, sizeof(hello), &deadline)) {
        close(fd);
        ROCENANTE_THROW(Error, not_connected() + " (a connection came but said no hello)");
      }
      const int from = int(hello.rank);
      std::string bad;
      if (hello.magic != kTcpHelloMagic) bad = "is not from rocenante's TCP wire";
      else if (hello.rank >= uint32_t(world_) || from == rank_) bad = "claims rank " + std::to_string(hello.rank);
      else if (peers_[from].in >= 0) bad = "claims rank " + std::to_string(from) + ", which is connected already";
      else if (hello.nonce != nonce_) bad = "from rank " + std::to_string(from) + " carries another nonce (a peer "
                                            "of another communicator?)";
      if (!bad.empty()) {
        close(fd);
        ROCENANTE_THROW(Error, "rank " + std::to_string(rank_) + ": a connection to its TCP wire " + bad + ": refused");
      }
      peers_[from].in = fd;  // blocking (accept4 does not inherit O_NONBLOCK): the receiver thread's
      set_options(fd);
      --missing;
    }
  }

  std::string not_connected() const {
    std::string ranks;
    for (int p = 0; p < world_; ++p)
      if (p != rank_ && peers_[p].in < 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
    return "rank " + std::to_string(rank_) + ": rank(s) " + ranks + " did not connect to its TCP wire within " +
           std::to_string(int(kConnectWaitS)) + " s";
  }

  // Hands the socket as much of p's queue as it takes without blocking.
  void push(Peer& q) {
    while (q.out_status == 0 && !q.queue.empty()) {
      iovec iov[2 * kBatch];
      int n = 0;
      for (auto it = q.queue.begin(); it != q.queue.end() && n + 2 <= 2 * kBatch; ++it) {  // room for both iovecs
        const size_t sent = it->sent;
        if (sent < sizeof(Header))
          iov[n++] = {reinterpret_cast<char*>(&it->header) + sent, sizeof(Header) - sent};
        const size_t from = sent > sizeof(Header) ? sent - sizeof(Header) : 0;
        if (it->header.bytes > from) iov[n++] = {payload(*it) + from, it->header.bytes - from};
      }
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = size_t(n);
      const ssize_t sent = sendmsg(q.out, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) broken(q, broken_status(errno));
        return;
      }
      for (size_t left = size_t(sent); left > 0;) {
        Outgoing& m = q.queue.front();
        const size_t rest = sizeof(Header) + m.header.bytes - m.sent;
        if (left < rest) {
          m.sent += left;
          break;
        }
        left -= rest;
        q.queue.pop_front();
      }
    }
  }

  char* payload(Outgoing& m) const {
    return m.header.kind == kWrite ? reinterpret_cast<char*>(block_->image()) + m.header.offset
                                   : reinterpret_cast<char*>(m.words);
  }

  // Takes the acks that have come, without blocking; each must acknowledge the next signal sent.
  void read_acks(Peer& q) {
    while (q.out_status == 0) {
      const ssize_t n = recv(q.out, q.acks + q.ack_bytes, sizeof(q.acks) - q.ack_bytes, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) return broken(q, n < 0 ? broken_status(errno) : kConnectionClosed);
      q.ack_bytes += size_t(n);
      size_t at = 0;
      for (; q.ack_bytes - at >= sizeof(Ack); at += sizeof(Ack)) {
        Ack ack;
        std::memcpy(&ack, q.acks + at, sizeof(ack));
        if (ack != q.acked || q.acked == q.signals) return broken(q, kBadSignal);
        ++q.acked;
      }
      q.ack_bytes -= at;
      std::memmove(q.acks, q.acks + at, q.ack_bytes);
    }
  }

  static void broken(Peer& q, uint32_t status) {
    q.out_status = status;
    q.lost = status != kConnectionClosed || !q.queue.empty() || q.acked != q.signals;
    q.queue.clear();
  }

  // The receiver thread for peer p: places p's messages in order until its connection ends (invariants 1-3).
  void receive(int p) {
    Peer& q = peers_[p];
    uint32_t status = kConnectionClosed;
    try {
      std::vector<uint32_t> words;     // the payloads of this round's writes, back to back
      std::vector<Segment> segments;   // the round's writes, cut
      std::mt19937_64 rng(std::random_device{}());
      uint32_t expected = 0;  // seq of the next signal
      for (Header h; read_all(q.in, &h, sizeof(h));) {
        // A round never writes more than a region: more is hostile, and would grow `words` without bound.
        if (!valid(p, h, expected) || (h.kind == kWrite && h.bytes / sizeof(uint32_t) > bytes_ / 4 - words.size())) {
          status = kBadSignal;
          shutdown(q.in, SHUT_RDWR);  // the sender learns at once that this connection is over
          break;
        }
        if (h.kind == kWrite) {
          const size_t first = words.size(), count = h.bytes / sizeof(uint32_t);
          words.resize(first + count);
          if (!read_all(q.in, words.data() + first, h.bytes)) break;
          for (size_t at = 0; at < count;) {
            const size_t longest = size_t(1) << (rng() % (kMaxSegmentLog2 + 1));
            const size_t len = std::min(count - at, size_t(1 + rng() % longest));
            segments.push_back({h.offset / sizeof(uint32_t) + at, first + at, len});
            at += len;
          }
        } else if (h.kind == kSignal) {
          uint32_t flag = 0;
          if (h.bytes != 0 && !read_all(q.in, &flag, sizeof(flag))) break;
          uint32_t* const flag_words = local_region() + h.offset / sizeof(uint32_t);
          const auto store_flag = [&] {
            for (int k = 0; k < kMaxRails; ++k) __atomic_store_n(flag_words + k, flag, __ATOMIC_RELEASE);
          };
          if (signal_ == Signal::kFlagFirst) {
            store_flag();
            std::this_thread::sleep_for(kFlagFirstPause);
          }
          place(words, segments, rng);
          if (signal_ == Signal::kFlag) store_flag();
          ++expected;
          const Ack ack = h.seq;
          const bool acked = write_all(q.in, &ack, sizeof(ack));
          if (signal_ == Signal::kCompletion)
            q.arrivals.store(expected, std::memory_order_release);  // after the writes' stores, and the ack
          if (!acked) break;
        } else if (h.kind == kAbort) {
          uint32_t quarters[kAbortSlotBytes / sizeof(uint32_t)];
          if (!read_all(q.in, quarters, sizeof(quarters))) break;
          int order[] = {0, 1, 2, 3};
          std::shuffle(std::begin(order), std::end(order), rng);
          uint32_t* slot = reinterpret_cast<uint32_t*>(abort_word(local_region(), p));
          for (const int i : order) {
            __atomic_store_n(slot + i, quarters[i], __ATOMIC_RELEASE);
            std::this_thread::sleep_for(kAbortQuarterPause);
          }
        }
      }
      if (status == kConnectionClosed) status = broken_status(errno);  // why the last read or ack failed
    } catch (const std::bad_alloc&) {  // a round's buffer: the connection cannot go on
      shutdown(q.in, SHUT_RDWR);
    }
    q.in_status.store(status, std::memory_order_release);
  }

  // Places a round's writes (invariant 2): in two passes over every segment of every write, each in its own
  // random order, the first storing one 16-bit half of each word (which one, at random), the second the other,
  // so that between the passes every word of the round is torn; yielding a few times in each pass so that a
  // reader that does not wait for the signal meets the round half placed.
  void place(std::vector<uint32_t>& words, std::vector<Segment>& segments, std::mt19937_64& rng) const {
    uint16_t* region = reinterpret_cast<uint16_t*>(local_region());  // little-endian: half 0 is the low one
    const uint64_t salt = rng();
    const size_t stride = segments.size() / (kYieldsPerRound + 1) + 1;
    for (int pass = 0; pass < 2; ++pass) {
      std::shuffle(segments.begin(), segments.end(), rng);
      if (pass == 1 && signal_ == Signal::kFlagFirst) std::this_thread::sleep_for(kFlagFirstPause);
      for (size_t n = 0; n < segments.size(); ++n) {
        const Segment& g = segments[n];
        for (size_t i = 0; i < g.count; ++i) {
          const int half = int(((g.dst + i) * 0x9E3779B97F4A7C15ull + salt) >> 63) ^ pass;
          __atomic_store_n(region + 2 * (g.dst + i) + half, uint16_t(words[g.src + i] >> (16 * half)), __ATOMIC_RELAXED);
        }
        if ((n + 1) % stride == 0 && n + 1 < segments.size()) std::this_thread::yield();
      }
    }
    words.clear();
    segments.clear();
  }

  bool valid(int p, const Header& h, uint32_t expected) const {
    switch (h.kind) {
      case kWrite:
        return h.seq == 0 && h.bytes > 0 && h.offset % sizeof(uint32_t) == 0 && h.bytes % sizeof(uint32_t) == 0 &&
               h.offset >= kCallWordsOffset && h.offset <= bytes_ && h.bytes <= bytes_ - h.offset;
      case kSignal:
        if (h.seq != expected) return false;
        if (signal_ == Signal::kCompletion) return h.offset == 0 && h.bytes == 0;
        return h.bytes == sizeof(uint32_t) && (h.offset == arrival_flag_offset(0, p) ||
                                               h.offset == arrival_flag_offset(1, p) || h.offset == arrival_flag_offset(2, p));
      case kAbort: return h.seq == 0 && h.offset == uint64_t(p) * kAbortSlotBytes && h.bytes == kAbortSlotBytes;
      case kProbe: return h.seq == 0 && h.offset == 0 && h.bytes == 0;
      default: return false;
    }
  }

  // Ends every connection (which unblocks the receiver threads), joins the threads, closes the sockets.
  void disconnect() noexcept {
    for (Peer& q : peers_) {
      if (q.in >= 0) shutdown(q.in, SHUT_RDWR);
      if (q.out >= 0) shutdown(q.out, SHUT_RDWR);
    }
    for (Peer& q : peers_) {
      if (q.receiver.joinable()) q.receiver.join();
      if (q.in >= 0) close(q.in);
      if (q.out >= 0) close(q.out);
      q.in = q.out = -1;
    }
  }

  void release() noexcept {
    disconnect();
    if (listen_ >= 0) close(listen_);
    listen_ = -1;
    block_.reset();
  }

  int rank_;
  int world_;
  size_t bytes_;
  std::unique_ptr<WireBlock> block_;
  int listen_ = -1;
  uint32_t port_ = 0;
  uint64_t nonce_ = 0;
  std::vector<Peer> peers_;
};

}  // namespace

std::unique_ptr<Wire> make_tcp_wire(int rank, const RegionLayout& layout, Signal signal) {
  return std::make_unique<TcpWire>(rank, layout, signal);
}

}  // namespace rocenante
