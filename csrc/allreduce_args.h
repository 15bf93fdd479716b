// Everything one all-reduce needs, passed by value to the host loop and to the kernel alike.
#pragma once

#include <cstdint>

#include "layout.h"

namespace rocenante {

struct AllReduceArgs {
  const void* in;
  void* out;  // may equal `in`
  size_t count;  // elements
  size_t bytes;  // count * dtype_size
  DType dtype;
  ReduceOp op;
  uint32_t signature;  // call_signature(count, dtype, op)
  int rank;
  int world;
  RegionLayout layout;
  Line* local;              // this rank's receive region
  Line* peer[kMaxRanks];    // where this rank writes to reach each peer's region (peer[rank] unused)
  uint64_t timeout_ns;      // how long to wait for one peer's line before giving up
};

// The CPU path: runs the whole protocol on the calling thread. `epoch` is this call's number (same on every
// rank). Returns 0, or an encode_fault() word saying why the call failed (the output is then not valid).
uint64_t host_allreduce(const AllReduceArgs& args, uint32_t epoch);

}  // namespace rocenante
