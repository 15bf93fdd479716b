#include "communicator.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <thread>

#include "errors.h"
#include "fault.h"
#include "watchdog.h"

namespace rocenante {
namespace {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
  }
  return "?";
}
const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}
const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
    case Collective::kFusedAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kAllToAllV: return "all_to_all_v";
  }
  return "?";
}
// A call as the protocol sees it (a signature's fields), e.g. "all_reduce with 1024 x float32 (op sum)"; `count`
// counts the whole tensor (an all-gather's output, a reduce-scatter's or all-to-all's input).
std::string describe_call(size_t count, DType dtype, ReduceOp op, Collective collective = Collective::kAllReduce,
                          Algorithm algorithm = Algorithm::kOneShot) {
  if (collective == Collective::kAllToAllV)  // its count: the capacity of a block
    return std::string("all_to_all_v with blocks of at most ") + std::to_string(count) + " x " + dtype_name(dtype);
  std::string what = std::string(collective_name(collective)) + " with " + std::to_string(count) + " x " +
                     dtype_name(dtype);
  if (collective != Collective::kAllReduce && collective != Collective::kFusedAllReduce) what += " in all";
  if (collective == Collective::kAllGather || collective == Collective::kAllToAll) return what;
  return what + " (op " + op_name(op) +
         (collective == Collective::kFusedAllReduce ? ", fused with the residual add and RMSNorm)"
          : algorithm == Algorithm::kTwoShot       ? ", two-shot)"
                                                   : ")");
}
std::string describe_call(const CallArgs& a) { return describe_call(a.count, a.dtype, a.op, a.collective, a.algorithm); }

// What every rank must agree on before any line moves; sent in front of the transport's handle.
struct Config {
  uint32_t magic;
  uint32_t world;
  uint64_t capacity_bytes;
  int32_t on_gpu;
  uint32_t first_epoch;  // the number of the first call (1; near the wrap in tests of it)
  uint32_t signal;       // Signal (transport.h)
  uint32_t twoshot_from;  // all-reduces of at least this many bytes go two-shot (kNever: none)
};
static_assert(sizeof(Config) == 32, "Config travels as raw bytes: no implicit padding");
static_assert(sizeof(Config) == kConfigBytes, "communicator.h says where the identity starts");

Config config_of(int world, size_t capacity_bytes, int device, uint32_t first_epoch, Signal signal,
                 uint32_t twoshot_from) {
  return Config{kConfigMagic, uint32_t(world), capacity_bytes, device >= 0, first_epoch, uint32_t(signal), twoshot_from};
}

const char* signal_name(uint32_t signal) {
  switch (Signal(signal)) {
    case Signal::kFlag: return "flag";
    case Signal::kCompletion: return "completion";
    case Signal::kFlagFirst: return "flag first (a test's)";
  }
  return "?";
}

// A protocol magic as its four characters ("ROC2"), or in hex when they are not all printable.
std::string protocol_name(uint32_t magic) {
  std::string name;
  for (int shift = 24; shift >= 0; shift -= 8) name += char(magic >> shift);
  for (const char c : name)
    if (c < '!' || c > '~') {
      char hex[16];
      std::snprintf(hex, sizeof(hex), "0x%08x", magic);
      return hex;
    }
  return name;
}

static_assert(sizeof(ProcessIdentity) == 16, "ProcessIdentity travels as raw bytes: no implicit padding");
static_assert(sizeof(Config) + sizeof(ProcessIdentity) == kHandleHeaderBytes,
              "communicator.h says where the transport's part starts");

// Largest pid a Linux kernel hands out (PID_MAX_LIMIT on 64-bit).
constexpr int64_t kMaxPid = int64_t(1) << 22;

// Rank p's handle, as read from the store: anything may have written it, so every field is checked before
// it is used. Fills `peer` and returns the transport's part (which the transport checks in turn).
std::string parse_handle(int p, const std::string& handle, const Config& mine, ProcessIdentity& peer) {
  const std::string rank = "rank " + std::to_string(p);
  uint32_t magic = 0;
  if (handle.size() >= sizeof(magic)) std::memcpy(&magic, handle.data(), sizeof(magic));
  if (magic >> 8 != kConfigMagic >> 8)  // not even "ROC"
    ROCENANTE_THROW(Error, rank + " published a value of " + std::to_string(handle.size()) +
                               " bytes that is not a rocenante handle");
  if (magic != kConfigMagic)
    ROCENANTE_THROW(Error, rank + " runs another rocenante version (protocol " + protocol_name(magic) + ", this rank " +
                               protocol_name(kConfigMagic) + ")");
  if (handle.size() < sizeof(Config) + sizeof(ProcessIdentity))
    ROCENANTE_THROW(Error, rank + " published a truncated handle of " + std::to_string(handle.size()) + " bytes");
  Config theirs{};
  std::memcpy(&theirs, handle.data(), sizeof(theirs));
  if (theirs.first_epoch >= kEpochPeriod || (theirs.on_gpu != 0 && theirs.on_gpu != 1) ||
      theirs.signal > uint32_t(Signal::kFlagFirst))
    ROCENANTE_THROW(Error, rank + " published a malformed configuration");
  const auto describe = [](const Config& c) {
    return "world " + std::to_string(c.world) + ", capacity " + std::to_string(c.capacity_bytes) + " bytes, " +
           (c.on_gpu ? "GPU" : "CPU") + ", first call " + std::to_string(c.first_epoch) + ", network signal " +
           signal_name(c.signal) + ", two-shot " +
           (c.twoshot_from == Communicator::kNever ? std::string("never") : "from " + std::to_string(c.twoshot_from) + " bytes");
  };
  if (std::memcmp(&theirs, &mine, sizeof(Config)) != 0)
    ROCENANTE_THROW(Error, rank + " is configured differently: " + describe(theirs) + "; this rank: " + describe(mine));
  std::memcpy(&peer, handle.data() + sizeof(Config), sizeof(ProcessIdentity));
  if (peer.pid <= 0 || peer.pid > kMaxPid)
    ROCENANTE_THROW(Error, rank + " published an impossible process id " + std::to_string(peer.pid));
  return handle.substr(sizeof(Config) + sizeof(ProcessIdentity));
}

