// CUDA IPC transport: each rank's receive region is one cudaMalloc allocation that every peer on the host
// maps with cudaIpcOpenMemHandle, so the kernel's stores to a peer travel over NVLink/NVSwitch (or PCIe P2P).
#include <cudaTypedefs.h>  // the driver's function types (PFN_*): its functions are reached without linking libcuda
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "../cuda_check.h"
#include "transport.h"

namespace rocenante {
namespace {

std::atomic<double> abort_staging_hold_s{0.0};  // hold_abort_staging(): tests only

// Writes initial_word() over a fresh region (layout.h), from a host buffer a piece at a time.
void fill_initial(uint32_t* region, size_t bytes) {
  constexpr size_t kPieceWords = size_t(1) << 18;  // 1 MiB of host memory
  std::vector<uint32_t> words(std::min(kPieceWords, bytes / sizeof(uint32_t)));
  for (size_t i = 0; i < words.size(); ++i) words[i] = initial_word(i);
  ROCENANTE_CHECK_CUDA(cudaMemcpy(region, words.data(), words.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
  std::fill(words.begin(), words.end(), kEmpty);  // past the header every word starts empty
  for (size_t done = words.size() * sizeof(uint32_t); done < bytes;) {
    const size_t n = std::min(words.size() * sizeof(uint32_t), bytes - done);
    ROCENANTE_CHECK_CUDA(cudaMemcpy(reinterpret_cast<char*>(region) + done, words.data(), n, cudaMemcpyHostToDevice));
    done += n;
  }
}

// Bytes from `p` to the end of the allocation that holds it, as the driver's cuMemGetAddressRange tells. The
// runtime hands out the driver function (CUDA >= 12.5), so the extension still links only the runtime and
// imports on machines without a driver.
size_t bytes_to_allocation_end(void* p) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  // 12000: the function as CUDA 12.0 defines it (cuMemGetAddressRange_v2, sizes in size_t).
  ROCENANTE_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    ROCENANTE_THROW(Error, "the CUDA driver does not provide cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t bytes = 0;
  const CUresult err = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn)(&base, &bytes, CUdeviceptr(p));
  if (err != CUDA_SUCCESS) ROCENANTE_THROW(Error, "cuMemGetAddressRange failed: CUresult " + std::to_string(int(err)));
  return size_t(base + bytes - CUdeviceptr(p));
}

class CudaIpcTransport final : public Transport {
 public:
  CudaIpcTransport(int rank, int device, const RegionLayout& layout)
      : rank_(rank), device_(device), region_bytes_(layout.region_bytes()), regions_(layout.world, nullptr) {
    DeviceGuard guard(device_);
    try {
      void* p = nullptr;
      ROCENANTE_CHECK_CUDA(cudaMalloc(&p, region_bytes_));
      regions_[rank_] = static_cast<uint32_t*>(p);
      // Synchronous copies: the region is empty before any peer learns our handle.
      fill_initial(regions_[rank_], region_bytes_);
      ROCENANTE_CHECK_CUDA(cudaIpcGetMemHandle(&handle_, p));
      ROCENANTE_CHECK_CUDA(cudaStreamCreateWithFlags(&abort_stream_, cudaStreamNonBlocking));
      ROCENANTE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&abort_staging_), 2 * sizeof(uint64_t), cudaHostAllocDefault));
    } catch (...) {
      release();  // a failed constructor runs no destructor: nothing it got may stay allocated
      throw;
    }
  }

