// The host side of the collective kernels (CollectiveKernel, collective_kernel.h): it allocates the kernel's state
// (device_state.h), shapes and launches each call, orders calls across streams, and waits for the communicator's
// launches when it closes. Host code only: it launches the kernels (collective_kernels.cu) by their addresses.
#include <cuda_runtime.h>  // the runtime's C++ API (typed cudaMalloc), for the host compiler too

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "../cuda_check.h"
#include "../fault.h"
#include "clock_offset.h"
#include "device_state.h"
#include "collective_kernel.h"

namespace rocenante {
namespace {

constexpr int kRecordReads = 1000;  // CudaCollectiveKernel::fault()'s reads of the record, at most

struct LaunchShape {
  int blocks;
  int threads;
};

// One 16-byte chunk per thread: a single CTA (a whole number of warps) for small messages, then CTAs of
// kThreads up to max_blocks.
LaunchShape chunk_shape(size_t bytes, int max_blocks) {
  const size_t chunks = std::max<size_t>(1, (bytes + kChunkBytes - 1) / kChunkBytes);
  if (chunks <= size_t(kThreads)) return {1, int((chunks + 31) / 32 * 32)};
  const size_t blocks = std::min<size_t>((chunks + kThreads - 1) / kThreads, size_t(max_blocks));
  return {int(blocks), kThreads};
}

// Fused calls: a CTA per row, up to max_blocks (then CTAs take several rows in turn), of the threads that hold
// the row's chunks (row_split()) rounded up to a whole warp (block_sum()).
LaunchShape fused_shape(const CallArgs& a, int max_blocks) {
  const RowSplit split = row_split(uint32_t(a.norm.hidden * dtype_size(a.dtype) / kChunkBytes));
  const size_t rows = a.count / a.norm.hidden;
  return {int(std::min<size_t>(rows, size_t(max_blocks))), int((split.threads + 31) / 32 * 32)};
}

// CTAs of one launch at most, per kernel (dtype, op, fused) of a communicator of `world`: as many CTAs of kThreads
// as all multiprocessors hold at once (more loads in flight: at world 2, 4 CTAs per multiprocessor against 1
// and 2 took 4 MiB bf16 from 18.7 to 16.8 us, benchmarks/results/h200x2-v2-shape-ab.json), and never more,
// since a CTA waits for data that the peers' CTAs send, and those may be waiting for ours in turn. Counted per
// kernel, so that the kernels that need more registers (int32's lines, the fused rows) do not lower the others'.
// 0 where there is no such kernel.
using LaunchBounds = std::array<std::array<std::array<int, kNumVariants>, kNumOps>, kNumDTypes>;
LaunchBounds launch_bounds(int world, int multiprocessors) {
  LaunchBounds bounds{};
  for (const DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32})
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
      for (int variant = 0; variant < kNumVariants; ++variant) {
        const void* kernel = kernel_entry(d, op, world, Variant(variant));
        if (kernel == nullptr) continue;
        int per_sm = 0;
        ROCENANTE_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
        bounds[int(d)][int(op)][variant] = std::min(kMaxBlocks, multiprocessors * per_sm);
      }
    }
  return bounds;
}

