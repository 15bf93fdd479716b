// How a rank's data reaches its peers. A transport only maps memory; the protocol (layout.h) and the
// reduction (host_collective.cc, device/collective_kernels.cu) are the same whichever transport carried it.
//
// Lifecycle, driven by the communicator with a rendezvous store in between:
//   1. construct: allocate this rank's receive region, sized by RegionLayout::region_bytes() and filled with
//      initial_word() (layout.h);
//   2. local_handle(): bytes that let a peer map that region; every rank publishes its own;
//   3. connect(handles): map every peer's region (handles[rank] is our own and is skipped);
//   4. all_connected(): every rank has connected; drop what only connecting needed (e.g. names).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../errors.h"
#include "../fault.h"
#include "../layout.h"
#include "../timeline.h"

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

  // Network transports (proxy.cc): the ring the reducer and the proxy thread share, and the arrival words
  // ([buffer][source], layout.h: Mailbox) the reducer waits for, in its address space; nullptr for direct
  // transports (shared memory, CUDA IPC), whose peer_region() is the peer's memory itself.
  virtual Mailbox* mailbox() const { return nullptr; }
  virtual const uint32_t* arrivals() const { return nullptr; }
};

// From the host: writes `word` and its check into abort slot `source` of `region` (layout.h, Abort words), each
// 8-byte word whole.
inline void store_abort(uint32_t* region, int source, uint64_t word) {
  __atomic_store_n(abort_word(region, source), word, __ATOMIC_RELEASE);
  __atomic_store_n(abort_check(region, source), ~word, __ATOMIC_RELEASE);
}

// How a network peer's delivery tells the reducer it is whole (layout.h, Mailbox); every rank alike (Config).
enum class Signal : uint32_t {
  kFlag = 0,        // the wire writes the arrival flag after the data, over the same connection (default)
  kCompletion = 1,  // the receiver's proxy stores the mailbox's arrival word once the wire reports a signal
  kFlagFirst = 2,   // tests only, TCP wire only: the flag is placed BEFORE the round's data, which the
                    // network tests must catch (the mutation check of the flag's order)
};

// A network wire (RDMA verbs, the TCP software wire): a Transport whose peer_region(p) is this rank's image of
// p's region in local memory; nothing reaches p until deliver() carries bytes [offset, offset + bytes) of that
// image into p's region at the same offset. Only the proxy (proxy.cc) drives a wire, from its one thread;
// post_abort() may come from any thread, and the proxy serialises it with everything else.
//
// Neither the order in which a delivery's bytes are placed nor any word's atomicity is guaranteed while it
// lands (SoftRoCE under an emulated CPU places byte by byte; the TCP wire places 16-bit halves in random order):
// a receiver reads a peer's bytes only once that peer's delivery has arrived whole. One round, the same on
// sender and receiver, and none of these calls blocks:
//   sender:   deliver(p, ...) any number of times, then signal(epoch): posts, to each peer delivered to since
//             the last signal(), a signal that all of it was sent: with Signal::kFlag, a write of `epoch` into
//             flag[epoch % 3][rank] of p's region, placed after everything delivered to p before it; with
//             kCompletion, a message that p's arrived() reports. delivered() until true: everything posted has
//             landed (a failure comes back through `fault`: Fault::kTransport naming the first peer it failed
//             for). Up to kRoundsInFlight rounds may be posted before delivered() returns true; each peer
//             receives the rounds, signals included, in the order they were posted.
//   receiver: kCompletion: arrived(p) is true while a signal of p has arrived that consume(p) has not yet
//             taken; everything p delivered before that signal is then in the region, whole. kFlag: arrived(p)
//             is never true (the flags say it, layout.h). Either way a broken connection comes back through
//             `fault` (from arrived(p): after every signal and abort word that arrived before the break was placed;
//             delivered() and probe() may see it first).
//   liveness: probe(p), which the proxy calls every kProbeInterval (proxy.cc) while this rank waits for p's
//             delivery: if nothing is in flight to p, the wire sends p a message that p's transport (its NIC,
//             its host's TCP stack), not its process, acknowledges; anything unacknowledged for
//             kLivenessBudgetS fails the connection, and probe() reports a broken connection through `fault`. So
//             a peer whose host or link went down fails this rank's wait within about that budget, whether or not
//             this rank had anything to send it, while a stopped but live peer is still acknowledged and stays a
//             timeout.
// Abort words (post_abort) travel without a signal, each in one write of its slot {word, check}, which a reader
// takes only once whole (layout.h, Abort words).
class Wire : public Transport {
 public:
  explicit Wire(Signal signal) : signal_(signal) {}
  Signal signal_mode() const { return signal_; }
  virtual void deliver(int peer, size_t offset, size_t bytes) = 0;
  virtual void signal(uint32_t epoch) = 0;
  virtual bool delivered(uint64_t& fault) = 0;
  virtual bool arrived(int peer, uint64_t& fault) = 0;
  virtual void consume(int peer) = 0;
  virtual void probe(int peer, uint64_t& fault) = 0;

