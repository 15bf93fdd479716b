// CUDA runtime error checks that throw (never exit), naming the call and where it failed. A failed call also
// leaves its error as the runtime's "last error", which torch reads after its own kernel launches: the check
// takes it back (cudaGetLastError), so that a refused communicator (say, out of memory) does not make the
// caller's next, unrelated kernel launch raise. Sticky errors (a faulted context) stay, as they must.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "errors.h"

#define ROCENANTE_CHECK_CUDA(call)                                                                   \
  do {                                                                                               \
    const cudaError_t rocenante_err_ = (call);                                                       \
    if (rocenante_err_ != cudaSuccess) {                                                             \
      (void)cudaGetLastError();                                                                      \
      ROCENANTE_THROW(Error, std::string(#call) + " failed: " + cudaGetErrorString(rocenante_err_)); \
    }                                                                                                \
  } while (0)

namespace rocenante {

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    ROCENANTE_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) ROCENANTE_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace rocenante
