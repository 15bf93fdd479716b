// RDMA over RoCE v2 (libibverbs, CPU memory): one reliable-connected (RC) queue pair per peer and rail.
//
// Memory, per transport: a WireBlock (transport.h), holding
//   region  (RegionLayout::region_bytes(), filled with initial_word(), registered with remote write: the peers'
//            RDMA WRITEs land here),
//   image   (the same size, local access only): what this rank writes "into a peer's region" is written here
//            first, at the offset it has in that peer's region; peer_region(p) == image for every p. Peers
//            never disagree about an offset's content: call words sit at the same offset in every region, and
//            a rank's area sits at one of two offsets (below or above the receiver, layout.h), each written with
//            the same bytes for every peer that uses it;
//   staging (one 16-byte abort slot per peer, local access only).
// No relaxed ordering on any registration: the protocol needs no order among a call's writes (below), and
// leaving it off keeps PCIe ordering the same as without RDMA for anything that may come to rely on it.
//
// Data path, per call (driven by the proxy, proxy.cc): the reducer fills the image, deliver(p, offset, bytes)
// posts one RDMA WRITE of image[offset, offset + bytes) to the same offset of p's region for each peer,
// signal(e) posts one signal per peer after them on the same queue pair, and delivered() polls for the
// completions of all of them. Rails: a peer reached through several local devices (the two PCIe functions of a
// DGX Spark's port) has a queue pair on each, in the order both ends agreed (python/rocenante/_ib.py); with the
// flag signal, a span of kStripeFromBytes or more is cut into one stripe per rail, each on its rail's queue pair,
// and each rail that carried a stripe writes its own word of the flag after it (layout.h, Mailbox); everything
// else (call words, small spans, the words of rails that carried nothing, abort words) takes the first rail.
// The argument below holds for each rail's queue pair on its own; a stripe is read only after its rail's word.
// The signal (Signal, transport.h):
//   flag (default): an inline RDMA WRITE of e into the words of flag[e % 3][rank] of p's region that the queue
//     pair's stripes need (all of them on the first rail of a call not striped); p's reducer polls them and
//     reads the data once every word reads e (layout.h, Mailbox): no receive, no host thread at p.
//   completion: a zero-length RDMA WRITE WITH IMMEDIATE carrying a per-peer sequence number; p's proxy takes
//     its receive completion and tells its reducer through the mailbox.
// The words themselves may land in pieces (SoftRoCE under an emulated CPU copies byte by byte: a reader polling
// them saw a word half written), so a receiver reads a peer's bytes only after its signal. Abort words are
// 16-byte RDMA WRITEs of the slot {word, check} from staging[p] to abort[rank] of p's region, without a signal:
// a reader takes the word once the slot is whole (layout.h, Abort words).
//
// Why no stale, late or repeated RDMA write is ever taken for current data. Stated for protocol v2 (3 rotating
// buffers; in call e a sender writes buffer e%3 of each peer's region, its call word, area and flag, and nothing
// else but abort words, and a receiver resets buffer (e-1)%3 of its own region during call e). For one sender p
// and one receiver r:
//   1. p posts its writes of call e to r on one queue pair, after every write of call e-1, signal included
//      (possibly before those completed: the proxy keeps up to kRoundsInFlight rounds posted, transport.h).
//   2. An RC responder executes requests once each, in PSN order ("A responder shall execute SEND requests, RDMA
//      WRITE requests and ATOMIC Operation requests in the message order in which they are received", IBTA
//      vol. 1 rel. 1.4, p. 291), so once p's signal of call e-1 has been executed at r, so has every write p
//      posted before it.
//   3. A packet arriving after its request was executed (a retransmitted or delayed copy) carries a PSN behind
//      r's expected PSN: a duplicate, which the responder acknowledges again without executing it (IBTA C9-105,
//      as applied by Linux rxe: drivers/infiniband/sw/rxe/rxe_resp.c, duplicate_request(): "SEND. Ack again and
//      cleanup. C9-105." for SEND and RDMA WRITE alike). So nothing of call e-1 lands at r after r saw p's
//      signal of call e-1 (4), and r's reset of buffer (e-1)%3 during call e, which follows that, is final until
//      p's call e+2, the next to write that buffer: p rings it only after r's data of call e+1 reached it, which
//      r sends once its call e, reset included, has finished (layout.h).
//   4. r reads p's words of call e only after p's signal of call e arrived. Completion: a receive completion,
//      generated after the message and, by 2, all earlier ones were placed (NCCL's net_ib signals the same way,
//      a 0-byte RDMA_WRITE_WITH_IMM after the data); its immediate is p's count of signals to r, which r checks,
//      so a lost or repeated signal is a fault, never a shifted call. Flag: r reads every word of flag[e%3][p]
//      == e in its memory. p writes each word e only after the part of call e's data it covers, on the same
//      queue pair (and only for a call its reducer wrote whole, layout.h); a word of buffer e%3 is e - 3 or older
//      until then (never e), and by 1 and 3 no older write of it lands after it. That the data is in r's memory once the flag is rests on
//      placement in order, which the IB specification does not promise for RDMA WRITE data (it orders
//      execution, 2) and which this path relies on, as the real RoCEnante (b12x, and FlashInfer's copy of it)
//      does: a NIC that places one queue pair's writes in order (ConnectX does, unless out-of-order placement
//      or adaptive routing is enabled on the fabric), and PCIe posted writes that do not pass each other (PCI
//      Express Base Specification, transaction ordering rules: only writes with the Relaxed Ordering attribute
//      may pass; no registration here asks for it). Where either fails, ROCENANTE_IB_SIGNAL=completion.
//      Since p writes buffer e%3 only in call e, and by 3 no older write lands there after r's reset, every
//      non-empty word r reads there is p's call-e word, whole.
//   5. Packets of an earlier communicator's queue pairs: a new queue pair starts at a random 24-bit PSN and
//      accepts only the PSN it expects; a stray old packet matching it by chance still carries the old
//      region's R_Key, which the new registration does not accept (a remote access error: a fault, not data).
// What the protocol does NOT get from RDMA: atomicity of any word while a write lands (SoftRoCE under an
// emulated CPU places byte by byte, and the IB specification promises nothing for RDMA WRITE placement), and
// any order among a call's data writes. Point 4 is why neither is needed here. SoftRoCE (rxe) places data in
// order in software: tests on it cannot falsify the flag's ordering assumption; the TCP wire's mutation check
// (a flag placed before the data, Signal::kFlagFirst) shows that the tests would catch its failure.
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

