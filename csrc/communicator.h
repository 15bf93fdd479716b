// A group of `world` ranks that run collectives (all-reduce one-shot or two-shot, all-gather, reduce-scatter) with
// the protocol of layout.h. CPU tensors are served by the host loop (host_collective.h), GPU tensors by the kernels
// (device/collective_kernel.h); peers are reached directly (shared memory, CUDA IPC: one host) or through a network
// wire driven by a proxy thread (RDMA, the TCP software wire).
// The communicator itself is torch-free: raw pointers, dtype enums, streams as integers.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "call_args.h"
#include "device/collective_kernel.h"
#include "host_collective.h"
#include "layout.h"
#include "transport/transport.h"
#include "watchdog.h"

namespace rocenante {

// What a rank does once it knows of a fault (ROCENANTE_ON_FAULT): raise it from every later call, or log it
// and end the process with SIGABRT.
enum class OnFault : uint32_t { kRaise = 0, kAbort = 1 };

// How peers are reached: kShm, every peer on this host, directly (shared memory for CPU tensors, CUDA IPC for GPU
// tensors: the docs' direct path), or through a network wire driven by a proxy thread (transport/proxy.cc): RDMA
// verbs, or the TCP software wire (loopback, a test vehicle). Spelled as Communicator.net's values, "shm", "ib"
// and "tcp", in Python (_C.Net).
enum class Net : uint32_t { kShm = 0, kIb = 1, kTcp = 2 };

// A rank's handle (local_handle()): the configuration every rank must share (Config: magic, world, capacity,
// CPU or GPU, first call, network signal, two-shot size), the process's identity (pid, start time), then the
// transport's part (communicator.cc).
constexpr uint32_t kConfigMagic = 0x524f4342;  // "ROCB": bump when the protocol or the handle changes
constexpr size_t kConfigBytes = 32;
constexpr size_t kHandleHeaderBytes = 48;

class Communicator : public Watched {
 public:
  // Longest wait for a peer, in seconds (about 31.7 years); longer timeouts, infinity included, are clamped to
  // it: in nanoseconds, added to any clock the waits read (%globaltimer counts from 1970), it cannot overflow.
  static constexpr double kMaxTimeoutS = 1e9;
  // twoshot_from: no all-reduce goes two-shot.
  static constexpr uint32_t kNever = 0xFFFFFFFFu;

  // device < 0: CPU memory; otherwise the CUDA device ordinal. net: how every peer is reached; Net::kIb takes
  // each rank's rails in rdma_paths (make_ibverbs_wire(); its own entry unused). timeout_s > 0, clamped to kMaxTimeoutS.
  // first_epoch: the number of the first call, the same on every rank (1; tests of the wrap start near it).
  // signal: how a network peer's delivery tells the reducer it is whole (transport.h); unused without one.
  // twoshot_from: all-reduces of at least this many bytes go two-shot (kNever: none); every rank alike (Config).
  Communicator(int rank, int world, int device, size_t capacity_bytes, double timeout_s, OnFault on_fault,
               Net net = Net::kShm, const std::vector<std::vector<IbPath>>& rdma_paths = {}, uint32_t first_epoch = 1,
               double proxy_spin_s = kDefaultProxySpinS, Signal signal = Signal::kFlag, uint32_t twoshot_from = kNever);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Rendezvous, done by the caller through its store: publish local_handle(), pass every rank's to
  // connect(), then call all_connected() once every rank has connected.
  std::string local_handle() const;
  void connect(const std::vector<std::string>& handles);
  void all_connected();