// The root cause a peer's abort word carries (abort_cause()).
std::string abort_reason(uint32_t cause) {
  const uint32_t detail = cause & 0xFFFFFFu;
  const std::string peer = std::to_string(detail);
  switch (Fault(cause >> 24)) {
    case Fault::kPeerTimeout: {
      std::string missing;
      for (int p = 0; p < kMaxRanks; ++p)
        if (detail & (1u << p)) missing += (missing.empty() ? "" : " ") + std::to_string(p);
      return "a wait for rank(s) " + missing + " timed out";
    }
    case Fault::kCallMismatch: return "rank " + peer + " made a different call";
    case Fault::kPeerExited: return "rank " + peer + "'s process ended";
    case Fault::kRefused: return "rank " + peer + " refused a call for a reason only it could see";
    case Fault::kLaunchFailed: return "rank " + peer + " could not launch a call";
    case Fault::kInterrupted: return "rank " + peer + " was interrupted by a signal";
    case Fault::kTransport: {
      const int who = cause_rank(detail);
      return (who < 0 ? std::string("its") : "rank " + std::to_string(who) + "'s") + " network path to rank " +
             std::to_string(cause_peer(detail)) + " failed";
    }
    case Fault::kPeerClosed: return "rank " + peer + " had closed its communicator";
    case Fault::kSplitMismatch:
      return "rank " + std::to_string(cause_rank(detail)) + " received from rank " +
             std::to_string(cause_peer(detail)) +
             " a block of a size it did not expect (a split all-to-all's splits disagree)";
    case Fault::kBadSplits:
      return "rank " + std::to_string(cause_rank(detail)) + "'s split counts for rank " +
             std::to_string(cause_peer(detail)) + " could not be sent";
    case Fault::kPeerAborted:  // never a root cause (abort_from)
    case Fault::kPeersExited:  // never recorded (abort_seen), as kGoodbye
    case Fault::kGoodbye:
    case Fault::kNone: break;
  }
  return "unknown cause " + std::to_string(cause);
}

// Open GPU communicators of this process, per device, for the timeout's message: two communicators whose calls
// reach one GPU in different orders on different ranks can wait for each other (docs/guarantees.md).
constexpr int kMaxDevices = 64;
struct GpuCommunicators {
  std::mutex mutex;
  int open[kMaxDevices] = {};
};
std::atomic<GpuCommunicators*> gpu_communicators{new GpuCommunicators};

// Forks this process has been the child of, counted by a pthread_atfork handler: a communicator compares it
// with the count at its creation to tell that it is now in a child of the process that created it. The child
// also counts no GPU communicator (its parent's are not its own) under a fresh mutex (a parent thread may have
// held the copied one at the fork); the copy is left as it is.
std::atomic<uint32_t> forks_seen{0};
const bool fork_handler_installed = [] {
  return pthread_atfork(nullptr, nullptr, [] {
           forks_seen.fetch_add(1, std::memory_order_relaxed);
           gpu_communicators.store(new GpuCommunicators, std::memory_order_relaxed);
         }) == 0;
}();

}  // namespace

InterruptCheck Communicator::interrupt_check_ = nullptr;
std::atomic<bool> Communicator::skip_goodbyes_{false};

void Communicator::count_on_device(int delta) {
  if (device_ < 0 || device_ >= kMaxDevices) return;
  GpuCommunicators& g = *gpu_communicators.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g.mutex);
  g.open[device_] += delta;
}

bool Communicator::shares_device() const {
  if (device_ < 0 || device_ >= kMaxDevices) return false;
  GpuCommunicators& g = *gpu_communicators.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g.mutex);
  return g.open[device_] > 1;
}

bool Communicator::in_forked_child() const { return forks_seen.load(std::memory_order_relaxed) != forks_at_creation_; }

void Communicator::refuse_in_forked_child() const {
  if (in_forked_child())
    ROCENANTE_THROW(Error, "rank " + std::to_string(rank_) + ": this communicator belongs to process " +
                               std::to_string(creator_pid_) + ", which created it; process " +
                               std::to_string(getpid()) + " is a fork of it and cannot use it (build a communicator in "
                               "the child instead)");
}

Communicator::Communicator(int rank, int world, int device, size_t capacity_bytes, double timeout_s, OnFault on_fault,
                           Net net, const std::vector<std::vector<IbPath>>& rdma_paths, uint32_t first_epoch, double proxy_spin_s,
                           Signal signal, uint32_t twoshot_from)
    : rank_(rank), world_(world), device_(device), timeout_s_(std::min(timeout_s, kMaxTimeoutS)), on_fault_(on_fault),
      layout_{capacity_bytes, world}, first_epoch_(first_epoch), signal_(net == Net::kShm ? Signal::kFlag : signal),
      twoshot_from_(twoshot_from),
      issued_(previous_epoch(first_epoch < kEpochPeriod ? first_epoch : 0)), launched_(first_epoch),
      peer_processes_(world), creator_pid_(getpid()),
      forks_at_creation_(forks_seen.load(std::memory_order_relaxed)) {
  if (!fork_handler_installed) ROCENANTE_THROW(Error, "pthread_atfork failed: forked children could not be told apart");
  if (world < 1 || world > kMaxRanks)
    ROCENANTE_THROW(InvalidArgument, "world size " + std::to_string(world) + " is outside 1.." + std::to_string(kMaxRanks));
  if (rank < 0 || rank >= world)
    ROCENANTE_THROW(InvalidArgument, "rank " + std::to_string(rank) + " is outside 0.." + std::to_string(world - 1));
  if (capacity_bytes == 0 || capacity_bytes % kCapacityGranule != 0 || capacity_bytes > kMaxCapacityBytes)
    ROCENANTE_THROW(InvalidArgument, "capacity " + std::to_string(capacity_bytes) + " bytes must be a positive multiple of " +
                                         std::to_string(kCapacityGranule) + " up to " + std::to_string(kMaxCapacityBytes));
  if (std::isnan(timeout_s)) ROCENANTE_THROW(InvalidArgument, "timeout is NaN");
  if (!(timeout_s > 0)) ROCENANTE_THROW(InvalidArgument, "timeout must be positive, got " + std::to_string(timeout_s));
  if (!(proxy_spin_s >= 0 && proxy_spin_s <= kMaxProxySpinS))
    ROCENANTE_THROW(InvalidArgument, "proxy spin must lie in 0.." + std::to_string(int(kMaxProxySpinS)) + " s, got " +
                                         std::to_string(proxy_spin_s));
  if (on_fault != OnFault::kRaise && on_fault != OnFault::kAbort)
    ROCENANTE_THROW(InvalidArgument, "unknown fault policy " + std::to_string(uint32_t(on_fault)));
  if (first_epoch >= kEpochPeriod)
    ROCENANTE_THROW(InvalidArgument, "first call " + std::to_string(first_epoch) + " is outside 0.." +
                                         std::to_string(kEpochPeriod - 1));
  if (net != Net::kShm && net != Net::kIb && net != Net::kTcp)
    ROCENANTE_THROW(InvalidArgument, "unknown network " + std::to_string(uint32_t(net)));
  if (signal != Signal::kFlag && signal != Signal::kCompletion && signal != Signal::kFlagFirst)
    ROCENANTE_THROW(InvalidArgument, "unknown network signal " + std::to_string(uint32_t(signal)));
  if (device_ >= 0) kernel_ = make_collective_kernel(device_, world_, first_epoch_);
  if constexpr (kTimeline) {
    timeline_ = std::make_shared<Timeline>();
    void* address = nullptr;
    if (kernel_) timeline_mapping_ = kernel_->map_host(timeline_.get(), sizeof(Timeline), address);
    reducer_timeline_ = kernel_ ? static_cast<Timeline*>(address) : timeline_.get();
  }
  if (net == Net::kShm) {
    transport_ = device_ < 0 ? make_shm_transport(rank, layout_) : make_cuda_ipc_transport(rank, device_, layout_);
  } else {
    std::unique_ptr<Wire> wire = net == Net::kIb ? make_ibverbs_wire(rank, layout_, rdma_paths, signal_)
                                                 : make_tcp_wire(rank, layout_, signal_);
    MapHost map_host;  // empty: the host loop reduces
    if (kernel_ != nullptr)
      map_host = [kernel = kernel_.get()](void* host, size_t bytes, void*& address) {
        return kernel->map_host(host, bytes, address);
      };
    transport_ = make_proxy(rank, layout_, first_epoch_, std::move(wire), map_host, timeline_.get(), proxy_spin_s);
    network_ = ((1u << world) - 1) & ~(1u << rank);
  }
  // Every direct peer's region is stored to; the network peers share one image, in which this rank's area has
  // one offset for the peers below it and one for those above (layout.h): one store each is enough.
  bool below = false, above = false;
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    bool& first = p < rank ? below : above;
    if (!(network_ & (1u << p)) || !first) stores_ |= 1u << p;
    if (network_ & (1u << p)) first = true;
  }
  if (kernel_ != nullptr) count_on_device(+1);  // undone by close()
}