#include "../errors.h"
#include "transport.h"

namespace rocenante {
namespace {

// libibverbs, opened with dlopen so that rocenante imports and runs (shared memory, CUDA IPC) where rdma-core
// is absent. Only exported functions are looked up; posting and polling go through the context's function
// table (the inline ibv_post_send / ibv_poll_cq), which needs no symbol.
struct Verbs {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  decltype(&::ibv_reg_mr) reg_mr;
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::ibv_wc_status_str) wc_status_str;
  // The exported ibv_query_port fills the leading, always-present fields of ibv_port_attr (the header's
  // ibv_query_port is a macro around it).
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*);
};

const Verbs& verbs() {
  static const Verbs v = [] {
    void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);  // never closed: providers stay loaded
    if (lib == nullptr)
      ROCENANTE_THROW(Error, std::string("cannot load libibverbs.so.1 (") + dlerror() +
                                 "): install rdma-core's libibverbs1 and ibverbs-providers");
    Verbs v{};
    const auto sym = [lib](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr) ROCENANTE_THROW(Error, std::string("libibverbs.so.1 lacks ") + name + ": rdma-core too old");
    };
    sym(v.get_device_list, "ibv_get_device_list");
    sym(v.free_device_list, "ibv_free_device_list");
    sym(v.get_device_name, "ibv_get_device_name");
    sym(v.open_device, "ibv_open_device");
    sym(v.close_device, "ibv_close_device");
    sym(v.alloc_pd, "ibv_alloc_pd");
    sym(v.dealloc_pd, "ibv_dealloc_pd");
    sym(v.reg_mr, "ibv_reg_mr");
    sym(v.dereg_mr, "ibv_dereg_mr");
    sym(v.create_cq, "ibv_create_cq");
    sym(v.destroy_cq, "ibv_destroy_cq");
    sym(v.create_qp, "ibv_create_qp");
    sym(v.destroy_qp, "ibv_destroy_qp");
    sym(v.modify_qp, "ibv_modify_qp");
    sym(v.query_gid, "ibv_query_gid");
    sym(v.wc_status_str, "ibv_wc_status_str");
    sym(v.query_port, "ibv_query_port");
    return v;
  }();
  return v;
}

// Retransmission: local ACK timeout 4.096 us x 2^16 = 268 ms per attempt, 6 retries: a peer whose NIC stops
// answering (its process ended, its host went down) fails our next write after about 7 x 268 ms = 1.9 s
// (IBV_WC_RETRY_EXC_ERR), while a lossless RoCE fabric never comes near one timeout. Not 7 retries: Linux rxe
// treats a retry count of 7 as "retry forever" (drivers/infiniband/sw/rxe/rxe_comp.c), like the RNR count.
constexpr uint8_t kAckTimeout = 16;
constexpr uint8_t kRetryCount = 6;
constexpr double kRetryBudgetS = (kRetryCount + 1) * 4.096e-6 * (1 << kAckTimeout);
static_assert(kRetryBudgetS <= kLivenessBudgetS, "a probe fails within the budget transport.h states");
// The NIC reports every posted write within the retry budget; waiting four times as long before calling the
// peer unreachable only guards against a NIC or driver that stopped reporting.
constexpr double kCompletionWaitS = 4 * kRetryBudgetS;
// A completion signal (WRITE WITH IMMEDIATE) takes one of the receiver's posted receives; one whose proxy stopped on a fault
// never posts more, while its queue pairs live. 6 retries 163.84 ms apart (timer code 28; 7 means "forever"):
// the signal fails after about 7 x 164 ms = 1.15 s (IBV_WC_RNR_RETRY_EXC_ERR), inside the retry budget.
constexpr uint8_t kRnrTimer = 28;
constexpr uint8_t kRnrRetry = 6;
// post_abort()'s longest wait for its write's completion. The NIC sends the write whether or not anyone waits
// (the wait only reaps the completion), and post_abort() also runs on the watchdog thread, which serves every
// communicator of the process (Communicator::watch): a wait of the retry budget there held up the others.
constexpr double kAbortDrainS = 0.1;
// Hop limit of the RoCE v2 (routed, UDP/IP) packets' IP header: the IPv4 TTL, generous for any fabric.
constexpr uint8_t kHopLimit = 64;
// Work requests of one round to one peer: its call word, its area, its signal.
constexpr int kRoundWrs = 3;
// Writes in flight per queue pair: kRoundsInFlight rounds, an abort word and a probe, with room to spare.
constexpr uint32_t kMaxSendWr = 16;
static_assert(kRoundsInFlight * kRoundWrs + 2 <= int(kMaxSendWr), "the send queue never overflows");
// Writes this small go inline (copied into the work request when posted): a call word, a flag's words.
constexpr uint32_t kMaxInline = kMaxRails * sizeof(uint32_t);
// A delivered span of this many bytes or more is striped over the peer's rails (layout.h, Mailbox): below it, a
// second queue pair's post and flag cost more than the half of the bytes it takes off the first (about 1.2 us
// at 95 Gb/s). Only the sender decides: the receiver waits for every rail's word either way. The HCA list
// (ROCENANTE_IB_HCA) is the way to use fewer rails.
constexpr size_t kStripeFromBytes = size_t(32) << 10;
static_assert(kMaxRails == 2, "signal() writes the flag's words as the first rail's and the second's");
// Receives posted per queue pair, one consumed by each signal: a peer is at most one call ahead (layout.h), so
// at most two signals wait at a time.
constexpr uint32_t kRecvDepth = 16;
constexpr uint32_t kPsnMask = 0xFFFFFF;  // PSNs and QP numbers are 24-bit

