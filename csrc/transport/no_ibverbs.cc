// Built instead of ibverbs.cc when rdma-core's headers (infiniband/verbs.h) were not found: RDMA is refused
// clearly, everything else works.
#include "../errors.h"
#include "transport.h"

namespace rocenante {

const bool kWithIbverbs = false;

std::unique_ptr<Wire> make_ibverbs_wire(int, const RegionLayout&, const std::vector<std::vector<IbPath>>&, Signal) {
  ROCENANTE_THROW(InvalidArgument, "rocenante was built without rdma-core's headers (infiniband/verbs.h): RDMA is "
                                   "unavailable; install libibverbs-dev and rebuild");
}

std::string verbs_status(uint32_t status) { return "verbs status " + std::to_string(status); }

}  // namespace rocenante