Communicator::~Communicator() { close(); }

std::string Communicator::local_handle() const {
  if (transport_ == nullptr) ROCENANTE_THROW(Closed, "communicator is closed");
  const Config c = config_of(world_, layout_.capacity_bytes, device_, first_epoch_, signal_, twoshot_from_);
  const ProcessIdentity me = this_process();
  return std::string(reinterpret_cast<const char*>(&c), sizeof(c)) +
         std::string(reinterpret_cast<const char*>(&me), sizeof(me)) + transport_->local_handle();
}

void Communicator::connect(const std::vector<std::string>& handles) {
  if (transport_ == nullptr) ROCENANTE_THROW(Closed, "communicator is closed");
  if (int(handles.size()) != world_)
    ROCENANTE_THROW(InvalidArgument, "expected " + std::to_string(world_) + " handles, got " + std::to_string(handles.size()));
  const Config mine = config_of(world_, layout_.capacity_bytes, device_, first_epoch_, signal_, twoshot_from_);
  std::vector<std::string> transport_handles(world_);
  std::vector<ProcessIdentity> peers(world_);
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ && handles[p] != local_handle())
      ROCENANTE_THROW(Error, "rank " + std::to_string(p) + ": the store holds another handle under this rank's key");
    transport_handles[p] = parse_handle(p, handles[p], mine, peers[p]);
    for (int q = 0; q < p; ++q)
      if (transport_handles[q] == transport_handles[p])
        ROCENANTE_THROW(Error, "rank " + std::to_string(p) + " published the same region as rank " + std::to_string(q));
  }
  transport_->connect(transport_handles);
  for (int p = 0; p < world_; ++p)
    if (p != rank_) peer_processes_.watch(p, peers[p]);
}

void Communicator::all_connected() {
  if (transport_ == nullptr) ROCENANTE_THROW(Closed, "communicator is closed");
  transport_->all_connected();
  Watchdog::add(this);
}

// Refusals every rank makes alike: the call's dtype and op are the same on every rank (or the ranks' calls
// mismatch, which the protocol reports), so refusing leaves the communicator usable.
void Communicator::validate_shared(DType dtype, ReduceOp op) const {
  if (uint32_t(dtype) >= kNumDTypes) ROCENANTE_THROW(InvalidArgument, "unsupported dtype code " + std::to_string(uint32_t(dtype)));
  if (uint32_t(op) >= kNumOps) ROCENANTE_THROW(InvalidArgument, "unsupported op code " + std::to_string(uint32_t(op)));
  if (dtype == DType::kInt32 && op == ReduceOp::kAvg) ROCENANTE_THROW(InvalidArgument, "op avg is not defined for int32");
}

// What only this rank can see about its call; nullptr when the pointers are fine. The output may overlap the
// input only where it is the same memory: an all-reduce or all-to-all in place, an all-gather whose input is this
// rank's shard of the output, a reduce-scatter whose output is this rank's shard of the input.
const char* Communicator::validate_local(Collective c, uintptr_t in, uintptr_t out, size_t count, DType dtype) const {
  const size_t esize = dtype_size(dtype);
  const size_t shard = count * esize;  // bytes of a rank's part: the whole tensor for an all-reduce
  const size_t in_bytes = c == Collective::kReduceScatter || c == Collective::kAllToAll ? shard * world_ : shard;
  const size_t out_bytes = c == Collective::kAllGather || c == Collective::kAllToAll ? shard * world_ : shard;
  if (in == 0 || out == 0) return "null input or output pointer";
  if (in % esize != 0 || out % esize != 0) return "input and output must be aligned to their element size";
  const bool same = c == Collective::kAllGather       ? in == out + rank_ * shard
                    : c == Collective::kReduceScatter ? out == in + rank_ * shard
                                                      : in == out;
  if (!same && in < out + out_bytes && out < in + in_bytes)
    return c == Collective::kAllReduce || c == Collective::kAllToAll
               ? "input and output overlap without being the same buffer"
               : "input and output overlap other than where this rank's shard lies";
  return nullptr;
}

