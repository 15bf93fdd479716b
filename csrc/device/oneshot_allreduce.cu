// The one-shot all-reduce kernel: one launch does the whole collective.
//
//   push:  each thread reads one 16-byte chunk of the input and stores it, as two lines carrying this call's
//          flag, into this rank's source slot of every peer's region (over NVLink via CUDA IPC mappings);
//   pull:  the same thread polls its own region for the matching lines of every peer, combines all inputs in
//          rank order (fp32 accumulation), writes the output chunk and zeroes the lines it consumed.
//
// No CTA waits for another CTA and no thread waits for anything but its own chunk's lines, so there is no
// barrier round: the flag travels inside the data (layout.h). A thread that waits past the timeout, sees a
// call mismatch or reads an abort word records the fault and tells every peer (abort words); from then on
// every chunk it and any later launch would have computed is poisoned instead, decided here on the device,
// so graph replays after a fault produce NaN (int32: INT32_MIN), never a stale or partial sum.
#include <algorithm>
#include <optional>
#include <vector>

#include "../chunk_reduce.h"
#include "../cuda_check.h"
#include "lines.cuh"
#include "oneshot_kernel.h"

namespace rocenante {
namespace {

// Most CTAs one launch uses; also the number of epoch copies (see DeviceState::epochs).
constexpr int kMaxBlocks = 256;

// Bits of DeviceState::fault_mask besides the missing peers.
constexpr uint32_t kFaulted = 0x80000000u;       // some thread of this or an earlier launch faulted
constexpr uint32_t kNotATimeout = 0x40000000u;   // ... with a fault other than a timeout (it is kept as is)

// Per-communicator state the kernel keeps on the device between launches, so that a captured CUDA graph
// replays correctly: nothing per call comes from the host except the launch parameters.
struct DeviceState {
  // The call counter, one copy per CTA index. CTA b reads epochs[b] when it starts and, when it ends, writes
  // epoch+1 to every copy j with j % gridDim == b. Every copy is thus advanced exactly once per call, by the
  // only CTA that reads it, so all copies stay equal without any synchronisation between CTAs.
  uint32_t* epochs;
  // Device word, never cleared: kFaulted | kNotATimeout? | bit mask of peers a thread gave up on. Threads
  // poll it at their timer reads; a launch that finds it set poisons its whole output.
  uint32_t* fault_mask;
  // Mapped host memory: the first fault (for timeouts, the union of missing peers), read by the host.
  FaultRecord* record;
};

constexpr int kThreads = 256;         // per CTA; small messages use fewer (a multiple of a warp)
constexpr int kPollsPerClockRead = 64;  // polls between reads of the global timer and the fault words

__device__ void load_chunk(const AllReduceArgs& a, size_t c, uint32_t (&w)[4]) {
  const size_t begin = c * kChunkBytes;
  const char* src = static_cast<const char*>(a.in) + begin;
  if (begin + kChunkBytes <= a.bytes && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    return;
  }
  // Tail chunk, or an input that is only element-aligned: element by element, zero-padded.
  w[0] = w[1] = w[2] = w[3] = 0;
  const int n = int(min(kChunkBytes, a.bytes - begin));
  // Constant trip counts keep w[] in registers (a run-time index would move it to local memory).
  if (dtype_size(a.dtype) == 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (2 * i < n) w[i / 2] |= uint32_t(reinterpret_cast<const uint16_t*>(src)[i]) << (16 * (i % 2));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * i < n) w[i] = reinterpret_cast<const uint32_t*>(src)[i];
  }
}

__device__ void store_chunk(const AllReduceArgs& a, size_t c, const uint32_t (&w)[4]) {
  const size_t begin = c * kChunkBytes;
  char* dst = static_cast<char*>(a.out) + begin;
  if (begin + kChunkBytes <= a.bytes && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
  const int n = int(min(kChunkBytes, a.bytes - begin));
  if (dtype_size(a.dtype) == 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (2 * i < n) reinterpret_cast<uint16_t*>(dst)[i] = uint16_t(w[i / 2] >> (16 * (i % 2)));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * i < n) reinterpret_cast<uint32_t*>(dst)[i] = w[i];
  }
}

__device__ void store_poison(const AllReduceArgs& a, size_t c) {
  const uint32_t p = poison_word(a.dtype);
  const uint32_t w[4] = {p, p, p, p};
  store_chunk(a, c, w);
}

// Records `fault` (a timeout's peers are merged across threads) and, for the first fault of the
// communicator, writes our abort word into every peer's region.
__device__ void record_fault(const AllReduceArgs& a, const DeviceState& s, uint64_t fault, uint32_t epoch) {
  const bool timeout = fault_kind(fault) == Fault::kPeerTimeout;
  const uint32_t missing = timeout ? fault_detail(fault) : 0;
  const uint32_t before = atomicOr(s.fault_mask, kFaulted | (timeout ? 0 : kNotATimeout) | missing);
  if (before & kNotATimeout) return;
  if (timeout) fault = encode_fault(Fault::kPeerTimeout, (before | missing) & 0xFFFFFFu, 0);
  store_release_sys(&s.record->epoch, epoch);
  store_release_sys(&s.record->word, fault);
  if (before != 0) return;
#pragma unroll
  for (int p = 0; p < kMaxRanks; ++p)
    if (p < a.world && p != a.rank) store_release_sys(abort_word(a.peer[p], a.rank), abort_from(fault, epoch));
}

// At a timer read: 0 to keep waiting, or the fault that ends the wait (an earlier fault of this launch is
// reported as already recorded: kFaulted).
__device__ uint64_t check_waiting(const AllReduceArgs& a, const DeviceState& s, uint64_t now, uint64_t deadline,
                                  uint32_t pending) {
  if (*reinterpret_cast<volatile uint32_t*>(s.fault_mask) != 0) return kFaulted;
  if (const uint64_t f = abort_seen(a, [](const uint64_t* w) { return load_acquire_sys(w); })) return f;
  return now > deadline ? encode_fault(Fault::kPeerTimeout, pending, 0) : 0;
}

template <DType D, ReduceOp Op>
__global__ void __launch_bounds__(kThreads) oneshot_allreduce_kernel(const AllReduceArgs a, const DeviceState s) {
  // Launched with programmatic stream serialization (see launch()): this grid may be scheduled while the
  // previous kernel of the stream is still running. griddepcontrol.wait returns once that kernel has completed
  // and its writes (the caller's input, our epoch) are visible; launch_dependents then lets the next kernel be
  // scheduled, and that kernel in turn waits for our completion. No data moves before the wait.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  const uint32_t epoch = load_epoch(&s.epochs[blockIdx.x]);
  const int slot = epoch & 1;
  const uint32_t flag = make_flag(a.signature, epoch);
  const size_t chunks = (a.bytes + kChunkBytes - 1) / kChunkBytes;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t send_base = a.layout.line_index(slot, a.rank);
  // A communicator that faulted before this launch sends nothing and poisons everything.
  bool failed = *reinterpret_cast<volatile uint32_t*>(s.fault_mask) != 0;

  for (size_t c = first; c < chunks && !failed; c += stride) {
    uint32_t w[4];
    load_chunk(a, c, w);
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.world || p == a.rank) continue;
      Line* dst = a.peer[p] + send_base;
      store_line(dst + chunk_line(c, 0), w[0], w[1], flag);
      store_line(dst + chunk_line(c, 1), w[2], w[3], flag);
    }
  }

  uint64_t deadline = 0;  // set at the first timer read, so a call whose peers are already there never reads it
  for (size_t c = first; c < chunks; c += stride) {
    if (failed) {
      store_poison(a, c);
      continue;
    }
    uint32_t own[4];
    load_chunk(a, c, own);  // issued before the wait, so its latency hides behind it
    // Poll every peer's two lines for this chunk until all carry our flag. Indices into `got` are
    // compile-time constants after unrolling, so the lines stay in registers.
    Line got[kMaxRanks][kLinesPerChunk];
    uint32_t pending = ((1u << a.world) - 1) & ~(1u << a.rank);
    // A fault found at a timer read ends the wait after one more poll of the lines: a peer whose call differs
    // writes its lines before it aborts, and this rank should name that call rather than relay the abort.
    uint64_t fault = 0;
    for (int polls = 1;; ++polls) {
#pragma unroll
      for (int p = 0; p < kMaxRanks; ++p) {
        if (!(pending & (1u << p))) continue;
        const Line* src = a.local + a.layout.line_index(slot, p);
        got[p][0] = load_line(src + chunk_line(c, 0));
        got[p][1] = load_line(src + chunk_line(c, 1));
        const uint32_t f[4] = {got[p][0].flag0, got[p][0].flag1, got[p][1].flag0, got[p][1].flag1};
        bool arrived = true;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          if (f[h] != flag && f[h] != 0 && !failed) {  // the peer made a different call: say which
            record_fault(a, s, encode_fault(Fault::kCallMismatch, p, flag_signature(f[h], epoch)), epoch);
            failed = true;
          }
          arrived &= f[h] == flag;
        }
        if (arrived) pending &= ~(1u << p);
      }
      if (failed || pending == 0) break;
      if (fault != 0) {
        if (fault != kFaulted) record_fault(a, s, fault, epoch);
        failed = true;
        break;
      }
      if (polls % kPollsPerClockRead == 0) {
        const uint64_t now = global_timer_ns();
        if (deadline == 0) deadline = now + a.timeout_ns;
        fault = check_waiting(a, s, now, deadline, pending);
      }
    }
    if (failed) {
      store_poison(a, c);
      continue;
    }

    typename Chunk<D>::Acc acc[Chunk<D>::kElems];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.world) continue;
      if (p == a.rank) {
        accumulate<D, Op>(acc, own, p == 0);
        continue;
      }
      const uint32_t w[4] = {got[p][0].data0, got[p][0].data1, got[p][1].data0, got[p][1].data1};
      Line* src = a.local + a.layout.line_index(slot, p);
      zero_line(src + chunk_line(c, 0));
      zero_line(src + chunk_line(c, 1));
      accumulate<D, Op>(acc, w, p == 0);
    }
    uint32_t w[4] = {0, 0, 0, 0};
    finish<D, Op>(acc, a.world, w);
    store_chunk(a, c, w);
  }

  // Advance the epoch: every thread of this CTA has read epochs[blockIdx.x] above, before this barrier.
  // The CTA's threads share the copies it owns (j % gridDim == blockIdx), so no thread stores many.
  __syncthreads();
  for (int j = blockIdx.x + gridDim.x * threadIdx.x; j < kMaxBlocks; j += gridDim.x * blockDim.x)
    store_epoch(&s.epochs[j], epoch + 1);
}

