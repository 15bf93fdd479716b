// Built instead of the CUDA sources when no CUDA compiler was found: GPU communicators are refused clearly.
#include "device/collective_kernel.h"
#include "errors.h"
#include "transport/transport.h"

namespace rocenante {

std::unique_ptr<CollectiveKernel> make_collective_kernel(int, int, uint32_t) {
  ROCENANTE_THROW(InvalidArgument, "rocenante was built without CUDA: only CPU tensors are supported");
}

std::unique_ptr<Transport> make_cuda_ipc_transport(int, int, const RegionLayout&) {
  ROCENANTE_THROW(InvalidArgument, "rocenante was built without CUDA: only CPU tensors are supported");
}

std::vector<FaultRecord> test_fault_record_race(int, uint64_t, uint64_t, uint32_t) {
  ROCENANTE_THROW(InvalidArgument, "rocenante was built without CUDA: only CPU tensors are supported");
}

void hold_abort_staging(double) {}

}  // namespace rocenante