CallArgs Communicator::call_args(DType dtype, ReduceOp op) const {
  CallArgs a{};
  a.dtype = dtype;
  a.op = op;
  a.rank = rank_;
  a.world = world_;
  a.layout = layout_;
  a.local = transport_->local_region();
  for (int p = 0; p < world_; ++p) a.peer[p] = p == rank_ ? nullptr : transport_->peer_region(p);
  a.network = network_;
  a.stores = stores_;
  a.mailbox = transport_->mailbox();
  a.arrivals = transport_->arrivals();
  a.timeline = reducer_timeline_;
  a.timeout_ns = uint64_t(timeout_s_ * 1e9);
  return a;
}

// Every call starts here, under issue_: what ends it before anything is issued (closed, faulted, a refusal
// every rank makes alike) leaves the call numbers as they were.
void Communicator::check_issuable(DType dtype, ReduceOp op) {
  if (transport_ == nullptr) ROCENANTE_THROW(Closed, "communicator is closed");
  if (const uint64_t fault = current_fault()) fail(fault, "");
  validate_shared(dtype, op);
}

// One piece, under issue_: takes the next call numbers (calls_of(): one, or two for a network two-shot piece; `epoch`
// the last), then launches the kernel (GPU) or runs the host loop (CPU: the fault it met, else 0). Once the numbers
// are taken the peers count the calls as made, so anything that stops them from going out faults the communicator
// and tells them: else this rank's next call would pair with their call of this number, silently where the two
// look alike.
uint64_t Communicator::issue(const CallArgs& a, uintptr_t stream, uint32_t& epoch) {
  const uint32_t first = next_epoch(issued_);
  epoch = calls_of(a) == 2 ? next_epoch(first) : first;
  issued_ = epoch;
  try {
    if (kernel_ == nullptr) {
      const uint64_t fault = host_collective(a, first, reset_footprint_, interrupt_check_);
      reset_footprint_ = footprint_of(a);
      return fault;
    }
    if (kernel_->launch(a, stream)) captured_ = true;
    launched_ = next_epoch(epoch);
    return 0;
  } catch (const std::exception& err) {
    abort_call(encode_fault(Fault::kLaunchFailed, rank_, 0), epoch,
               "could not launch " + describe_call(a) + ": " + err.what());
  }
}

Algorithm Communicator::algorithm_for(size_t bytes) const {
  return bytes >= twoshot_from_ ? Algorithm::kTwoShot : Algorithm::kOneShot;
}

uint32_t Communicator::all_reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, uintptr_t stream) {
  return call(Collective::kAllReduce, in, out, count, dtype, op, stream);
}

uint32_t Communicator::all_gather(uintptr_t in, uintptr_t out, size_t count, DType dtype, uintptr_t stream) {
  return call(Collective::kAllGather, in, out, count, dtype, ReduceOp::kSum, stream);
}

uint32_t Communicator::reduce_scatter(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op,
                                      uintptr_t stream) {
  return call(Collective::kReduceScatter, in, out, count, dtype, op, stream);
}

uint32_t Communicator::all_to_all(uintptr_t in, uintptr_t out, size_t count, DType dtype, uintptr_t stream) {
  return call(Collective::kAllToAll, in, out, count, dtype, ReduceOp::kSum, stream);
}

uint32_t Communicator::all_to_all_v(uintptr_t in, uintptr_t out, DType dtype, const std::vector<size_t>& send,
                                    const std::vector<size_t>& recv, uintptr_t stream) {
  refuse_in_forked_child();
  std::unique_lock<std::mutex> lock(issue_);
  poison_if_stopped(out, dtype, std::accumulate(recv.begin(), recv.end(), size_t(0)), 0);
  check_issuable(dtype, ReduceOp::kSum);
  CallArgs a = call_args(dtype, ReduceOp::kSum);
  Blocks& b = a.blocks;
  b.capacity = uint32_t(largest_block(layout_.capacity_bytes, world_, dtype));
  const std::string what = describe_call(b.capacity, dtype, ReduceOp::kSum, Collective::kAllToAllV);
  const char* why = int(send.size()) != world_ || int(recv.size()) != world_ ? "a split list of another length than the world"
                    : send[rank_] != recv[rank_] ? "its own block's input and output splits differ"
                                                 : nullptr;
  size_t in_elems = 0, out_elems = 0;
  std::string too_large;
  for (int t = 0; why == nullptr && t < world_; ++t) {
    if (too_large.empty() && (send[t] > b.capacity || recv[t] > b.capacity))
      too_large = "a block of " + std::to_string(std::max(send[t], recv[t])) + " elements (to or from rank " +
                  std::to_string(t) + ") is larger than a block can be with ROCENANTE_CAPACITY_BYTES=" +
                  std::to_string(layout_.capacity_bytes) + " at this world size";
    b.send[t] = uint32_t(send[t]), b.send_offset[t] = uint32_t(in_elems);
    b.recv[t] = uint32_t(recv[t]), b.recv_offset[t] = uint32_t(out_elems);
    in_elems += send[t], out_elems += recv[t];
    b.sent_chunks = std::max<uint32_t>(b.sent_chunks, 1 + block_chunks(send[t] * dtype_size(dtype)));
    b.received_chunks = std::max<uint32_t>(b.received_chunks, 1 + block_chunks(recv[t] * dtype_size(dtype)));
  }
  if (why == nullptr) why = validate_blocks(in, out, in_elems, out_elems, dtype);
  if (why == nullptr && !too_large.empty()) {
    if (kernel_ == nullptr) poison_host(reinterpret_cast<void*>(out), out_elems * dtype_size(dtype), dtype);
    why = too_large.c_str();
  }
  if (why != nullptr) {
    lock.unlock();
    refuse(what + ": " + why);
  }
  return call_blocks(a, in, out, dtype, stream, what);
}