// What a peer needs to reach this rank's region over one queue pair; rank p's handle holds kMaxRails per rank,
// and rank q reads entries [q][0..kMaxRails), one per rail (zeros past its rails). Fixed size, no implicit
// padding: it travels as raw bytes through the store.
struct Endpoint {
  uint8_t gid[16];
  uint32_t qp_num;
  uint32_t psn;
  uint64_t addr;       // the region's address in the publisher's process
  uint32_t rkey;       // the region's remote key on the device this queue pair uses
  uint32_t mtu;        // enum ibv_mtu of the publisher's port (1 = 256 ... 5 = 4096)
};
static_assert(sizeof(Endpoint) == 40, "Endpoint travels as raw bytes: no implicit padding");
struct HandleHeader {
  uint32_t magic;
  uint32_t world;
  uint64_t region_bytes;
};
static_assert(sizeof(HandleHeader) == 16, "HandleHeader travels as raw bytes: no implicit padding");

int mtu_bytes(uint32_t mtu) { return mtu >= IBV_MTU_256 && mtu <= IBV_MTU_4096 ? 128 << mtu : 0; }

std::string hex_gid(const uint8_t (&gid)[16]) {
  std::string s;
  for (int i = 0; i < 16; ++i) {
    if (i > 0 && i % 2 == 0) s += ':';
    s += "0123456789abcdef"[gid[i] >> 4];
    s += "0123456789abcdef"[gid[i] & 15];
  }
  return s;
}

// One opened RDMA device: protection domain, completion queue, and both registrations.
struct Device {
  std::string name;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;       // completions of our writes
  ibv_cq* recv_cq = nullptr;  // the peers' signals
  ibv_mr* region_mr = nullptr;  // remote write
  ibv_mr* send_mr = nullptr;    // image + staging: local only
  int outstanding = 0;          // signalled writes posted on this device and not yet completed
};

// One queue pair to a peer.
struct Rail {
  int device = -1;  // index into devices_
  IbPath path;
  ibv_qp* qp = nullptr;
  Endpoint local{};
  Endpoint remote{};
  bool striped = false;  // carries a stripe of the round being gathered
  int in_flight = 0;     // signalled writes posted on it and not yet completed
  // The round being gathered (deliver() appends, signal() posts it as one chained list, only its signal
  // signalled: RC completes a queue pair's requests in order, so its completion covers the writes before it).
  ibv_send_wr round[kRoundWrs];
  ibv_sge sges[kRoundWrs];
  int gathered = 0;
};

struct PeerLink {
  std::vector<Rail> rails;  // rails[0]: the first rail
  bool pending = false;     // delivered to since the last signal
  uint32_t signals = 0;     // signals sent
  uint32_t arrivals = 0;    // signals received (each carries the sender's count, checked)
  uint32_t consumed = 0;    // arrivals the host path has used
};