class CudaCollectiveKernel final : public CollectiveKernel {
 public:
  CudaCollectiveKernel(int device, int world, uint32_t first_epoch) : device_(device) {
    DeviceGuard guard(device_);
    try {
      int multiprocessors = 0;
      ROCENANTE_CHECK_CUDA(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device_));
      max_blocks_ = launch_bounds(world, multiprocessors);
      for (const auto& per_op : max_blocks_)
        for (const auto& per_variant : per_op)
          for (const int blocks : per_variant) state_.copies = std::max(state_.copies, blocks);
      // One allocation: epochs[kMaxBlocks], fault_mask, record_lock, finished, footprints[kBuffers], sent[2], reduced.
      constexpr size_t kWords = kMaxBlocks + 1 + 1 + 1 + kBuffers + 2 + 1;
      ROCENANTE_CHECK_CUDA(cudaMalloc(&state_.epochs, kWords * sizeof(uint32_t)));
      state_.fault_mask = state_.epochs + kMaxBlocks;
      state_.record_lock = state_.fault_mask + 1;
      state_.finished = state_.record_lock + 1;
      state_.footprints = state_.finished + 1;
      state_.sent = state_.footprints + kBuffers;
      state_.reduced = state_.sent + 2;
      std::vector<uint32_t> init(kWords, 0);  // no fault, the lock free; every buffer is empty; nothing sent
      std::fill(init.begin(), init.begin() + kMaxBlocks, first_epoch);  // every rank starts at the same call
      init.back() = kNoEpoch;  // no launch has reduced yet
      ROCENANTE_CHECK_CUDA(cudaMemcpy(state_.epochs, init.data(), init.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
      // The fault record (the kernel's), then on lines of their own (layout.h, kLineBytes: a copy engine writes
      // them) wait_idle()'s copies of the epochs, allocated here: a cudaFreeHost in wait_idle() would wait for the
      // whole device.
      static_assert(sizeof(FaultRecord) <= kLineBytes, "the fault record has its line");
      ROCENANTE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_), kLineBytes + kMaxBlocks * sizeof(uint32_t),
                                         cudaHostAllocMapped));
      *host_ = FaultRecord{};
      epoch_copies_ = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(host_) + kLineBytes);
      ROCENANTE_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&state_.record), host_, 0));
      ROCENANTE_CHECK_CUDA(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaCollectiveKernel() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    release();  // after wait_idle() (Communicator::close): no kernel of ours uses the state any more
    cudaSetDevice(previous);
  }

  uint32_t wait_idle(uint32_t next, double bound_s) noexcept override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    uint32_t counter = next;
    if (next == kNoEpoch || !epochs_reach(next, bound_s)) {
      // Idle once the device is: then every copy holds the counter, unless a launch failed midway.
      uint32_t* const copies = epoch_copies_;
      const bool read = cudaDeviceSynchronize() == cudaSuccess &&
                        cudaMemcpy(copies, state_.epochs, state_.copies * sizeof(uint32_t), cudaMemcpyDeviceToHost) ==
                            cudaSuccess;
      counter = read && std::all_of(copies, copies + state_.copies, [&](uint32_t e) { return e == copies[0]; })
                    ? copies[0]
                    : kNoEpoch;
    }
    cudaGetLastError();  // a failure here is not the next launch's error (cuda_check.h)
    cudaSetDevice(previous);
    return counter;
  }

  bool launch(const CallArgs& args, uintptr_t stream_handle) override {
    DeviceGuard guard(device_);
    const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    order_after_previous_call(stream);
    const CallArgs& a = args;
    const Variant variant = variant_of(a);
    const int max_blocks = max_blocks_[int(a.dtype)][int(a.op)][int(variant)];
    // A sharded call's threads walk the slots' chunks (sharded_kernel), a split all-to-all's what it moves of
    // them (blocks_kernel).
    const LaunchShape shape =
        variant == Variant::kFused       ? fused_shape(a, max_blocks)
        : variant == Variant::kAllToAllV ? chunk_shape(a.world * block_walk(a) * kChunkBytes, max_blocks)
        : sharded(a)                     ? chunk_shape(a.world * a.shards.slot_chunks * kChunkBytes, max_blocks)
                                         : chunk_shape(a.bytes, max_blocks);
    cudaLaunchAttribute overlap{};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;  // start while the previous kernel ends
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(shape.blocks);
    config.blockDim = dim3(shape.threads);
    config.stream = stream;
    config.attrs = &overlap;
    config.numAttrs = 1;
    // A plain call always has a kernel: the communicator refuses int32 avg before (validate_shared()).
    const void* kernel = kernel_entry(a.dtype, a.op, a.world, variant);
    if (kernel == nullptr) ROCENANTE_THROW(InvalidArgument, "the fused add + RMSNorm serves sums of float dtypes");
    CallArgs args_copy = a;  // the kernel's parameters, by value
    DeviceState state = state_;
    void* parameters[] = {&args_copy, &state};
    ROCENANTE_CHECK_CUDA(cudaLaunchKernelExC(&config, kernel, parameters));
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

  std::shared_ptr<void> map_host(void* host, size_t bytes, void*& device_address) override {
    DeviceGuard guard(device_);
    ROCENANTE_CHECK_CUDA(cudaHostRegister(host, bytes, cudaHostRegisterMapped));
    const int device = device_;
    std::shared_ptr<void> mapping(host, [device](void* p) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaHostUnregister(p);
      cudaGetLastError();  // a failure here is not the next launch's error (cuda_check.h)
      cudaSetDevice(previous);
    });
    ROCENANTE_CHECK_CUDA(cudaHostGetDevicePointer(&device_address, host, 0));
    return mapping;
  }

#ifdef ROCENANTE_TIMELINE
  int64_t clock_offset_ns() override { return measure_clock_offset_ns(device_); }