uint32_t Communicator::all_to_all_v_counts(uintptr_t in, uintptr_t out, DType dtype, uintptr_t send_counts,
                                           uintptr_t recv_counts, size_t row, size_t in_rows, size_t capacity_rows,
                                           uintptr_t stream) {
  refuse_in_forked_child();
  std::unique_lock<std::mutex> lock(issue_);
  poison_if_stopped(out, dtype, world_ * capacity_rows * row, recv_counts);
  check_issuable(dtype, ReduceOp::kSum);
  const size_t largest = largest_block(layout_.capacity_bytes, world_, dtype);
  if (row == 0 || capacity_rows == 0 || capacity_rows * row > largest)  // what every rank's call shares
    ROCENANTE_THROW(InvalidArgument, "all_to_all_v of " + std::to_string(capacity_rows) + " rows of " +
                                         std::to_string(row) + " x " + dtype_name(dtype) +
                                         " a block: a block holds 1 to " + std::to_string(largest) +
                                         " elements with ROCENANTE_CAPACITY_BYTES=" +
                                         std::to_string(layout_.capacity_bytes) + " at this world size");
  CallArgs a = call_args(dtype, ReduceOp::kSum);
  Blocks& b = a.blocks;
  b.send_counts = reinterpret_cast<const int64_t*>(send_counts);
  b.recv_counts = reinterpret_cast<int64_t*>(recv_counts);
  b.row = uint32_t(row), b.in_rows = uint32_t(in_rows), b.capacity = uint32_t(capacity_rows * row);
  b.sent_chunks = b.received_chunks = uint32_t(size_t(1) << blocks_slot_log2(b.capacity, dtype));
  const std::string what = describe_call(b.capacity, dtype, ReduceOp::kSum, Collective::kAllToAllV);
  const char* why = send_counts == 0 || recv_counts == 0 || send_counts % 8 != 0 || recv_counts % 8 != 0
                        ? "null or misaligned split counts"
                        : validate_blocks(in, out, in_rows * row, world_ * b.capacity, dtype);
  if (why != nullptr) {
    lock.unlock();
    refuse(what + ": " + why);
  }
  return call_blocks(a, in, out, dtype, stream, what);
}

// A CPU split all-to-all that a known fault stops before it starts computes nothing: its output (`out_elems`) is
// poisoned and its counts (if any) set to -1, as a faulted call leaves them (the GPU's are the kernel's to poison).
void Communicator::poison_if_stopped(uintptr_t out, DType dtype, size_t out_elems, uintptr_t recv_counts) {
  if (kernel_ != nullptr || uint32_t(dtype) >= kNumDTypes || current_fault() == 0) return;
  if (out != 0 && out % dtype_size(dtype) == 0) poison_host(reinterpret_cast<void*>(out), out_elems * dtype_size(dtype), dtype);
  if (recv_counts != 0 && recv_counts % 8 == 0) std::fill_n(reinterpret_cast<int64_t*>(recv_counts), world_, int64_t(-1));
}

// What only this rank can see about a split all-to-all's tensors; nullptr when they are fine. Its input and
// output never share memory (their blocks lie at different places).
const char* Communicator::validate_blocks(uintptr_t in, uintptr_t out, size_t in_elems, size_t out_elems,
                                          DType dtype) const {
  const size_t esize = dtype_size(dtype);
  if ((in == 0 && in_elems != 0) || (out == 0 && out_elems != 0)) return "null input or output pointer";
  if (in % esize != 0 || out % esize != 0) return "input and output must be aligned to their element size";
  if (in < out + out_elems * esize && out < in + in_elems * esize) return "input and output overlap";
  return nullptr;
}

// A split all-to-all, one call of one piece (its blocks fit one; layout.h, kAllToAllV), under issue_.
uint32_t Communicator::call_blocks(CallArgs& a, uintptr_t in, uintptr_t out, DType dtype, uintptr_t stream,
                                   const std::string& what) {
  a.collective = Collective::kAllToAllV;
  a.algorithm = Algorithm::kOneShot;
  a.in = reinterpret_cast<const void*>(in);
  a.out = reinterpret_cast<void*>(out);
  a.blocks.slot_log2 = blocks_slot_log2(a.blocks.capacity, dtype);
  a.signature = call_signature(a.blocks.capacity, dtype, ReduceOp::kSum, Collective::kAllToAllV);
  uint32_t epoch = 0;
  if (const uint64_t fault = issue(a, stream, epoch)) {  // the host loop poisoned the output (host_call())
    if (record(fault, epoch)) tell_peers(fault, epoch);
    fail(fault_.load(), what);
  }
  return epoch;
}

uint32_t Communicator::call(Collective c, uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op,
                            uintptr_t stream) {
  refuse_in_forked_child();  // before the lock, which a thread that did not fork may have held
  std::unique_lock<std::mutex> lock(issue_);
  const size_t esize = uint32_t(dtype) < kNumDTypes ? dtype_size(dtype) : 0;
  const bool moves_bits = c == Collective::kAllGather || c == Collective::kAllToAll;  // its op field is sum
  const size_t out_bytes = count * esize * (moves_bits ? world_ : 1);
  // A CPU call that a known fault stops before it starts computes nothing: its output is poisoned, as a faulted
  // call's is (a GPU call's output is the kernel's to poison, and no kernel is launched).
  if (kernel_ == nullptr && esize != 0 && count > 0 && current_fault() != 0 &&
      validate_local(c, in, out, count, dtype) == nullptr)
    poison_host(reinterpret_cast<void*>(out), out_bytes, dtype);
  check_issuable(dtype, op);
  if (count == 0) return issued_;  // nothing issued: it completes with the call before
  CallArgs a = call_args(dtype, op);
  a.collective = c;
  a.algorithm = c == Collective::kAllReduce ? algorithm_for(count * esize) : Algorithm::kOneShot;
  const std::string what = describe_call(count * (c == Collective::kAllReduce ? 1 : world_), dtype, op, c, a.algorithm);
  if (const char* why = validate_local(c, in, out, count, dtype)) {
    lock.unlock();
    refuse(what + ": " + why);
  }

  // A call larger than one area goes as pieces, each one call of the protocol with its own epoch (over the network
  // a two-shot piece is two: calls_of()). A one-shot piece is a multiple of 512 bytes, so every piece keeps the
  // caller's alignment; a sharded call's pieces take the same part of every shard (of a two-shot call: consecutive
  // parts of the tensor).
  const bool one_shot = c == Collective::kAllReduce && a.algorithm == Algorithm::kOneShot;
  const Format format = format_of(a);
  const size_t slot = max_slot_chunks(layout_.capacity_bytes, world_, format) * kChunkBytes / esize;  // elements
  const size_t piece = one_shot ? piece_bytes(layout_.capacity_bytes, dtype) / esize
                       : c == Collective::kAllReduce ? slot * world_
                                                     : slot;  // of each shard
  const size_t per_piece_shards = c == Collective::kAllReduce ? 1 : world_;
  uint32_t epoch = 0;
  for (size_t first = 0; first < count; first += piece) {
    const size_t n = std::min(piece, count - first);
    a.count = n * per_piece_shards;
    a.bytes = a.count * esize;
    a.in = reinterpret_cast<const char*>(in) + first * esize;
    a.out = reinterpret_cast<char*>(out) + first * esize;
    if (c != Collective::kAllReduce) {  // reduce-scatter, all-gather, all-to-all: the same n elements of every shard
      a.shards = even_shards(n * esize, world_);
      a.stride_bytes = count * esize;
    } else if (!one_shot) {  // two-shot: this piece cut into shards
      a.shards = two_shot_shards(a.bytes, world_);
      a.stride_bytes = a.shards.shard_bytes;
    }
    a.signature = call_signature(a.count, dtype, moves_bits ? ReduceOp::kSum : op, c, a.algorithm);
    const uint64_t fault = issue(a, stream, epoch);
    if (fault == 0) continue;
    // The host loop met a fault: poison what later pieces would have computed, as it did for the rest of this one
    // (a sharded call: its whole output).
    if (one_shot)
      poison_host(reinterpret_cast<char*>(out) + (first + n) * esize, (count - first - n) * esize, dtype);
    else
      poison_host(reinterpret_cast<void*>(out), out_bytes, dtype);
    if (record(fault, epoch)) tell_peers(fault, epoch);
    fail(fault_.load(), what);
  }
  return epoch;
}