class IbverbsWire final : public Wire {
 public:
  IbverbsWire(int rank, const RegionLayout& layout, const std::vector<std::vector<IbPath>>& paths, Signal signal)
      : Wire(signal), rank_(rank), world_(layout.world), bytes_(layout.region_bytes()), links_(layout.world) {
    const Verbs& v = verbs();
    if (signal != Signal::kFlag && signal != Signal::kCompletion)
      ROCENANTE_THROW(InvalidArgument, "RDMA signals with a flag or a completion, not mode " +
                                           std::to_string(uint32_t(signal)) + " (a TCP wire's test mode)");
    if (int(paths.size()) != world_)
      ROCENANTE_THROW(InvalidArgument, "expected the RDMA rails to every rank (" + std::to_string(world_) + "), got " +
                                           std::to_string(paths.size()));
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      const size_t rails = paths[p].size();
      if (rails < 1 || rails > size_t(kMaxRails) || (rails > 1 && signal != Signal::kFlag))
        ROCENANTE_THROW(InvalidArgument, "the path to rank " + std::to_string(p) + " has " + std::to_string(rails) +
                                             " rails: 1 to " + std::to_string(kMaxRails) +
                                             " with the flag signal, 1 with the completion signal");
      for (const IbPath& path : paths[p])
        if (path.traffic_class < 0 || path.traffic_class > 255 || path.service_level < 0 || path.service_level > 15)
          ROCENANTE_THROW(InvalidArgument, "the path to rank " + std::to_string(p) + " asks for traffic class " +
                                               std::to_string(path.traffic_class) + " and service level " +
                                               std::to_string(path.service_level) + ": use 0..255 and 0..15");
    }
    // The staging slots (the block's extra bytes) start as zeros too: an abort word is sent only once staged.
    block_ = std::make_unique<WireBlock>(bytes_, kMaxRanks * kAbortSlotBytes);
    // A forked child gets none of the registered memory: pinned pages shared with a child would be the NIC's
    // and the child's at once (the child never uses the communicator: Communicator::in_forked_child()).
    if (madvise(block_->data(), block_->bytes(), MADV_DONTFORK) != 0) {
      block_.reset();
      throw_system_error("madvise(MADV_DONTFORK)", __FILE__, __LINE__);
    }
    devices_.reserve(size_t(world_) * kMaxRails);  // Device addresses stay put (first_peer_on())
    try {
      std::random_device rd;
      for (int p = 0; p < world_; ++p) {
        if (p == rank_) continue;
        links_[p].rails.resize(paths[p].size());
        for (size_t k = 0; k < paths[p].size(); ++k) {
          Rail& r = links_[p].rails[k];
          r.path = paths[p][k];
          r.device = open_device(r.path, p);
          Device& d = devices_[r.device];
          check_port(d, r.path, p, r.local);
          ibv_qp_init_attr init{};
          init.send_cq = d.cq;
          init.recv_cq = d.recv_cq;
          init.cap.max_send_wr = kMaxSendWr;
          init.cap.max_recv_wr = kRecvDepth;  // receives take no data: a signal carries only its immediate
          init.cap.max_send_sge = 1;
          init.cap.max_recv_sge = 1;
          init.cap.max_inline_data = kMaxInline;
          init.qp_type = IBV_QPT_RC;
          r.qp = v.create_qp(d.pd, &init);
          if (r.qp == nullptr) fail_errno("create a queue pair on " + d.name, p);
          ibv_qp_attr a{};
          a.qp_state = IBV_QPS_INIT;
          a.pkey_index = 0;
          a.port_num = uint8_t(r.path.port);
          a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
          if (const int err = v.modify_qp(r.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
            fail_code("move the queue pair to INIT", p, err);
          for (uint32_t i = 0; signal == Signal::kCompletion && i < kRecvDepth; ++i)
            if (const int err = post_receive(p)) fail_code("post a receive", p, err);
          r.local.qp_num = r.qp->qp_num;
          r.local.psn = rd() & kPsnMask;
          r.local.addr = reinterpret_cast<uintptr_t>(block_->region());
          r.local.rkey = d.region_mr->rkey;
        }
      }
    } catch (...) {
      release();
      throw;
    }
  }

  ~IbverbsWire() override { release(); }

  std::string local_handle() const override {
    const HandleHeader h{kRdmaHandleMagic, uint32_t(world_), bytes_};
    std::string s(reinterpret_cast<const char*>(&h), sizeof(h));
    for (const PeerLink& l : links_)
      for (int k = 0; k < kMaxRails; ++k) {
        const Endpoint none{};
        const Endpoint& e = k < int(l.rails.size()) ? l.rails[k].local : none;
        s.append(reinterpret_cast<const char*>(&e), sizeof(Endpoint));
      }
    return s;
  }

  void connect(const std::vector<std::string>& handles) override {
    const size_t handle_bytes = sizeof(HandleHeader) + size_t(world_) * kMaxRails * sizeof(Endpoint);
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      PeerLink& l = links_[p];
      const std::string who = "rank " + std::to_string(rank_) + ": rank " + std::to_string(p);
      const std::string& h = handles[p];
      HandleHeader hh{};
      if (h.size() != handle_bytes)
        ROCENANTE_THROW(Error, who + " published an RDMA handle of " + std::to_string(h.size()) + " bytes, expected " +
                                   std::to_string(handle_bytes) + " (is every rank using RDMA? ROCENANTE_NET must agree)");
      std::memcpy(&hh, h.data(), sizeof(hh));
      if (hh.magic != kRdmaHandleMagic || hh.world != uint32_t(world_) || hh.region_bytes != bytes_)
        ROCENANTE_THROW(Error, who + " published an RDMA handle that does not match this rank's (magic, world or "
                                     "region size differ)");
      for (int k = 0; k < kMaxRails; ++k) {
        Endpoint r{};
        std::memcpy(&r, h.data() + sizeof(HandleHeader) + (size_t(rank_) * kMaxRails + k) * sizeof(Endpoint),
                    sizeof(Endpoint));
        const bool ours = k < int(l.rails.size());
        if (ours != (r.qp_num != 0))  // both ends chose their rails alike (python/rocenante/_ib.py)
          ROCENANTE_THROW(Error, who + (ours ? " has no" : " has a") + " rail " + std::to_string(k + 1) +
                                     " to this rank, which has " + std::to_string(l.rails.size()) +
                                     ": the two ends chose their RDMA devices differently");
        if (ours) connect_rail(p, l.rails[k], r, who);
      }
    }
  }