struct LaunchShape {
  int blocks;
  int threads;
};

// One 16-byte chunk per thread: a single CTA (a whole number of warps) for small messages, then CTAs of
// kThreads up to one per multiprocessor.
LaunchShape oneshot_shape(size_t bytes, int max_blocks) {
  const size_t chunks = std::max<size_t>(1, (bytes + kChunkBytes - 1) / kChunkBytes);
  if (chunks <= size_t(kThreads)) return {1, int((chunks + 31) / 32 * 32)};
  const size_t blocks = std::min<size_t>((chunks + kThreads - 1) / kThreads, size_t(std::min(max_blocks, kMaxBlocks)));
  return {int(blocks), kThreads};
}


class CudaOneshotKernel final : public OneshotKernel {
 public:
  explicit CudaOneshotKernel(int device) : device_(device) {
    DeviceGuard guard(device_);
    try {
      ROCENANTE_CHECK_CUDA(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_));
      ROCENANTE_CHECK_CUDA(cudaMalloc(&state_.epochs, kMaxBlocks * sizeof(uint32_t) + sizeof(uint32_t)));
      state_.fault_mask = state_.epochs + kMaxBlocks;
      std::vector<uint32_t> init(kMaxBlocks + 1, 1);  // every rank starts at epoch 1
      init[kMaxBlocks] = 0;                           // fault_mask: no fault
      ROCENANTE_CHECK_CUDA(cudaMemcpy(state_.epochs, init.data(), init.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
      ROCENANTE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(FaultRecord), cudaHostAllocMapped));
      *host_ = FaultRecord{};
      ROCENANTE_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&state_.record), host_, 0));
      ROCENANTE_CHECK_CUDA(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaOneshotKernel() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaDeviceSynchronize();  // no kernel of ours may still use the state
    release();
    cudaSetDevice(previous);
  }

  bool launch(const AllReduceArgs& args, uintptr_t stream_handle) override {
    DeviceGuard guard(device_);
    const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    order_after_previous_call(stream);
    const AllReduceArgs& a = args;
    const LaunchShape shape = oneshot_shape(a.bytes, multiprocessors_);
    cudaLaunchAttribute overlap{};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;  // start while the previous kernel ends
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(shape.blocks);
    config.blockDim = dim3(shape.threads);
    config.stream = stream;
    config.attrs = &overlap;
    config.numAttrs = 1;
    dispatch_dtype_op(a.dtype, a.op, [&]<DType D, ReduceOp Op>() {
      ROCENANTE_CHECK_CUDA(cudaLaunchKernelEx(&config, oneshot_allreduce_kernel<D, Op>, a, state_));
    });
    previous_stream_ = stream;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    ROCENANTE_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
    return capture != cudaStreamCaptureStatusNone;
  }

  bool stream_done(uintptr_t stream_handle) const override {
    DeviceGuard guard(device_);
    const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    ROCENANTE_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return false;  // querying it would invalidate the capture
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaErrorNotReady) return false;
    ROCENANTE_CHECK_CUDA(status);
    return true;
  }

  FaultRecord fault() const override {
    FaultRecord r{};
    r.word = __atomic_load_n(&host_->word, __ATOMIC_ACQUIRE);
    if (r.word != 0) r.epoch = __atomic_load_n(&host_->epoch, __ATOMIC_RELAXED);
    return r;
  }

 private:
  // Calls run in the order they are issued (the epoch and slot protocol of layout.h relies on it). On one
  // stream that is stream order, and programmatic dependent launch keeps its overlap. When the stream differs
  // from the previous call's, the new stream first waits for everything enqueued so far on the previous one:
  // between two eager calls, or two calls of one graph capture (forked streams). Between separate graphs, or a
  // graph and eager calls, no event can express the order: that is the caller's (README, "Guarantees").
  void order_after_previous_call(cudaStream_t stream) {
    if (!previous_stream_ || *previous_stream_ == stream) return;
    cudaStreamCaptureStatus now = cudaStreamCaptureStatusNone, before = cudaStreamCaptureStatusNone;
    unsigned long long now_id = 0, before_id = 0;
    ROCENANTE_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &now, &now_id));
    ROCENANTE_CHECK_CUDA(cudaStreamGetCaptureInfo(*previous_stream_, &before, &before_id));
    const bool both_eager = now == cudaStreamCaptureStatusNone && before == cudaStreamCaptureStatusNone;
    const bool one_capture = now == cudaStreamCaptureStatusActive && before == cudaStreamCaptureStatusActive &&
                             now_id == before_id;
    if (!both_eager && !one_capture) return;
    ROCENANTE_CHECK_CUDA(cudaEventRecord(order_event_, *previous_stream_));
    ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(stream, order_event_, 0));
  }

  void release() noexcept {
    if (order_event_ != nullptr) cudaEventDestroy(order_event_);
    if (state_.epochs != nullptr) cudaFree(state_.epochs);
    if (host_ != nullptr) cudaFreeHost(host_);
  }

  int device_;
  int multiprocessors_ = 0;
  DeviceState state_{};
  FaultRecord* host_ = nullptr;  // mapped: state_.record is its device address
  cudaEvent_t order_event_ = nullptr;
  std::optional<cudaStream_t> previous_stream_;
};

}  // namespace

std::unique_ptr<OneshotKernel> make_oneshot_kernel(int device) { return std::make_unique<CudaOneshotKernel>(device); }

}  // namespace rocenante