bool Communicator::fuses_add_rmsnorm(size_t count, size_t hidden, DType dtype) const {
  return kernel_ != nullptr && uint32_t(dtype) < kNumDTypes &&
         rocenante::fuses_add_rmsnorm(count, hidden, dtype, piece_bytes(layout_.capacity_bytes, dtype));
}

// What only this rank can see about a fused call; nullptr when the pointers are fine. Each thread of the
// kernel reads its chunks of the input and residual_in before it writes the same chunks of the outputs, and
// every thread reads all of gamma: so an output may be the input or residual_in, or the other output, but
// must not overlap anything else.
const char* Communicator::validate_fused(uintptr_t in, uintptr_t residual_in, uintptr_t gamma, uintptr_t residual_out,
                                         uintptr_t norm_out, size_t count, size_t hidden, DType dtype) const {
  const size_t esize = dtype_size(dtype);
  const size_t bytes = count * esize;
  struct Span {
    uintptr_t begin;
    size_t bytes;
  };
  const Span spans[] = {{in, bytes}, {residual_in, bytes}, {gamma, hidden * esize}, {residual_out, bytes},
                        {norm_out, bytes}};
  for (const Span& t : spans) {
    if (t.begin == 0) return "a null pointer among input, residual_in, gamma, residual_out and norm_out";
    if (t.begin % esize != 0) return "input, residual_in, gamma, residual_out and norm_out must be aligned to their element size";
  }
  const auto overlap = [](const Span& x, const Span& y) { return x.begin < y.begin + y.bytes && y.begin < x.begin + x.bytes; };
  for (const Span& out : {spans[3], spans[4]}) {
    for (const Span& other : {spans[0], spans[1], spans[3], spans[4]})
      if (other.begin != out.begin && overlap(out, other))
        return "an output overlaps the input, residual_in or the other output without being the same buffer";
    if (overlap(out, spans[2])) return "an output overlaps gamma";
  }
  return nullptr;
}

uint32_t Communicator::all_reduce_add_rmsnorm(uintptr_t in, uintptr_t residual_in, uintptr_t gamma,
                                              uintptr_t residual_out, uintptr_t norm_out, size_t count,
                                              size_t hidden, DType dtype, float eps, float weight_bias,
                                              uintptr_t stream) {
  refuse_in_forked_child();
  std::unique_lock<std::mutex> lock(issue_);
  check_issuable(dtype, ReduceOp::kSum);
  // The same refusal on every rank (their calls share count, hidden and dtype, or mismatch): still usable.
  if (!fuses_add_rmsnorm(count, hidden, dtype))
    ROCENANTE_THROW(InvalidArgument,
                    describe_call(count, dtype, ReduceOp::kSum, Collective::kFusedAllReduce) + " in rows of " +
                        std::to_string(hidden) +
                        ": not fused here (fused: GPU, a float dtype, rows of a multiple of 16 bytes up to " +
                        std::to_string(kThreads * kMaxRowChunks * kChunkBytes) + ", one piece of at most " +
                        std::to_string(layout_.capacity_bytes) + " bytes)");
  if (const char* why = validate_fused(in, residual_in, gamma, residual_out, norm_out, count, hidden, dtype)) {
    lock.unlock();
    refuse(describe_call(count, dtype, ReduceOp::kSum, Collective::kFusedAllReduce) + ": " + why);
  }

  CallArgs a = call_args(dtype, ReduceOp::kSum);
  a.count = count;
  a.bytes = count * dtype_size(dtype);
  a.in = reinterpret_cast<const void*>(in);
  a.collective = Collective::kFusedAllReduce;
  a.signature = call_signature(count, dtype, ReduceOp::kSum, Collective::kFusedAllReduce);
  a.norm = RowNorm{reinterpret_cast<const void*>(residual_in), reinterpret_cast<void*>(residual_out),
                   reinterpret_cast<void*>(norm_out), reinterpret_cast<const void*>(gamma), eps, weight_bias,
                   uint32_t(hidden)};
  uint32_t epoch = 0;
  issue(a, stream, epoch);  // a kernel's fault is raised by a later call: only the host loop returns one
  return epoch;
}

void Communicator::refuse(const std::string& why) {
  refuse_in_forked_child();
  std::lock_guard<std::mutex> lock(issue_);
  if (transport_ == nullptr) ROCENANTE_THROW(Closed, "communicator is closed");
  abort_call(encode_fault(Fault::kRefused, rank_, 0), next_epoch(issued_) /* the call the peers are making */,
             "refused " + why);
}

void Communicator::abort_call(uint64_t fault, uint32_t epoch, const std::string& why) {
  const std::string words = "rank " + std::to_string(rank_) + ": call " + std::to_string(epoch) + ": " + why +
                            "; the peers had already started this call, so the communicator is closed and they "
                            "were told";
  if (record(fault, epoch, words)) {
    tell_peers(fault, epoch);
    transport_->post_abort(rank_, fault);  // our own kernels stop too (a graph may replay an earlier call)
  }
  fail(fault_.load(), "");
}

void Communicator::check() {
  refuse_in_forked_child();
  std::shared_lock<std::shared_mutex> alive(lifetime_);
  if (const uint64_t fault = current_fault()) fail(fault, "");
}