  ~CudaIpcTransport() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    release();
    cudaSetDevice(previous);
  }

  std::string local_handle() const override {
    return std::string(reinterpret_cast<const char*>(&handle_), sizeof(handle_));
  }

  void connect(const std::vector<std::string>& handles) override {
    DeviceGuard guard(device_);
    for (int p = 0; p < int(handles.size()); ++p) {
      if (p == rank_) continue;
      if (handles[p].size() != sizeof(cudaIpcMemHandle_t))
        ROCENANTE_THROW(Error, "rank " + std::to_string(p) + " published a CUDA IPC handle of " +
                                   std::to_string(handles[p].size()) + " bytes, not " +
                                   std::to_string(sizeof(cudaIpcMemHandle_t)));
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles[p].data(), sizeof(h));
      void* mapped = nullptr;
      const cudaError_t err = cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // the error is ours to report, not the caller's next launch check's (cuda_check.h)
        ROCENANTE_THROW(Error, "cannot map rank " + std::to_string(p) + "'s GPU memory into device " +
                                   std::to_string(device_) + " over CUDA IPC: " + cudaGetErrorString(err) +
                                   " (peers must share a host and have peer access)");
      }
      regions_[p] = static_cast<uint32_t*>(mapped);  // from here on release() unmaps it, also if the check below fails
      // The handle may name any allocation of the peer's (a bug, another program, another version): the kernel
      // writes a whole region into it, so a smaller one would take writes past its end.
      const size_t mapped_bytes = bytes_to_allocation_end(mapped);
      if (mapped_bytes < region_bytes_)
        ROCENANTE_THROW(Error, "rank " + std::to_string(p) + "'s CUDA IPC handle maps an allocation of " +
                                   std::to_string(mapped_bytes) + " bytes, smaller than the " +
                                   std::to_string(region_bytes_) + " bytes of a region of this communicator; refused");
    }
  }

  uint32_t* local_region() const override { return regions_[rank_]; }
  uint32_t* peer_region(int peer) const override { return regions_[peer]; }

  // A copy on a stream of our own, from pinned memory, so that it neither waits for our spinning kernels
  // nor breaks a graph capture under way on another stream. One at a time: a user thread (a refused call) and
  // the watchdog (a peer that ended) may post at once, and the copies read the one staging slot when they run.
  void post_abort(int peer, uint64_t word) noexcept override {
    if (regions_[peer] == nullptr) return;
    std::lock_guard<std::mutex> lock(abort_mutex_);
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    abort_staging_[0] = word;
    abort_staging_[1] = ~word;
    if (const double hold = abort_staging_hold_s.load()) std::this_thread::sleep_for(std::chrono::duration<double>(hold));
    // Two copies of one word each, so that each lands whole (layout.h, Abort words).
    if (cudaMemcpyAsync(abort_word(regions_[peer], rank_), &abort_staging_[0], sizeof(word), cudaMemcpyHostToDevice,
                        abort_stream_) == cudaSuccess &&
        cudaMemcpyAsync(abort_check(regions_[peer], rank_), &abort_staging_[1], sizeof(word), cudaMemcpyHostToDevice,
                        abort_stream_) == cudaSuccess)
      cudaStreamSynchronize(abort_stream_);
    cudaSetDevice(previous);
  }

 private:
  void release() noexcept {
    if (abort_stream_ != nullptr) cudaStreamDestroy(abort_stream_);
    if (abort_staging_ != nullptr) cudaFreeHost(abort_staging_);
    for (int p = 0; p < int(regions_.size()); ++p) {
      if (regions_[p] == nullptr) continue;
      if (p == rank_)
        cudaFree(regions_[p]);
      else
        cudaIpcCloseMemHandle(regions_[p]);
    }
  }

  int rank_;
  int device_;
  size_t region_bytes_;
  cudaIpcMemHandle_t handle_{};
  std::vector<uint32_t*> regions_;
  std::mutex abort_mutex_;  // post_abort()'s: the staging slot is reused until its copies have run
  cudaStream_t abort_stream_ = nullptr;
  uint64_t* abort_staging_ = nullptr;
};

}  // namespace

void hold_abort_staging(double seconds) { abort_staging_hold_s = seconds; }

std::unique_ptr<Transport> make_cuda_ipc_transport(int rank, int device, const RegionLayout& layout) {
  return std::make_unique<CudaIpcTransport>(rank, device, layout);
}

}  // namespace rocenante