 protected:
  const Signal signal_;
};

// A network wire's memory (tcp.cc, ibverbs.cc): one anonymous mmap of whole pages (of the host's page size, 64 KiB
// on some aarch64 kernels: ibverbs.cc's MADV_DONTFORK and registration then cover exactly it), holding this rank's
// receive region (RegionLayout::region_bytes(), filled with initial_word(): empty before any peer can write into it,
// layout.h), then the image, as large, then `extra_bytes`. The image and the extra bytes start as zeros, which no
// peer reads: the proxy delivers a call's span only once the reducer wrote all of it (layout.h, Mailbox: ring).
// The image is peer_region(p) for every peer p (ibverbs.cc says why one image serves them all).
class WireBlock {
 public:
  // page_bytes: the host's, unless a test injects another (_C._test_wire_block_bytes).
  WireBlock(size_t region_bytes, size_t extra_bytes, size_t page_bytes = size_t(sysconf(_SC_PAGESIZE)))
      : region_bytes_(region_bytes),
        bytes_((2 * region_bytes + extra_bytes + page_bytes - 1) / page_bytes * page_bytes) {
    void* block = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) throw_system_error("mmap", __FILE__, __LINE__);
    data_ = static_cast<char*>(block);
    for (size_t i = 0; i < region_bytes_ / sizeof(uint32_t); ++i) region()[i] = initial_word(i);
  }
  ~WireBlock() { munmap(data_, bytes_); }
  WireBlock(const WireBlock&) = delete;
  WireBlock& operator=(const WireBlock&) = delete;

  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  uint32_t* region() const { return reinterpret_cast<uint32_t*>(data_); }
  uint32_t* image() const { return reinterpret_cast<uint32_t*>(data_ + region_bytes_); }
  char* extra() const { return data_ + 2 * region_bytes_; }

 private:
  size_t region_bytes_;
  size_t bytes_;
  char* data_ = nullptr;
};

// Rounds a proxy may have posted that the wire has not yet reported landed (delivered()). Two let call e + 1
// leave while call e's acknowledgements are still on their way; a reducer rings e + 2 only once its peers had
// our data of e (layout.h, Mailbox), so a third would seldom help.
constexpr int kRoundsInFlight = 2;
// How long a wire lets a write go unacknowledged by the peer's transport before it fails the connection: the
// RDMA retransmission budget (ibverbs.cc), and the TCP wire's TCP_USER_TIMEOUT.
constexpr double kLivenessBudgetS = 1.9;

// One RDMA port and GID chosen for the connection to one peer (python/rocenante/_ib.py chooses them).
struct IbPath {
  std::string device;  // e.g. "rocep1s0f0"
  int port;            // 1-based
  int gid_index;
  int traffic_class;   // of the queue pair's packets (RoCE v2: the IP header's DSCP and ECN bits), 0..255
  int service_level;   // 0..15
};