bool Communicator::faulted_by(uint32_t call) {
  std::shared_lock<std::shared_mutex> alive(lifetime_);
  return current_fault() != 0 && (captured_ || epoch_at_or_before(fault_epoch_.load(), call));
}

bool Communicator::stream_done(uintptr_t stream) const {
  std::shared_lock<std::shared_mutex> alive(lifetime_);
  if (transport_ == nullptr) return true;
  if (kernel_ == nullptr) ROCENANTE_THROW(InvalidArgument, "a CPU communicator has no streams");
  return kernel_->stream_done(stream);
}

bool Communicator::record(uint64_t fault, uint32_t epoch, const std::string& words) {
  std::lock_guard<std::mutex> lock(recording_);
  if (fault_.load() != 0) return false;
  message_ = words;
  fault_epoch_.store(epoch);
  fault_.store(fault);  // last: a reader that sees the word sees the epoch
  return true;
}

std::string Communicator::message(const std::string& this_call) {
  std::lock_guard<std::mutex> lock(recording_);
  if (message_.empty()) message_ = describe(fault_.load(), fault_epoch_.load(), this_call);
  return message_;
}

uint64_t Communicator::current_fault() {
  if (const uint64_t f = fault_.load()) return f;
  if (kernel_ == nullptr) {
    // CPU: a peer's fault reaches this rank's region as an abort word, which a call whose data had all arrived
    // did not read. Every later call and check() read it here, so that no rank goes on past a peer's fault.
    if (transport_ == nullptr) return 0;
    CallArgs a{};
    a.rank = rank_;
    a.world = world_;
    a.local = transport_->local_region();
    // Waits for no one: ended peers (kPeersExited) and goodbyes (kGoodbye) are no fault by themselves.
    const uint32_t nobody = 0, next = next_epoch(issued_);
    if (const uint64_t f = abort_seen(a, next, nobody, [](uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }))
      record(f, next);  // seen before this rank's next call
    return fault_.load();
  }
  const FaultRecord r = kernel_->fault();
  // The kernel told its direct peers (abort words over NVLink); network peers hear it from here.
  if (r.word != 0 && record(r.word, r.epoch) && network_ != 0) tell_peers(r.word, r.epoch);
  return fault_.load();
}

void Communicator::tell_peers(uint64_t fault, uint32_t epoch) {
  for (int p = 0; p < world_; ++p)
    if (p != rank_) transport_->post_abort(p, abort_from(fault, epoch, rank_));
}

