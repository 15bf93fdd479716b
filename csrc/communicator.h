// A group of `world` ranks on one host that all-reduce with the one-shot protocol.
// CPU tensors go through shared memory and the host loop; GPU tensors through CUDA IPC and the kernel.
// The communicator itself is torch-free: raw pointers, dtype enums, streams as integers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "allreduce_args.h"
#include "device/oneshot_kernel.h"
#include "layout.h"
#include "transport/transport.h"

namespace rocenante {

class Communicator {
 public:
  // device < 0: CPU memory (shared-memory transport); otherwise the CUDA device ordinal.
  Communicator(int rank, int world, int device, size_t capacity_bytes, double timeout_s);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Rendezvous, done by the caller through its store: publish local_handle(), pass every rank's to
  // connect(), then call all_connected() once every rank has connected.
  std::string local_handle() const;
  void connect(const std::vector<std::string>& handles);
  void all_connected();

  // out[i] = op over ranks of in[i], for `count` elements. CPU: returns when done. GPU: enqueues one kernel on
  // `stream` and returns; a fault that kernel hits is raised by the next call or by check().
  void all_reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op, uintptr_t stream);
  // Raises (and closes) if a launched kernel recorded a fault; otherwise does nothing.
  void check();
  void close();

  // True after close(), and after a fault (whose resources close() then frees).
  bool closed() const { return transport_ == nullptr || faulted_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  size_t capacity_bytes() const { return layout_.capacity_bytes; }
  double timeout_s() const { return timeout_s_; }

 private:
  void validate(uintptr_t in, uintptr_t out, size_t count, DType dtype, ReduceOp op) const;
  // Marks the communicator closed and throws the error that `fault` describes.
  [[noreturn]] void fail(uint64_t fault, const std::string& this_call);

  int rank_;
  int world_;
  int device_;
  double timeout_s_;
  RegionLayout layout_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<OneshotKernel> kernel_;  // GPU communicators only
  bool faulted_ = false;
  uint32_t host_epoch_ = 1;  // CPU path: this call's number; the GPU path keeps its epoch on the device
};

}  // namespace rocenante