#endif

  // A word and an epoch of one writer (FaultRecord): read between two equal, even reads of the sequence. A
  // writer holds it odd for a few stores, longer while its context is off the GPU (ranks sharing a device take
  // turns of milliseconds): after kRecordReads reads without one, no fault yet (word 0), and a later read takes
  // it (every caller polls again: the waits, the watchdog, the next call). A launch that died midway is
  // reported by CUDA's error at the next launch (kLaunchFailed), not by this record.
  FaultRecord fault() const override {
    for (int read = 0; read < kRecordReads; ++read) {
      const uint32_t sequence = __atomic_load_n(&host_->sequence, __ATOMIC_ACQUIRE);
      FaultRecord r{};
      r.word = __atomic_load_n(&host_->word, __ATOMIC_ACQUIRE);
      r.epoch = __atomic_load_n(&host_->epoch, __ATOMIC_ACQUIRE);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (sequence % 2 == 0 && __atomic_load_n(&host_->sequence, __ATOMIC_RELAXED) == sequence)
        return r.word == 0 ? FaultRecord{} : r;
    }
    return FaultRecord{};
  }

  // Tests only (test_fault_record_race()).
  std::vector<FaultRecord> record_race(uint64_t first, uint64_t second, uint32_t epoch) {
    DeviceGuard guard(device_);
    cudaStream_t stream = nullptr;
    ROCENANTE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceState state = state_;
    void* parameters[] = {&state, &first, &second, &epoch};
    std::vector<FaultRecord> reads;
    cudaError_t status = cudaLaunchKernel(record_race_kernel_entry(), dim3(2), dim3(1), parameters, 0, stream);
    for (bool ended = status != cudaSuccess; !ended;) {
      status = cudaStreamQuery(stream);
      ended = status != cudaErrorNotReady;
      const FaultRecord r = fault();
      if (reads.empty() || r.word != reads.back().word || r.epoch != reads.back().epoch) reads.push_back(r);
    }
    cudaStreamDestroy(stream);
    ROCENANTE_CHECK_CUDA(status);
    reads.push_back(fault());
    return reads;
  }

 private:
  // Calls run in the order they are issued (the epoch and slot protocol of layout.h relies on it). On one
  // stream that is stream order, and programmatic dependent launch keeps its overlap. When the stream differs
  // from the previous call's, the new stream first waits for everything enqueued so far on the previous one:
  // between two eager calls, or two calls of one graph capture (forked streams). Between separate graphs, or a
  // graph and eager calls, no event can express the order: that is the caller's (docs/guarantees.md).
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

  // Polls every epoch copy (each launch advances each copy once, at the end of the CTA that owns it) until all
  // hold `next`, through a stream of its own that waits for nothing else, into pinned memory the kernel state
  // already holds (nothing here waits for other work of the device). False if CUDA failed or `bound_s` passed.
  bool epochs_reach(uint32_t next, double bound_s) noexcept {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(bound_s);
    cudaStream_t probe = nullptr;
    bool reached = false;
    uint32_t* const copies = epoch_copies_;
    if (cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking) == cudaSuccess) {
      while (cudaMemcpyAsync(copies, state_.epochs, state_.copies * sizeof(uint32_t), cudaMemcpyDeviceToHost, probe) ==
                 cudaSuccess &&
             cudaStreamSynchronize(probe) == cudaSuccess) {
        if (std::all_of(copies, copies + state_.copies, [next](uint32_t e) { return e == next; })) {
          reached = true;
          break;
        }
        if (std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    if (probe != nullptr) cudaStreamDestroy(probe);
    return reached;
  }

  void release() noexcept {
    if (order_event_ != nullptr) cudaEventDestroy(order_event_);
    if (state_.epochs != nullptr) cudaFree(state_.epochs);
    if (host_ != nullptr) cudaFreeHost(host_);
  }

  int device_;
  LaunchBounds max_blocks_{};  // CTAs of one launch at most, per kernel; the largest is the number of epoch copies
  DeviceState state_{};
  FaultRecord* host_ = nullptr;  // mapped: state_.record is its device address
  uint32_t* epoch_copies_ = nullptr;  // in host_'s allocation, after the record: wait_idle()'s view of the epochs
  cudaEvent_t order_event_ = nullptr;
  std::optional<cudaStream_t> previous_stream_;
};

}  // namespace

std::vector<FaultRecord> test_fault_record_race(int device, uint64_t first, uint64_t second, uint32_t epoch) {
  return CudaCollectiveKernel(device, 2, epoch).record_race(first, second, epoch);
}

std::unique_ptr<CollectiveKernel> make_collective_kernel(int device, int world, uint32_t first_epoch) {
  return std::make_unique<CudaCollectiveKernel>(device, world, first_epoch);
}

}  // namespace rocenante