void Communicator::test_post_aborts_at_once(double hold_s) {
  std::shared_lock<std::shared_mutex> alive(lifetime_);
  if (transport_ == nullptr) return;
  hold_abort_staging(hold_s);
  std::vector<std::thread> posts;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    posts.emplace_back([this, p] { transport_->post_abort(p, encode_fault(Fault::kTransport, p, next_epoch(issued_))); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::thread& t : posts) t.join();
  hold_abort_staging(0);
}

void Communicator::report(const std::string& what) {
  if (reported_.exchange(true)) return;
  std::fprintf(stderr, "rocenante: %s\n", what.c_str());
  std::fflush(stderr);
  if (on_fault_ == OnFault::kAbort) {
    std::fprintf(stderr, "rocenante: rank %d: ROCENANTE_ON_FAULT=abort: ending the process\n", rank_);
    std::fflush(stderr);
    std::abort();
  }
}

void Communicator::watch() {
  std::shared_lock<std::shared_mutex> alive(lifetime_);
  if (transport_ == nullptr) return;
  const uint32_t ended = peer_processes_.ended();
  for (int p = 0; p < world_; ++p) {
    if (!(ended & (1u << p))) continue;
    // Not a fault yet: a peer may end after its last call. Every wait for it from now on stops and faults;
    // waits for the other peers go on. Not over a fault of this rank's own, which says more.
    exited_ |= 1u << p;
    if (fault_.load() == 0) transport_->post_abort(rank_, encode_fault(Fault::kPeersExited, exited_, 0));
  }
  if (kernel_ == nullptr) return;  // CPU faults are reported by the call that meets them
  if (current_fault() != 0) report(message(""));
}

std::string Communicator::describe(uint64_t fault, uint32_t epoch, const std::string& this_call) const {
  const std::string where = "rank " + std::to_string(rank_) + ": call " + std::to_string(epoch) + ": ";
  const std::string closed = "; the communicator is closed";
  const uint32_t detail = fault_detail(fault);
  switch (fault_kind(fault)) {
    case Fault::kPeerTimeout: {
      char seconds[32];
      std::snprintf(seconds, sizeof(seconds), "%g", timeout_s_);
      std::string missing;
      for (int p = 0; p < world_; ++p)
        if (detail & (1u << p)) missing += " " + std::to_string(p);
      const std::string hint =
          !shares_device() ? "" : " (another communicator of this process is open on cuda:" + std::to_string(device_) +
                                      ": if the ranks issued the two communicators' calls in different orders, each "
                                      "rank's kernel may be waiting for one that cannot run beside it; order them "
                                      "alike on every rank)";
      return where + "timed out after " + seconds + " s waiting for rank(s)" + missing + hint + closed;
    }
    case Fault::kCallMismatch: {
      const uint32_t sig = fault_value(fault);
      return where + "rank " + std::to_string(detail) + " called " +
             describe_call(signature_count(sig), signature_dtype(sig), signature_op(sig), signature_collective(sig),
                           signature_algorithm(sig)) +
             (this_call.empty() ? "" : ", this rank " + this_call) +
             "; every rank must make the same call: collective, size, dtype and op (and fuse the add and RMSNorm or "
             "not alike). The communicator is closed";
    }
    case Fault::kPeerAborted:
      return where + "rank " + std::to_string(detail) + " aborted the communicator: " + abort_reason(fault_value(fault)) + closed;
    case Fault::kPeerExited:
      return where + "rank " + std::to_string(detail) + "'s process ended" + closed;
    case Fault::kPeerClosed:
      return where + "rank " + std::to_string(detail) + " closed its communicator after its call " +
             std::to_string(fault_value(fault)) + ", and this call needs its data" + closed;
    case Fault::kRefused:
    case Fault::kLaunchFailed: break;  // recorded with their words (abort_call())
    case Fault::kInterrupted:
      return where + "interrupted by a signal while waiting for peers; they were told" + closed;
    case Fault::kTransport:
      return where + "the network path to rank " + std::to_string(detail) + " failed: " +
             transport_status(fault_value(fault)) + closed;
    case Fault::kSplitMismatch:
      return where + "rank " + std::to_string(detail) + " sent this rank a block of " +
             std::to_string(fault_value(fault)) + " bytes, which this rank's call does not expect" +
             (this_call.empty() ? "" : " (" + this_call + ")") +
             ": rank " + std::to_string(detail) + "'s input split for rank " + std::to_string(rank_) +
             " must equal this rank's output split for rank " + std::to_string(detail) +
             " (in the counts form: whole rows, at most the capacity)" + closed;
    case Fault::kBadSplits:
      return where + "the split counts say " +
             (fault_value(fault) == 0xFFFFFFFFu ? std::string("a negative or huge number of") : std::to_string(fault_value(fault))) +
             " rows for rank " + std::to_string(detail) +
             ", which cannot be sent: each count must lie in [0, capacity] and together they must fit the input; "
             "nothing was sent" + closed;
    case Fault::kPeersExited:
    case Fault::kGoodbye:
    case Fault::kNone: break;
  }
  return where + "unknown fault " + std::to_string(fault) + closed;
}

void Communicator::fail(uint64_t fault, const std::string& this_call) {
  const std::string what = message(this_call);
  report(what);
  switch (fault_kind(fault)) {
    case Fault::kPeerTimeout: ROCENANTE_THROW(PeerTimeout, what);
    case Fault::kCallMismatch:
    case Fault::kSplitMismatch: ROCENANTE_THROW(CallMismatch, what);
    case Fault::kPeerAborted: {  // a peer's timeout or mismatch keeps its class on every rank it reaches
      const Fault cause = Fault(fault_value(fault) >> 24);
      if (cause == Fault::kPeerTimeout) ROCENANTE_THROW(PeerTimeout, what);
      if (cause == Fault::kCallMismatch || cause == Fault::kSplitMismatch) ROCENANTE_THROW(CallMismatch, what);
      ROCENANTE_THROW(PeerAborted, what);
    }
    case Fault::kRefused:
    case Fault::kBadSplits: ROCENANTE_THROW(InvalidArgument, what);
    case Fault::kInterrupted: ROCENANTE_THROW(Interrupted, what);
    case Fault::kLaunchFailed: ROCENANTE_THROW(Error, what);
    default: ROCENANTE_THROW(PeerAborted, what);
  }
}

namespace {

// CUDA gives device memory back through frees that wait until the whole device is idle (cudaFree, cudaFreeHost,
// cudaHostUnregister: measured on an H200), so freeing a GPU communicator's regions and state would make
// close() wait for other communicators' kernels and the caller's. close() waits for its own work only; then it
// hands what holds memory to this process-wide thread, which destroys it in order (the transport, then the
// kernel state), and waits for that at most kReleaseWaitS: on an idle device the memory is back by then; behind
// someone else's long kernel it comes back when the kernel ends. At exit the thread finishes its queue first
// (registered with atexit after CUDA's own teardown was, so it runs before it). A forked child never has the
// thread: whatever it created it releases inline.
constexpr double kReleaseWaitS = 0.2;

class Releaser {
 public:
  static Releaser& instance() {
    static Releaser* const releaser = new Releaser;  // never destroyed: drain() ends its thread at exit
    return *releaser;
  }

  // Destroys `transport`, then `kernel`, on the thread; returns once done or after kReleaseWaitS.
  void release(std::unique_ptr<Transport> transport, std::unique_ptr<CollectiveKernel> kernel) {
    if (getpid() != creator_) {  // a forked child: the thread is the parent's
      transport.reset();
      kernel.reset();
      return;
    }
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> released = done->get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Job{std::move(transport), std::move(kernel), std::move(done)});
    }
    ready_.notify_one();
    released.wait_for(std::chrono::duration<double>(kReleaseWaitS));
  }

 private:
  struct Job {
    std::unique_ptr<Transport> transport;
    std::unique_ptr<CollectiveKernel> kernel;
    std::shared_ptr<std::promise<void>> done;
  };

  Releaser() : creator_(getpid()), thread_([this] { run(); }) {
    std::atexit([] { instance().drain(); });
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      Job job = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      job.transport.reset();  // before the kernel state, as close() always did
      job.kernel.reset();
      job.done->set_value();
      lock.lock();
    }
  }

  void drain() {
    if (getpid() != creator_) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }

  const pid_t creator_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

void Communicator::close() {
  if (in_forked_child()) {
    // The regions, sockets, queue pairs, proxy thread, kernel state and watchdog entry are the creator's: shared
    // with it (a shutdown() or a destroyed queue pair would end its connections), or copied in whatever state
    // its other threads held them (locks included). Nothing of them is touched here; the child's copies go
    // when it exits.
    (void)transport_.release();
    (void)kernel_.release();
    if (timeline_mapping_) new std::shared_ptr<void>(std::move(timeline_mapping_));  // its deleter calls CUDA
    return;
  }
  std::lock_guard<std::mutex> lock(issue_);  // no call is issued from here on
  // Our kernels end before the regions they use go, and the watchdog watches for them until then: a peer that
  // ends meanwhile stops their waits, and their faults are relayed to the network peers (watch()).
  // Bounded: each launch's waits end within the timeout, and once one faulted the later ones end at once; past
  // the bound (a launch stuck behind other work) the whole device is waited for.
  uint32_t next = next_epoch(issued_);  // the call after our last one
  if (kernel_ != nullptr && transport_ != nullptr)
    next = kernel_->wait_idle(captured_ ? kNoEpoch : launched_, 2 * timeout_s_ + 10);  // graphs replay on the device
  Watchdog::remove(this);  // from here on the watchdog no longer reads this communicator
  // Goodbye: a peer still waiting for us in a later call fails at once, naming this rank (abort_seen()). Not
  // after a fault, whose abort word the peers hold already (a slot is written once, layout.h).
  if (transport_ != nullptr && next != kNoEpoch && !skip_goodbyes_ && current_fault() == 0)
    for (int p = 0; p < world_; ++p)
      if (p != rank_) transport_->post_abort(p, encode_fault(Fault::kGoodbye, uint32_t(rank_), previous_epoch(next)));
  std::unique_lock<std::shared_mutex> gone(lifetime_);
  if (kernel_ != nullptr) {
    count_on_device(-1);
    Releaser::instance().release(std::move(transport_), std::move(kernel_));
  }
  transport_.reset();  // a CPU communicator's: shared memory, no CUDA
  peer_processes_.close();
}

}  // namespace rocenante