  // out[i] = op over ranks of in[i], for `count` elements. CPU: returns when done. GPU: enqueues one kernel on
  // `stream` and returns; a fault that kernel hits is raised by the next call or by check(). Calls from any
  // thread and stream execute in the order they are issued here. Returns the call's number (its epoch, as long
  // as no captured graph has replayed calls: see captured()); for an empty call the previous call's.
  uint32_t all_reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, uintptr_t stream);
  // out = the `count` elements of `in` of every rank, in rank order (world * count elements); `in` may be this
  // rank's part of `out`. Issued and completed as all_reduce().
  uint32_t all_gather(uintptr_t in, uintptr_t out, size_t count, DType dtype, uintptr_t stream);
  // out = this rank's part, elements [rank * count, (rank + 1) * count), of op over ranks of `in` (world * count
  // elements); `out` may be that part of `in`. Issued and completed as all_reduce().
  uint32_t reduce_scatter(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, uintptr_t stream);
  // Block s of `out` (elements [s * count, (s + 1) * count)) = block `rank` of rank s's `in` (world * count
  // elements each, every bit as given); `out` may be `in`. Issued and completed as all_reduce().
  uint32_t all_to_all(uintptr_t in, uintptr_t out, size_t count, DType dtype, uintptr_t stream);
  // A split all-to-all (layout.h, kAllToAllV), one call: send[t] elements of `in` (packed in rank order) to rank t,
  // recv[s] elements from rank s into `out` (packed in rank order), as torch's all_to_all_single with split lists
  // (in elements). Each block's size is checked by its receiver against recv: a rank that sent another is named
  // (a CallMismatchError). A block holds at most largest_block() elements (larger: refused). Issued and
  // completed as all_reduce().
  uint32_t all_to_all_v(uintptr_t in, uintptr_t out, DType dtype, const std::vector<size_t>& send,
                        const std::vector<size_t>& recv, uintptr_t stream);
  // The same with the splits in the tensors' memory (on the device for a GPU communicator: no host sync, and a
  // captured graph reads them at each replay): send_counts[t] rows of `row` elements to rank t, of `in_rows`
  // packed in rank order; rank s's block lands at rows [s * capacity_rows, ...) of `out` (world * capacity_rows
  // rows), and the rows received from each rank are written to recv_counts (int64, world each; -1 each on a
  // fault). capacity_rows is every rank's alike (the call's signature).
  uint32_t all_to_all_v_counts(uintptr_t in, uintptr_t out, DType dtype, uintptr_t send_counts, uintptr_t recv_counts,
                               size_t row, size_t in_rows, size_t capacity_rows, uintptr_t stream);
  // How all_reduce() moves a call of `bytes` bytes: two-shot from twoshot_from_bytes() on (agreed at startup).
  Algorithm algorithm_for(size_t bytes) const;
  uint32_t twoshot_from_bytes() const { return twoshot_from_; }
  // Whether all_reduce_add_rmsnorm() serves `count` elements of `dtype` in rows of `hidden`: a GPU communicator,
  // and a call the kernel fuses (fuses_add_rmsnorm(), device/collective_kernel.h) of one piece. It depends only on
  // what every rank's call shares, so every rank answers alike.
  bool fuses_add_rmsnorm(size_t count, size_t hidden, DType dtype) const;
  // FlashInfer's kARResidualRMSNorm as one kernel: the sum over ranks of `count` elements of `in`, in rows of
  // `hidden`, with residual_in added (residual_out) and RMSNorm applied (norm_out = residual_out * rsqrt(mean of
  // squares + eps) * (weight_bias + gamma)); the sum itself is not written. Rounding as the all-reduce followed
  // by torch's ops (CallArgs's RowNorm). Enqueued as all_reduce() enqueues; a call fuses_add_rmsnorm()
  // refuses is refused alike on every rank (the communicator stays usable); the peers must make the same fused
  // call (the call word says so). residual_out or norm_out may be `in`, residual_in or each other.
  uint32_t all_reduce_add_rmsnorm(uintptr_t in, uintptr_t residual_in, uintptr_t gamma, uintptr_t residual_out,
                                  uintptr_t norm_out, size_t count, size_t hidden, DType dtype, float eps,
                                  float weight_bias, uintptr_t stream);
  // A call this rank refuses for a reason its peers cannot see (a bad pointer, device or layout): their side
  // of the call is already under way, so the communicator faults, tells them, and raises InvalidArgument.
  [[noreturn]] void refuse(const std::string& why);
  // Raises the communicator's fault, if it has one (a kernel's, a peer's, a refusal); otherwise nothing.
  void check();
  // Waits for this communicator's own calls, then releases what it holds (a GPU communicator's memory through
  // the release thread, communicator.cc: it never waits for other work of the device); idempotent. In a forked
  // child it releases nothing (the creator's).
  void close();

  // For the watchdog thread (watchdog.h): asks which peers' processes ended, reads the kernel's fault record.
  void watch() override;

  // True after close(), and after a fault.
  bool closed() const { return transport_ == nullptr || fault_.load() != 0; }
  // Whether a fault is recorded that struck at or before call `call` (a number all_reduce() returned), across
  // the wrap of the call numbers; once a graph has replayed calls, whose numbers the host does not see, any
  // fault.
  bool faulted_by(uint32_t call);
  // Whether a call was captured in a CUDA graph: its replays advance the device's call numbers unseen here.
  bool captured() const { return captured_; }
  // GPU: true once all work enqueued on `stream` so far has completed (false while it captures); true after
  // close(), which waited for this communicator's work.
  bool stream_done(uintptr_t stream) const;
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  size_t capacity_bytes() const { return layout_.capacity_bytes; }
  double timeout_s() const { return timeout_s_; }

#ifdef ROCENANTE_TIMELINE
  // The timeline so far (timeline.h), and %globaltimer minus CLOCK_REALTIME (GPU communicators; 0 for CPU).
  const Timeline& timeline() const { return *timeline_; }
  int64_t clock_offset_ns() { return kernel_ ? kernel_->clock_offset_ns() : 0; }
#endif

  // How host waits (the CPU path) learn of Ctrl-C; set once by the bindings.
  static void set_interrupt_check(InterruptCheck check) { interrupt_check_ = check; }
  // Tests only: close() without a goodbye, as a host that vanished (its peers see a wire failure, or time out).
  static void skip_goodbyes(bool skip) { skip_goodbyes_ = skip; }
  // Tests only: posts to each peer p an abort word of its own ("its network path to rank p failed"), each from a
  // thread of its own, the threads started 20 ms apart, with every post holding its staging write for `hold_s`
  // (hold_abort_staging(), CUDA IPC): a user thread and the watchdog posting at once. Returns when all are posted.
  void test_post_aborts_at_once(double hold_s);