  uint32_t* local_region() const override { return block_->region(); }
  uint32_t* peer_region(int) const override { return block_->image(); }

  void deliver(int peer, size_t offset, size_t bytes) override {
    PeerLink& l = links_[peer];
    l.pending = true;
    if (bytes == 0) return;
    const int rails = bytes >= kStripeFromBytes ? int(l.rails.size()) : 1;  // one with the completion signal
    const size_t stripe = bytes / size_t(rails) / 16 * 16;                  // whole 16-byte chunks, the last the rest
    for (int k = 0; k < rails; ++k) {
      const size_t begin = offset + size_t(k) * stripe, length = k + 1 < rails ? stripe : bytes - size_t(k) * stripe;
      if (l.rails[k].gathered == kRoundWrs - 1) post_round(peer, k);  // the signal must come last: make room
      gather(peer, k, reinterpret_cast<char*>(block_->image()) + begin, begin, length);
      l.rails[k].striped = k > 0;
    }
  }

  void signal(uint32_t epoch) override {
    const uint32_t flag[kMaxRails] = {epoch, epoch};  // inline: copied when posted, below
    const size_t flag_offset = arrival_flag_offset(buffer_of(epoch), rank_);
    for (int p = 0; p < world_; ++p) {
      PeerLink& l = links_[p];
      if (!l.pending) continue;
      l.pending = false;
      if (signal_ == Signal::kFlag) {
        // The second rail's word after its stripe, on its queue pair; every other word after the first rail's.
        Rail& second = l.rails.size() > 1 ? l.rails[1] : l.rails[0];
        const bool striped = std::exchange(second.striped, false);
        gather(p, 0, flag, flag_offset, striped ? sizeof(uint32_t) : sizeof(flag));
        if (striped) gather(p, 1, flag + 1, flag_offset + sizeof(uint32_t), sizeof(uint32_t));
      } else {
        Rail& r = l.rails[0];
        ibv_send_wr& wr = r.round[r.gathered++];
        wr = {};
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;  // zero bytes: only the immediate and its receive completion
        wr.imm_data = htonl(l.signals++);
        wr.wr.rdma.remote_addr = r.remote.addr;
        wr.wr.rdma.rkey = r.remote.rkey;
      }
      for (int k = 0; k < int(l.rails.size()); ++k) {
        Rail& r = l.rails[k];
        if (r.gathered == 0) continue;
        r.round[r.gathered - 1].send_flags |= IBV_SEND_SIGNALED;
        post_round(p, k);
      }
    }
    signalled_ = std::chrono::steady_clock::now();
  }

  bool delivered(uint64_t& fault) override {
    if ((fault = take_pending_fault()) != 0) return true;
    bool done = true;
    for (Device& d : devices_) {
      const uint64_t f = poll_completions(d);
      if (f != 0 && fault == 0) fault = f;
      done = done && d.outstanding == 0;
    }
    if (done || fault != 0) return true;
    if (std::chrono::steady_clock::now() - signalled_ < std::chrono::duration<double>(kCompletionWaitS)) return false;
    for (Device& d : devices_)  // the NIC stopped reporting: this device's queue pairs are useless from here on
      if (d.outstanding > 0 && fault == 0) fault = encode_fault(Fault::kTransport, first_peer_on(d), kNoCompletion);
    return true;
  }

  bool arrived(int peer, uint64_t& fault) override {
    if (signal_ != Signal::kCompletion) return false;  // no receives: a failure shows in our writes' completions
    Device& d = devices_[links_[peer].rails[0].device];
    ibv_wc wc[8];
    for (int n; (n = ibv_poll_cq(d.recv_cq, 8, wc)) != 0;) {
      if (n < 0) {
        fault = encode_fault(Fault::kTransport, uint32_t(peer), kPollFailed);
        return false;
      }
      for (int i = 0; i < n; ++i) {
        const int from = int(wc[i].wr_id);
        PeerLink& l = links_[from];
        if (wc[i].status != IBV_WC_SUCCESS) {
          fault = encode_fault(Fault::kTransport, uint32_t(from), uint32_t(wc[i].status));
          return false;
        }
        // RC delivers each signal once and in order: another count means a lost or repeated delivery.
        if (wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM || ntohl(wc[i].imm_data) != l.arrivals) {
          fault = encode_fault(Fault::kTransport, uint32_t(from), kBadSignal);
          return false;
        }
        ++l.arrivals;
        if (const int err = post_receive(from)) {
          fault = encode_fault(Fault::kTransport, uint32_t(from), kPostFailed);
          (void)err;
          return false;
        }
      }
    }
    return links_[peer].arrivals != links_[peer].consumed;
  }

  void consume(int peer) override { ++links_[peer].consumed; }

