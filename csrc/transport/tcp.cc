// Placeholder until the TCP software wire lands (issue 13): ROCENANTE_NET=tcp is refused clearly.
#include "../errors.h"
#include "transport.h"

namespace rocenante {

std::unique_ptr<Wire> make_tcp_wire(int, const RegionLayout&) {
  ROCENANTE_THROW(InvalidArgument, "ROCENANTE_NET=tcp: the TCP software wire is not built yet");
}

}  // namespace rocenante