 private:
  void validate_shared(DType dtype, ReduceOp op) const;
  const char* validate_local(Collective c, uintptr_t in, uintptr_t out, size_t count, DType dtype) const;
  // One call of any collective from the API (count: all_reduce's, all_gather's, reduce_scatter's or all_to_all's):
  // its pieces.
  uint32_t call(Collective c, uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, uintptr_t stream);
  void poison_if_stopped(uintptr_t out, DType dtype, size_t out_elems, uintptr_t recv_counts);
  const char* validate_blocks(uintptr_t in, uintptr_t out, size_t in_elems, size_t out_elems, DType dtype) const;
  uint32_t call_blocks(CallArgs& a, uintptr_t in, uintptr_t out, DType dtype, uintptr_t stream, const std::string& what);
  const char* validate_fused(uintptr_t in, uintptr_t residual_in, uintptr_t gamma, uintptr_t residual_out,
                             uintptr_t norm_out, size_t count, size_t hidden, DType dtype) const;
  // The arguments every call of this communicator shares (its rank, regions, transports, timeout).
  CallArgs call_args(DType dtype, ReduceOp op) const;
  // Raises what stops a call before it is numbered: closed, faulted, a dtype or op refused alike everywhere.
  void check_issuable(DType dtype, ReduceOp op);
  // Numbers one call of the protocol and issues it (communicator.cc); the host loop's fault, else 0.
  uint64_t issue(const CallArgs& a, uintptr_t stream, uint32_t& epoch);
  // In a process forked from the creator (fork() after the communicator was built): every call raises, and
  // close() releases nothing the creator shares (communicator.cc).
  bool in_forked_child() const;
  void refuse_in_forked_child() const;
  // Faults call `epoch`, which the peers have started and this rank cannot make (`why`), tells them, raises.
  [[noreturn]] void abort_call(uint64_t fault, uint32_t epoch, const std::string& why);
  // Records `fault` (the first one stays) for call `epoch`, with its words if they are known already (a
  // refusal's); true if it was the first.
  bool record(uint64_t fault, uint32_t epoch, const std::string& words = "");
  // Reads a fault the kernel recorded into the host's record.
  uint64_t current_fault();
  // The recorded fault in words, fixed the first time it is asked for, so that every later raise repeats it.
  std::string message(const std::string& this_call);
  // Logs `what` once and applies on_fault_.
  void report(const std::string& what);
  // Reports the recorded fault and throws the error it describes.
  [[noreturn]] void fail(uint64_t fault, const std::string& this_call);
  std::string describe(uint64_t fault, uint32_t epoch, const std::string& this_call) const;
  void tell_peers(uint64_t fault, uint32_t epoch);
  // Counts this GPU communicator among its device's open ones (+1, -1); whether another is open there.
  void count_on_device(int delta);
  bool shares_device() const;

  int rank_;
  int world_;
  int device_;
  double timeout_s_;
  OnFault on_fault_;
  RegionLayout layout_;
  uint32_t first_epoch_;
  Signal signal_;  // of the network path; Signal::kFlag when every peer is direct (Config)
  uint32_t twoshot_from_;
  uint32_t network_ = 0;  // peers reached through the network (CallArgs::network)
  uint32_t stores_ = 0;   // peers this rank stores to (CallArgs::stores)
  std::shared_ptr<Timeline> timeline_;  // timeline builds: host memory the proxy records into
  Timeline* reducer_timeline_ = nullptr;  // ... and the reducer's address of it (the kernel's mapping, or it)
  std::shared_ptr<void> timeline_mapping_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<CollectiveKernel> kernel_;  // GPU communicators only
  std::mutex issue_;                       // one call issued at a time: issue order is execution order
  // Guards kernel_ and transport_ for what runs beside the calls (check(), faulted_by(), stream_done(), the
  // watchdog's watch(), from any thread, the GIL not held): shared there, exclusive where close() resets them.
  mutable std::shared_mutex lifetime_;
  std::atomic<uint32_t> issued_;           // the epoch of the last call (piece) issued, from first_epoch_ on
  uint32_t reset_footprint_ = 0;           // CPU path: footprint_of() the last call, reset by the next one
  uint32_t launched_;                      // GPU path: the device's call counter once every launch so far ended
  std::atomic<bool> captured_{false};
  std::mutex recording_;                   // guards the fault record's writes and message_
  std::atomic<uint64_t> fault_{0};         // the first fault this rank knows of (0: none); written last
  std::atomic<uint32_t> fault_epoch_{0};
  std::string message_;                    // the fault in words, once known
  std::atomic<bool> reported_{false};
  PeerProcesses peer_processes_;  // the peers' processes, watched by watch()
  uint32_t exited_ = 0;       // peers whose process the watchdog saw end (kPeersExited)
  int64_t creator_pid_;       // the process that built this communicator
  uint32_t forks_at_creation_;  // forks counted in this process then (in_forked_child())

  static InterruptCheck interrupt_check_;
  static std::atomic<bool> skip_goodbyes_;
};

}  // namespace rocenante
