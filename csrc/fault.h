// What a fault is: the word that says why a call failed (the one a rank records, and the root cause its abort
// word carries to every peer: layout.h, Abort words), and the poison a faulted call leaves in its outputs.
#pragma once

#include <cstdint>

#include "layout.h"

namespace rocenante {

// Why a call failed, packed in one 64-bit word so that one plain store publishes it whole.
enum class Fault : uint32_t {
  kNone = 0,
  kPeerTimeout = 1,   // detail: bit mask of the peers that did not arrive
  kCallMismatch = 2,  // detail: the peer; value: the signature of the call it made
  kPeerAborted = 3,   // detail: the peer whose abort word we read; value: abort_cause() of that word
  kPeerExited = 4,    // detail: the peer whose process ended (seen by this rank's watchdog)
  kRefused = 5,       // detail: the rank that refused a call for a reason only it could see
  kInterrupted = 6,   // detail: the rank whose wait a signal (Ctrl-C) interrupted
  kTransport = 7,     // detail: the peer a delivery to failed; value: the verbs completion status (ibverbs.cc)
  kLaunchFailed = 8,  // detail: the rank that could not launch (or run) a call it had numbered already
  // Only ever in a rank's own abort word, written by its watchdog: detail, the peers whose processes ended. It
  // ends only waits for those peers (abort_seen(), which reports kPeerExited): a peer that made its last call
  // and exited owes nothing to a rank still receiving from others.
  kPeersExited = 9,
  // A peer's goodbye (Communicator::close()): only ever in the closing rank's slot of its peers' regions, never
  // recorded; detail: that rank, value: the last call it made. It ends only a wait for that peer in a later call
  // (abort_seen(), which reports kPeerClosed): every call up to its last, the peer made, and its data arrives.
  kGoodbye = 10,
  kPeerClosed = 11,  // detail: the peer that closed its communicator; value: the last call it made
  // A split all-to-all (layout.h, kAllToAllV): the block a peer sent is not the size this rank expects of it;
  // detail: the peer, value: the bytes it sent.
  kSplitMismatch = 12,
  // A split all-to-all's counts (on the device) that cannot be sent: negative, above the capacity, or past the
  // input; detail: the rank the block was for, value: its count (rows; clamped to 32 bits, negative as 2^32 - 1).
  kBadSplits = 13,
};
ROCENANTE_HD uint64_t encode_fault(Fault f, uint32_t detail, uint32_t value) {
  return (uint64_t(f) << 56) | (uint64_t(detail & 0xFFFFFFu) << 32) | value;
}
ROCENANTE_HD Fault fault_kind(uint64_t w) { return Fault(w >> 56); }
ROCENANTE_HD uint32_t fault_detail(uint64_t w) { return uint32_t(w >> 32) & 0xFFFFFFu; }
ROCENANTE_HD uint32_t fault_value(uint64_t w) { return uint32_t(w); }
// An abort word is the root cause (kind and detail) of the writer's fault, with its epoch as value: a rank that
// aborts because a peer did passes that peer's cause on, so every rank names the same root cause. A transport
// fault's or a split all-to-all's cause also names the rank that met it (`rank`, the writer): detail (rank + 1) << 8
// | the peer; a detail below 256 names no one (cause_rank()).
ROCENANTE_HD uint64_t abort_from(uint64_t own_fault, uint32_t epoch, int rank) {
  if (fault_kind(own_fault) == Fault::kPeerAborted)
    return encode_fault(Fault(fault_value(own_fault) >> 24), fault_value(own_fault) & 0xFFFFFFu, epoch);
  const Fault kind = fault_kind(own_fault);
  const bool names_writer = kind == Fault::kTransport || kind == Fault::kSplitMismatch || kind == Fault::kBadSplits;
  const uint32_t detail = fault_detail(own_fault) | (names_writer ? uint32_t(rank + 1) << 8 : 0);
  return encode_fault(fault_kind(own_fault), detail, epoch);
}
static_assert(kMaxRanks <= 256, "a transport cause holds the peer in 8 bits");
// Of such a cause's detail: the rank that met it (-1: not said), and the peer it names.
ROCENANTE_HD int cause_rank(uint32_t detail) { return int(detail >> 8) - 1; }
ROCENANTE_HD int cause_peer(uint32_t detail) { return int(detail & 0xFFu); }
ROCENANTE_HD uint32_t abort_cause(uint64_t abort) { return (uint32_t(abort >> 56) << 24) | fault_detail(abort); }
// What a rank records when it reads `abort` in abort[source] of its region.
ROCENANTE_HD uint64_t peer_aborted(int source, uint64_t abort) {
  return encode_fault(Fault::kPeerAborted, source, abort_cause(abort));
}

// Where a rank records its first fault: the word, and the call (epoch) it happened in.
// On the GPU it lives in mapped host memory, and threads of one launch (of its two calls, e and e + 1) may record
// at once: a writer holds the device's record lock and makes `sequence` odd while it writes (collective_kernels.cu,
// record_fault()); the host takes a word and an epoch only when `sequence` was even and unchanged around its
// reads of them (CudaCollectiveKernel::fault()), so never one thread's word with another's epoch.
struct FaultRecord {
  uint64_t word;
  uint32_t epoch;
  uint32_t sequence;
};

// The bits every output element that a faulted call does not compute is set to: a quiet NaN, and for int32,
// which has no NaN, INT32_MIN (0x80000000). One 32-bit word holds one float32/int32 or two 16-bit elements.
ROCENANTE_HD uint32_t poison_word(DType d) {
  switch (d) {
    case DType::kFloat32: return 0x7FC00000u;
    case DType::kFloat16: return 0x7E007E00u;
    case DType::kBFloat16: return 0x7FC07FC0u;
    case DType::kInt32: return 0x80000000u;
  }
  return 0;
}

}  // namespace rocenante
