// How a rank's data reaches its peers. A transport only maps memory; the protocol (layout.h) and the
// reduction (host_allreduce.cc, device/oneshot_allreduce.cu) are the same whichever transport carried it.
//
// Lifecycle, driven by the communicator with a rendezvous store in between:
//   1. construct: allocate this rank's receive region, sized by RegionLayout::region_bytes() and filled with
//      initial_word() (layout.h);
//   2. local_handle(): bytes that let a peer map that region; every rank publishes its own;
//   3. connect(handles): map every peer's region (handles[rank] is our own and is skipped);
//   4. all_connected(): every rank has connected; drop what only connecting needed (e.g. names).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../layout.h"

namespace rocenante {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string local_handle() const = 0;
  virtual void connect(const std::vector<std::string>& handles) = 0;
  virtual void all_connected() {}
  // This rank's receive region, in the address space that reduces (host for CPU, device for GPU).
  virtual uint32_t* local_region() const = 0;
  // Where this rank writes to land in peer's region (the peer's mapped memory for direct transports).
  virtual uint32_t* peer_region(int peer) const = 0;
  // From the host: writes `word` into abort[rank] of peer's region (layout.h; peer == rank: our own region)
  // and returns once it is there. Never throws: it runs on failure paths, where a peer that cannot be told
  // will time out instead.
  virtual void post_abort(int peer, uint64_t word) noexcept = 0;

  // Remote transports (RDMA): peer_region(p) is this rank's image of p's region in local memory, and nothing
  // reaches p until deliver() carries bytes [offset, offset + bytes) of that image into p's region at the
  // same offset. Direct transports (shared memory, CUDA IPC) write the peer's memory itself: for them
  // remote() is false and the calls below are never made.
  //
  // Neither the order in which a delivery's bytes are placed nor any word's atomicity is guaranteed while it
  // lands (SoftRoCE under an emulated CPU places byte by byte): a receiver reads a peer's bytes only once that
  // peer's delivery has arrived whole. One round, the same on sender and receiver:
  //   sender:   deliver(p, ...) any number of times, then delivered(): signals each peer delivered to that all
  //             of it was sent, and returns once everything posted has landed, or a fault word
  //             (Fault::kTransport) naming the first peer a delivery failed for;
  //   receiver: arrived(p) until true for every peer (then everything p delivered before its signal is in the
  //             region, whole), then consume_arrivals(). A broken queue pair is returned through `fault`.
  // Abort words (post_abort) travel without a signal: a reader of abort words only asks "nonzero?".
  virtual bool remote() const { return false; }
  virtual void deliver(int /*peer*/, size_t /*offset*/, size_t /*bytes*/) {}
  virtual uint64_t delivered() { return 0; }
  virtual bool arrived(int /*peer*/, uint64_t& /*fault*/) { return true; }
  virtual void consume_arrivals() {}
};

// One RDMA port and GID chosen for the connection to one peer (python/rocenante/_ib.py chooses them).
struct IbPath {
  std::string device;  // e.g. "rocep1s0f0"
  int port;            // 1-based
  int gid_index;
};

// Same host, CPU memory: one POSIX shared-memory segment per rank.
std::unique_ptr<Transport> make_shm_transport(int rank, const RegionLayout& layout);
// Same host, GPU memory: one cudaMalloc region per rank, mapped by peers through CUDA IPC.
std::unique_ptr<Transport> make_cuda_ipc_transport(int rank, int device, const RegionLayout& layout);
// Other hosts (or ROCENANTE_NET=ib), CPU memory: one RC queue pair per peer over RoCE v2, paths[p] for peer p
// (paths[rank] unused). Throws InvalidArgument when rocenante was built without rdma-core's headers, Error
// when libibverbs.so.1 cannot be loaded or a device, port or GID is unusable.
std::unique_ptr<Transport> make_ibverbs_transport(int rank, const RegionLayout& layout, const std::vector<IbPath>& paths);
// Whether make_ibverbs_transport was built (rdma-core's headers were found at build time).
extern const bool kWithIbverbs;

// The value of a Fault::kTransport word: a verbs completion status (enum ibv_wc_status, below 0x100), or one of
// these, for failures that produced no completion.
constexpr uint32_t kPostFailed = 0x100;    // ibv_post_send refused the write (the queue pair is in error)
constexpr uint32_t kPollFailed = 0x101;    // ibv_poll_cq failed
constexpr uint32_t kNoCompletion = 0x102;  // no completion within four times the retransmission budget
constexpr uint32_t kBadSignal = 0x103;     // a peer's delivery signal arrived out of sequence
// A kTransport value in words, e.g. "transport retry counter exceeded (verbs status 12)".
std::string transport_status(uint32_t status);

}  // namespace rocenante