  // On each rail, a zero-length RDMA WRITE, which the peer's NIC acknowledges (or which fails after the retry
  // budget), unless a write on that rail is in flight already; failures of any write on the devices come back
  // here too. Every rail is probed: a call too small to be striped uses the first alone.
  void probe(int peer, uint64_t& fault) override {
    PeerLink& l = links_[peer];
    if ((fault = take_pending_fault()) != 0) return;
    for (int k = 0; k < int(l.rails.size()); ++k) {
      Rail& r = l.rails[k];
      if (r.qp == nullptr || r.remote.qp_num == 0) return;
      if ((fault = poll_completions(devices_[r.device])) != 0) return;
      if (r.in_flight > 0) continue;
      ibv_send_wr wr{};
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = r.remote.addr;
      wr.wr.rdma.rkey = r.remote.rkey;
      post(peer, k, wr);
    }
  }

  void post_abort(int peer, uint64_t word) noexcept override {
    if (peer == rank_) {
      store_abort(local_region(), rank_, word);
      return;
    }
    if (links_[peer].rails.empty()) return;
    const Rail& first = links_[peer].rails[0];
    if (first.qp == nullptr || first.remote.qp_num == 0) return;  // never connected
    uint64_t* slot = reinterpret_cast<uint64_t*>(block_->extra()) + 2 * peer;
    slot[0] = word;
    slot[1] = ~word;
    try {
      post_write(peer, slot, size_t(rank_) * kAbortSlotBytes, kAbortSlotBytes);
    } catch (...) {
    }
    drain(devices_[first.device], kAbortDrainS);  // a peer that cannot be told times out instead
  }