// Same host, CPU memory: one POSIX shared-memory segment per rank.
std::unique_ptr<Transport> make_shm_transport(int rank, const RegionLayout& layout);
// Same host, GPU memory: one cudaMalloc region per rank, mapped by peers through CUDA IPC.
std::unique_ptr<Transport> make_cuda_ipc_transport(int rank, int device, const RegionLayout& layout);
// Tests only: the CUDA IPC transport's post_abort() holds its staging slot, written, for `seconds` before its copies
// are queued, so that posts from two threads overlap (Communicator::test_post_aborts_at_once()).
void hold_abort_staging(double seconds);
// Other hosts (or ROCENANTE_NET=ib): RC queue pairs over RoCE v2, one per rail of paths[p] for peer p (1 to
// kMaxRails, the two ends of a pair listing as many; paths[rank] unused); the region and image are host memory.
// Throws InvalidArgument when rocenante was built without rdma-core's headers, Error when libibverbs.so.1 cannot
// be loaded or a device, port or GID is unusable.
std::unique_ptr<Wire> make_ibverbs_wire(int rank, const RegionLayout& layout,
                                        const std::vector<std::vector<IbPath>>& paths, Signal signal);
// ROCENANTE_NET=tcp, a test vehicle: every peer through TCP over loopback, as if it were on another host. Each
// delivery's segments are placed in random order, 16-bit half by half, so that a format relying on placement
// order or word atomicity fails its tests. The region and image are host memory.
std::unique_ptr<Wire> make_tcp_wire(int rank, const RegionLayout& layout, Signal signal);
// Maps host memory [host, host + bytes) for a kernel (CollectiveKernel::map_host, device/collective_kernel.h): its
// device address in `device_address`; the mapping lasts as long as the returned handle.
using MapHost = std::function<std::shared_ptr<void>(void* host, size_t bytes, void*& device_address)>;
// Drives `wire` from a proxy thread (proxy.cc): the transport that the reducer uses. `map_host` empty: the host
// loop reduces in host memory; else a kernel does, for which it maps the wire's region and image and the mailbox.
// `timeline`: timeline builds only (timeline.h), where the proxy records its events; else null. The reducers'
// calls are numbered from `first_epoch`. The proxy thread polls hot for `spin_s` after its last work (a core
// while it does), then naps between polls (proxy.cc).
std::unique_ptr<Transport> make_proxy(int rank, const RegionLayout& layout, uint32_t first_epoch,
                                      std::unique_ptr<Wire> wire, const MapHost& map_host, Timeline* timeline,
                                      double spin_s);
// How long a proxy polls hot by default (ROCENANTE_PROXY_SPIN_S): longer than any pause between a serving
// engine's decode steps, so that no call of one pays a thread's wake-up.
constexpr double kDefaultProxySpinS = 5.0;
constexpr double kMaxProxySpinS = 3600.0;  // the longest it may be asked for
// The magics at the head of the wires' handles (and of the TCP wire's hello), bumped when a format changes;
// exposed to tests by the bindings (rocenante._C.layout).
constexpr uint32_t kTcpHandleMagic = 0x52544331;   // "RTC1" (tcp.cc, TcpHandle)
constexpr uint32_t kTcpHelloMagic = 0x52544348;    // "RTCH" (tcp.cc, Hello)
constexpr uint32_t kRdmaHandleMagic = 0x52494231;  // "RIB1" (ibverbs.cc, HandleHeader)
// Whether make_ibverbs_wire was built (rdma-core's headers were found at build time).
extern const bool kWithIbverbs;

// The value of a Fault::kTransport word: a verbs completion status (enum ibv_wc_status, below 0x100), or one of
// these, for failures that produced no completion.
constexpr uint32_t kPostFailed = 0x100;    // ibv_post_send refused the write (the queue pair is in error)
constexpr uint32_t kPollFailed = 0x101;    // ibv_poll_cq failed
constexpr uint32_t kNoCompletion = 0x102;  // no completion within four times the retransmission budget
constexpr uint32_t kBadSignal = 0x103;     // a peer's delivery signal arrived out of sequence
constexpr uint32_t kConnectionClosed = 0x104;  // the TCP wire's connection ended (the peer closed or died)
constexpr uint32_t kUnacknowledged = 0x105;  // the TCP wire's peer host acknowledged nothing for kLivenessBudgetS
// A kTransport value in words, e.g. "transport retry counter exceeded (verbs status 12)" (proxy.cc); the
// verbs statuses and verbs-only values through verbs_status() (ibverbs.cc, or no_ibverbs.cc without rdma-core).
std::string transport_status(uint32_t status);
std::string verbs_status(uint32_t status);

}  // namespace rocenante
