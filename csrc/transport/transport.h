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
};

// Same host, CPU memory: one POSIX shared-memory segment per rank.
std::unique_ptr<Transport> make_shm_transport(int rank, const RegionLayout& layout);
// Same host, GPU memory: one cudaMalloc region per rank, mapped by peers through CUDA IPC.
std::unique_ptr<Transport> make_cuda_ipc_transport(int rank, int device, const RegionLayout& layout);

}  // namespace rocenante