 private:
  // Moves one rail's queue pair to RTS toward the peer's endpoint `r`.
  void connect_rail(int p, Rail& l, const Endpoint& r, const std::string& who) {
    const Verbs& v = verbs();
    l.remote = r;
    if (r.qp_num == 0 || r.qp_num > kPsnMask || r.psn > kPsnMask || r.addr == 0 || mtu_bytes(r.mtu) == 0 ||
        std::all_of(std::begin(r.gid), std::end(r.gid), [](uint8_t b) { return b == 0; }))
      ROCENANTE_THROW(Error, who + " published an impossible RDMA endpoint (queue pair " + std::to_string(r.qp_num) +
                                 ", PSN " + std::to_string(r.psn) + ", MTU code " + std::to_string(r.mtu) + ", GID " +
                                 hex_gid(r.gid) + ")");
    const uint32_t mtu = std::min(l.local.mtu, r.mtu);
    if (r.mtu != l.local.mtu)
      std::fprintf(stderr, "rocenante: %s's port MTU is %d bytes, this rank's (%s port %d) %d: the path uses %d\n",
                   who.c_str(), mtu_bytes(r.mtu), l.path.device.c_str(), l.path.port, mtu_bytes(l.local.mtu),
                   mtu_bytes(mtu));
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = ibv_mtu(mtu);
    a.dest_qp_num = r.qp_num;
    a.rq_psn = r.psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = kRnrTimer;
    a.ah_attr.is_global = 1;  // RoCE: every packet carries a GRH (the UDP/IP header on RoCE v2)
    std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
    a.ah_attr.grh.sgid_index = uint8_t(l.path.gid_index);
    a.ah_attr.grh.hop_limit = kHopLimit;
    a.ah_attr.grh.traffic_class = uint8_t(l.path.traffic_class);
    a.ah_attr.sl = uint8_t(l.path.service_level);
    a.ah_attr.port_num = uint8_t(l.path.port);
    if (const int err = v.modify_qp(l.qp, &a,
                                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      fail_code("connect the queue pair (RTR, peer GID " + hex_gid(r.gid) + ")", p, err);
    a = {};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = kAckTimeout;
    a.retry_cnt = kRetryCount;
    a.rnr_retry = kRnrRetry;
    a.sq_psn = l.local.psn;
    a.max_rd_atomic = 1;
    if (const int err = v.modify_qp(l.qp, &a,
                                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
      fail_code("move the queue pair to RTS", p, err);
  }

  int open_device(const IbPath& path, int peer) {
    const Verbs& v = verbs();
    for (size_t i = 0; i < devices_.size(); ++i)
      if (devices_[i].name == path.device) return int(i);
    int n = 0;
    ibv_device** list = v.get_device_list(&n);
    if (list == nullptr) fail_errno("list RDMA devices", peer);
    ibv_device* dev = nullptr;
    std::string present;
    for (int i = 0; i < n; ++i) {
      const std::string name = v.get_device_name(list[i]);
      present += (present.empty() ? "" : ", ") + name;
      if (name == path.device) dev = list[i];
    }
    Device d;
    d.name = path.device;
    if (dev != nullptr) d.ctx = v.open_device(dev);
    v.free_device_list(list);
    if (dev == nullptr)
      ROCENANTE_THROW(Error, "rank " + std::to_string(rank_) + ": RDMA device " + path.device + " (for rank " +
                                 std::to_string(peer) + ") not found; present: " + (present.empty() ? "none" : present));
    devices_.push_back(d);  // from here on release() frees what it holds
    Device& dd = devices_.back();
    if (dd.ctx == nullptr) fail_errno("open RDMA device " + dd.name, peer);
    dd.pd = v.alloc_pd(dd.ctx);
    if (dd.pd == nullptr) fail_errno("allocate a protection domain on " + dd.name, peer);
    dd.cq = v.create_cq(dd.ctx, int(kMaxSendWr) * world_ * kMaxRails, nullptr, nullptr, 0);
    if (dd.cq == nullptr) fail_errno("create a completion queue on " + dd.name, peer);
    dd.recv_cq = v.create_cq(dd.ctx, int(kRecvDepth) * world_, nullptr, nullptr, 0);
    if (dd.recv_cq == nullptr) fail_errno("create a completion queue on " + dd.name, peer);
    dd.region_mr = v.reg_mr(dd.pd, block_->region(), bytes_, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (dd.region_mr == nullptr) fail_errno("register " + std::to_string(bytes_) + " bytes on " + dd.name, peer);
    const size_t send_bytes = block_->bytes() - bytes_;  // the image and the staging slots
    dd.send_mr = v.reg_mr(dd.pd, block_->image(), send_bytes, 0);
    if (dd.send_mr == nullptr) fail_errno("register " + std::to_string(send_bytes) + " bytes on " + dd.name, peer);
    return int(devices_.size() - 1);
  }

  void check_port(const Device& d, const IbPath& path, int peer, Endpoint& local) {
    const Verbs& v = verbs();
    const std::string where = "rank " + std::to_string(rank_) + ": RDMA device " + d.name + " port " +
                              std::to_string(path.port) + " (for rank " + std::to_string(peer) + ")";
    ibv_port_attr pa{};
    if (path.port < 1 || path.port > 255 || v.query_port(d.ctx, uint8_t(path.port), &pa) != 0)
      ROCENANTE_THROW(Error, where + " cannot be queried: no such port?");
    if (pa.state != IBV_PORT_ACTIVE)
      ROCENANTE_THROW(Error, where + " is " + port_state(pa.state) +
                                 ", not ACTIVE: is it cabled and its link up? (choose another with ROCENANTE_IB_HCA)");
    if (pa.link_layer != IBV_LINK_LAYER_ETHERNET)
      ROCENANTE_THROW(Error, where + " is not an Ethernet (RoCE) port: rocenante speaks RoCE v2 only");
    if (path.gid_index < 0 || path.gid_index >= pa.gid_tbl_len)
      ROCENANTE_THROW(Error, where + ": GID index " + std::to_string(path.gid_index) + " is outside its table of " +
                                 std::to_string(pa.gid_tbl_len));
    ibv_gid gid{};
    if (v.query_gid(d.ctx, uint8_t(path.port), path.gid_index, &gid) != 0 ||
        std::all_of(std::begin(gid.raw), std::end(gid.raw), [](uint8_t b) { return b == 0; }))
      ROCENANTE_THROW(Error, where + ": GID index " + std::to_string(path.gid_index) + " is empty");
    std::memcpy(local.gid, gid.raw, 16);
    local.mtu = pa.active_mtu;
  }

  static std::string port_state(ibv_port_state s) {
    switch (s) {
      case IBV_PORT_DOWN: return "DOWN";
      case IBV_PORT_INIT: return "INIT";
      case IBV_PORT_ARMED: return "ARMED";
      case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
      default: return "in state " + std::to_string(int(s));
    }
  }

  // Appends to the round of peer's rail `k` an unsignalled RDMA WRITE of `bytes` at `src` (inside the send
  // registration, or anywhere when it goes inline: kMaxInline) to `offset` of peer's region.
  void gather(int peer, int k, const void* src, size_t offset, size_t bytes) {
    Rail& l = links_[peer].rails[k];
    ibv_sge& sge = l.sges[l.gathered];
    sge.addr = reinterpret_cast<uintptr_t>(src);
    sge.length = uint32_t(bytes);
    sge.lkey = devices_[l.device].send_mr->lkey;
    ibv_send_wr& wr = l.round[l.gathered++];
    wr = {};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = bytes <= kMaxInline ? IBV_SEND_INLINE : 0;
    wr.wr.rdma.remote_addr = l.remote.addr + offset;
    wr.wr.rdma.rkey = l.remote.rkey;
  }

  // Posts the gathered round of peer's rail `k` as one list.
  void post_round(int peer, int k) {
    Rail& l = links_[peer].rails[k];
    for (int i = 0; i + 1 < l.gathered; ++i) l.round[i].next = &l.round[i + 1];
    const int n = std::exchange(l.gathered, 0);
    if (n > 0) post(peer, k, l.round[0], (l.round[n - 1].send_flags & IBV_SEND_SIGNALED) != 0);
  }

  // Posts one signalled RDMA WRITE of `bytes` at `src` (inside the send registration) to `offset` of peer's
  // region, on its own, on the first rail.
  void post_write(int peer, void* src, size_t offset, size_t bytes) {
    gather(peer, 0, src, offset, bytes);
    Rail& l = links_[peer].rails[0];
    l.round[l.gathered - 1].send_flags = IBV_SEND_SIGNALED;  // from the registration: larger than kMaxInline
    post_round(peer, 0);
  }

  // A work request's id: the peer, the rail and whether it is signalled (the others are not counted).
  static uint64_t wr_id(int peer, int k, bool signalled) { return (uint64_t(peer) << 4) | (uint64_t(k) << 1) | signalled; }
  static int wr_peer(uint64_t id) { return int(id >> 4); }
  static int wr_rail(uint64_t id) { return int(id >> 1) & 7; }
  static bool wr_signalled(uint64_t id) { return (id & 1) != 0; }
  static_assert(kMaxRails <= 8, "wr_id() holds the rail in 3 bits");

  // Posts the list `wr` on peer's rail `k`, its last request `signalled` (the others are not). A post the NIC
  // refuses is recorded as that peer's transport fault. A completion is counted (Device::outstanding, in_flight)
  // for the signalled request only, which the wr_id says: an unsignalled one that fails completes too, uncounted.
  void post(int peer, int k, ibv_send_wr& wr, bool signalled = true) {
    Rail& l = links_[peer].rails[k];
    for (ibv_send_wr* w = &wr; w != nullptr; w = w->next) w->wr_id = wr_id(peer, k, w->next == nullptr && signalled);
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(l.qp, &wr, &bad) != 0) {
      if (pending_fault_ == 0) pending_fault_ = encode_fault(Fault::kTransport, uint32_t(peer), kPostFailed);
      return;
    }
    if (!signalled) return;
    ++devices_[l.device].outstanding;
    ++l.in_flight;
  }

  // A receive for the completion signal, on the first rail (the only one it takes).
  int post_receive(int peer) {
    ibv_recv_wr wr{};
    wr.wr_id = uint64_t(peer);
    ibv_recv_wr* bad = nullptr;
    return ibv_post_recv(links_[peer].rails[0].qp, &wr, &bad);
  }

  // A post the NIC refused, or a write drain() saw fail, once.
  uint64_t take_pending_fault() { return std::exchange(pending_fault_, 0); }

  // Takes the completions `d` has now; returns the first failure among them as a fault word.
  uint64_t poll_completions(Device& d) {
    uint64_t fault = 0;
    ibv_wc wc[8];
    for (int n; d.outstanding > 0 && (n = ibv_poll_cq(d.cq, 8, wc)) != 0;) {
      if (n < 0) return encode_fault(Fault::kTransport, first_peer_on(d), kPollFailed);
      for (int i = 0; i < n; ++i) {
        const int peer = wr_peer(wc[i].wr_id);
        if (wr_signalled(wc[i].wr_id)) {
          --d.outstanding;
          --links_[peer].rails[wr_rail(wc[i].wr_id)].in_flight;
        }
        if (wc[i].status != IBV_WC_SUCCESS && fault == 0)
          fault = encode_fault(Fault::kTransport, uint32_t(peer), uint32_t(wc[i].status));
      }
    }
    return fault;
  }

  // Waits, for at most `bound_s`, until every write posted on `d` completed (an abort word's). A failed write
  // among them, data included, is kept for the next delivered().
  void drain(Device& d, double bound_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(bound_s);
    while (d.outstanding > 0 && std::chrono::steady_clock::now() < deadline) {
      const uint64_t f = poll_completions(d);
      if (f != 0 && pending_fault_ == 0) pending_fault_ = f;
      if (f == 0) sched_yield();
    }
  }

  uint32_t first_peer_on(const Device& d) const {
    for (int p = 0; p < world_; ++p)
      for (const Rail& r : links_[p].rails)
        if (r.device >= 0 && &devices_[r.device] == &d) return uint32_t(p);
    return 0;
  }

  [[noreturn]] void fail_errno(const std::string& what, int peer) {
    fail_code(what, peer, errno);
  }
  [[noreturn]] void fail_code(const std::string& what, int peer, int err) {
    ROCENANTE_THROW(Error, "rank " + std::to_string(rank_) + ": cannot " + what + " (for rank " + std::to_string(peer) +
                               "): " + std::strerror(err));
  }

  void release() noexcept {
    const Verbs& v = verbs();
    for (PeerLink& l : links_)
      for (Rail& r : l.rails)
        if (r.qp != nullptr) v.destroy_qp(r.qp), r.qp = nullptr;
    for (Device& d : devices_) {
      if (d.region_mr != nullptr) v.dereg_mr(d.region_mr);
      if (d.send_mr != nullptr) v.dereg_mr(d.send_mr);
      if (d.cq != nullptr) v.destroy_cq(d.cq);
      if (d.recv_cq != nullptr) v.destroy_cq(d.recv_cq);
      if (d.pd != nullptr) v.dealloc_pd(d.pd);
      if (d.ctx != nullptr) v.close_device(d.ctx);
    }
    devices_.clear();
    block_.reset();
  }

  int rank_;
  int world_;
  size_t bytes_;
  std::unique_ptr<WireBlock> block_;
  std::vector<Device> devices_;
  std::vector<PeerLink> links_;
  uint64_t pending_fault_ = 0;  // a post the NIC refused, or a write drain() saw fail: for the next delivered()
  std::chrono::steady_clock::time_point signalled_{};  // when the last signal() posted
};

}  // namespace

const bool kWithIbverbs = true;

std::unique_ptr<Wire> make_ibverbs_wire(int rank, const RegionLayout& layout,
                                        const std::vector<std::vector<IbPath>>& paths, Signal signal) {
  return std::make_unique<IbverbsWire>(rank, layout, paths, signal);
}

std::string verbs_status(uint32_t status) {
  switch (status) {
    case kPostFailed: return "the NIC refused to post the write";
    case kPollFailed: return "polling the completion queue failed";
    case kNoCompletion:
      return "no completion within " + std::to_string(int(kCompletionWaitS)) + " s (the NIC stopped reporting)";
    default: break;
  }
  return std::string(verbs().wc_status_str(ibv_wc_status(status))) + " (verbs status " + std::to_string(status) + ")";
}

}  // namespace rocenante
