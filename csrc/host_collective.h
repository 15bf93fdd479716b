// The CPU path (host_collective.cc): the protocol of layout.h run by one host thread, for CPU tensors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "call_args.h"

namespace rocenante {

// True when a signal asks the waiting thread to give up (Ctrl-C); checked at most every few milliseconds.
using InterruptCheck = bool (*)();

// Runs one piece, any collective, on the calling thread: one call of the protocol, or the two of a network two-shot
// piece (calls_of()). `epoch` is its first call's number (same on every rank); `reset` is the footprint of the
// previous call (footprint_of()), whose buffer the first call resets (layout.h).
// Returns 0, or an encode_fault() word saying why the call failed; every output element it did not
// compute is then poisoned (poison_word).
uint64_t host_collective(const CallArgs& args, uint32_t epoch, uint32_t reset, InterruptCheck interrupted);

// Sets `bytes` of host memory at `begin` to the dtype's poison (poison_word(), fault.h).
void poison_host(void* begin, size_t bytes, DType dtype);

// Tests only: this process stops itself (SIGSTOP) or ends (SIGKILL) right after the push of its `push`-th call of
// the protocol from now on (1: the next), before it waits for anything: a rank that sent its data and never
// forwarded, at a point no signal sent from outside can hit reliably. 0 turns it off.
void stop_after_push(uint64_t push, bool kill);

}  // namespace rocenante
