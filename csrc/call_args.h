// Everything one call needs, passed by value to the host loop and to the kernel alike.
#pragma once

#include <cstdint>

#include "fault.h"
#include "layout.h"
#include "timeline.h"

namespace rocenante {

// The residual add and RMSNorm fused into the kernel (FlashInfer's kARResidualRMSNorm), for GPU calls of one
// piece whose rows fit the kernel's bound (fuses_add_rmsnorm(), device/collective_kernel.h). Per row of `hidden`
// elements of the sum s:
//   residual_out = s + residual_in                   (s rounded to the dtype, the add in fp32, rounded)
//   norm_out = residual_out * rsqrt(mean(residual_out^2) + eps) * (weight_bias + gamma)   (fp32, rounded)
// the same rounding points as the plain all-reduce followed by the caller's torch ops. The plain output (out)
// is not written. Every pointer may equal `in` or residual_in, or be disjoint from it (Communicator checks).
struct RowNorm {
  const void* residual_in;
  void* residual_out;
  void* norm_out;
  const void* gamma;  // hidden elements of the dtype
  float eps;
  float weight_bias;
  uint32_t hidden;  // elements per row; 0: a plain all-reduce
};

// A split all-to-all's blocks (layout.h, kAllToAllV), in one of two forms:
//   lists:  the sizes and places of this rank's blocks as torch's all_to_all_single split lists give them (known
//           to the host: send, recv and their offsets, in elements);
//   counts: rows of each block to send in `send_counts`, on the tensors' device (the caller's MoE routing wrote
//           them there), the input packed in rank order; rank s's block lands at rows [s * capacity / row, ...) of
//           the output, and the rows received from each rank are written to `recv_counts`.
struct Blocks {
  const int64_t* send_counts;  // counts form (else null: lists form)
  int64_t* recv_counts;
  uint32_t row;      // counts form: elements per row
  uint32_t in_rows;  // counts form: rows of the input
  uint32_t send[kMaxRanks], send_offset[kMaxRanks];  // lists form, elements
  uint32_t recv[kMaxRanks], recv_offset[kMaxRanks];  // lists form, elements
  uint32_t capacity;    // elements a block may hold (the signature's count)
  int slot_log2;        // blocks_slot_log2() of the capacity
  uint32_t sent_chunks, received_chunks;  // most chunks (header included) this rank sends, receives to any rank
};

// Every call of the protocol (a piece of a collective), whatever the collective.
struct CallArgs {
  const void* in;
  void* out;  // may equal `in` (an all-reduce)
  size_t count;  // elements of the whole tensor (an all-gather's output, a reduce-scatter's or all-to-all's input)
  size_t bytes;  // count * dtype_size
  DType dtype;
  ReduceOp op;
  Collective collective;
  Algorithm algorithm;
  uint32_t signature;  // call_signature() of all of the above
  // Sharded calls (two-shot, reduce-scatter, all-gather, all-to-all; layout.h): the shards, and the distance in
  // bytes between consecutive shards in the caller's tensor (of `in` for a reduce-scatter, of `out` for an
  // all-gather, of both for two-shot and all-to-all), which exceeds shard_bytes when the call is one piece of a
  // larger one.
  Shards shards;
  size_t stride_bytes;
  int rank;
  int world;
  RegionLayout layout;
  uint32_t* local;            // this rank's receive region
  uint32_t* peer[kMaxRanks];  // where this rank writes to reach each peer's region (peer[rank] unused)
  // Network peers (bit p): peer[p] is this rank's image of p's region, which the proxy delivers once rung, and
  // p's words of call e are read only after arrivals[(e % 3) * kMaxRanks + p] == e (layout.h, Mailbox).
  uint32_t network;
  // Peers whose peer[] this rank stores to: every direct peer, and of the network peers one per distinct image
  // area (a rank's area has one offset in the regions of all peers above it, another below: layout.h).
  uint32_t stores;
  Mailbox* mailbox;            // null when no peer is a network peer
  const uint32_t* arrivals;    // the arrival words, [buffer][source] (Transport::arrivals()); null as mailbox
  Timeline* timeline;  // timeline builds (timeline.h): where the reducer records its events; else null
  uint64_t timeout_ns;      // how long to wait for one peer's line before giving up
  RowNorm norm;             // norm.hidden == 0 (a plain all-reduce) unless fused
  Blocks blocks;            // a split all-to-all's
};

// A split all-to-all's block for rank t: its offset in the input and its elements. Returns -1, or in the counts
// form the first rank p <= t whose count cannot be sent (negative, above the capacity, past the input), `elems`
// then that count clamped to 32 bits (kBadSplits). The counts form reads the counts from the tensors' memory at
// each call (a captured graph replays them as the routing wrote them).
ROCENANTE_HD int send_block(const CallArgs& a, int t, size_t& offset, size_t& elems) {
  const Blocks& b = a.blocks;
  if (b.send_counts == nullptr) {
    offset = b.send_offset[t], elems = b.send[t];
    return -1;
  }
  int64_t rows = 0;  // of the blocks before p
  for (int p = 0; p <= t; ++p) {
    const int64_t n = b.send_counts[p];
    if (n < 0 || n > int64_t(b.capacity / b.row) || rows + n > int64_t(b.in_rows)) {
      elems = n < 0 || n > 0xFFFFFFFF ? 0xFFFFFFFFu : size_t(n);
      return p;
    }
    offset = size_t(rows) * b.row, elems = size_t(n) * b.row;
    rows += n;
  }
  return -1;
}
// Where rank s's block lands in the output (elements), and the most elements it may hold there.
ROCENANTE_HD size_t recv_offset(const CallArgs& a, int s) {
  return a.blocks.send_counts == nullptr ? a.blocks.recv_offset[s] : size_t(s) * a.blocks.capacity;
}
ROCENANTE_HD size_t recv_limit(const CallArgs& a, int s) {
  return a.blocks.send_counts == nullptr ? a.blocks.recv[s] : a.blocks.capacity;
}
// Whether a header saying `bytes` from rank s is a block this rank takes: the size its lists expect, or (counts
// form) whole rows within the capacity.
ROCENANTE_HD bool block_expected(const CallArgs& a, int s, uint32_t bytes) {
  const size_t esize = dtype_size(a.dtype);
  if (a.blocks.send_counts == nullptr) return bytes == a.blocks.recv[s] * esize;
  return bytes % (a.blocks.row * esize) == 0 && bytes <= a.blocks.capacity * esize;
}
ROCENANTE_HD size_t block_chunks(size_t bytes) { return (bytes + kChunkBytes - 1) / kChunkBytes; }
// Chunks of each slot a launch walks (header included): the most it sends or receives.
ROCENANTE_HD size_t block_walk(const CallArgs& a) {
  return a.blocks.sent_chunks > a.blocks.received_chunks ? a.blocks.sent_chunks : a.blocks.received_chunks;
}

// Whether a call cuts its tensor into shards (Shards, layout.h), and the format its data travels in.
ROCENANTE_HD bool sharded(const CallArgs& a) {
  return a.collective == Collective::kAllGather || a.collective == Collective::kReduceScatter ||
         a.collective == Collective::kAllToAll || a.algorithm == Algorithm::kTwoShot;
}
// A two-shot piece's calls carry the dtype's format: its second call, an all-gather, gathers reduced shards, which
// are sanitized (layout.h), so the Lamport format carries every bit of them.
ROCENANTE_HD Format format_of(const CallArgs& a) {
  return a.algorithm == Algorithm::kTwoShot ? format_of(a.dtype) : format_of(a.collective, a.dtype);
}
// Whether this rank's store into peer p's area carries block (or shard) t of its input, in the calls that send
// each rank its own (two-shot's first exchange, reduce-scatter, the all-to-alls): p's own, and into a network
// peer's area, our image shared by the peers below or above us (CallArgs::stores), every one but ours.
ROCENANTE_HD bool carries(const CallArgs& a, int p, int t) {
  return t == p || (t != a.rank && (a.network & (1u << p)));
}
// Every rank of the call but this one (bit p: rank p).
ROCENANTE_HD uint32_t peers_of(const CallArgs& a) { return ((1u << a.world) - 1) & ~(1u << a.rank); }
// Calls of the protocol a piece makes: two for a two-shot all-reduce over a network wire, one otherwise (layout.h:
// a delivery carries one call).
ROCENANTE_HD int calls_of(const CallArgs& a) {
  return a.collective == Collective::kAllReduce && a.algorithm == Algorithm::kTwoShot && a.network != 0 ? 2 : 1;
}
// Call i of a piece that makes two, as a call of its own: 0, a reduce-scatter that leaves our reduced shard in its
// place in the output; 1, an all-gather of that shard. Both keep the piece's two-shot signature and format.
ROCENANTE_HD CallArgs piece_call(const CallArgs& a, int i) {
  CallArgs c = a;
  char* const ours = static_cast<char*>(a.out) + size_t(a.rank) * a.stride_bytes;
  c.collective = i == 0 ? Collective::kReduceScatter : Collective::kAllGather;
  if (i == 0) c.out = ours;
  else c.in = ours;
  return c;
}
// What the call writes into each area of its buffer (layout.h, footprint_ranges()); of a piece that makes two
// calls, what each does.
ROCENANTE_HD uint32_t footprint_of(const CallArgs& a) {
  if (a.collective == Collective::kAllToAllV) return headed_footprint(a.blocks.slot_log2, a.blocks.received_chunks);
  return sharded(a) ? sharded_footprint(a.shards.slot_chunks, format_of(a)) : uint32_t(span_bytes(a.bytes, a.dtype));
}
// What the proxy delivers of the call to each network peer (delivery_range(), layout.h): of a piece that makes two
// calls, what each delivers.
static_assert(kMaxCapacityBytes / kChunkBytes < kSenderSlot, "a slot's chunks lie below kSenderSlot");
ROCENANTE_HD uint32_t delivery_of(const CallArgs& a) {
  if (a.collective == Collective::kAllToAllV) return headed_footprint(a.blocks.slot_log2, a.blocks.sent_chunks);
  return footprint_of(a) | (sharded(a) && a.collective == Collective::kAllGather ? kSenderSlot : 0u);
}

// A wait of call `epoch` for the peers in `pending` that has read the clock also reads the abort words of its
// region's header, with `load` (the host's and the kernel's atomic loads differ), each only once whole
// (abort_whole(), layout.h): the peers', then its own rank's (written by its own host, layout.h), since a peer's
// own word says more than our watchdog's (a peer that aborted may have ended since). Neither a peer's goodbye
// (kGoodbye) nor ended processes (kPeersExited) are faults by themselves: they end the wait only if it waits for
// that peer, and a goodbye only in a call after the peer's last; a peer that closed is named last, since an
// abort or an ended process says more (a rank may close after its last call while another has died).
// Returns the fault to record, or 0 to keep waiting.
template <class Load>
ROCENANTE_HD uint64_t abort_seen(const CallArgs& a, uint32_t epoch, uint32_t pending, Load load) {
  const auto whole = [&](int source) { return whole_abort_word(a.local, source, load); };
  uint64_t closed = 0;
  for (int p = 0; p < kMaxRanks && p < a.world; ++p) {
    if (p == a.rank) continue;
    const uint64_t w = whole(p);
    if (w == 0) continue;
    if (fault_kind(w) != Fault::kGoodbye) return peer_aborted(p, w);
    if (closed == 0 && (pending & (1u << p)) && !epoch_at_or_before(epoch, fault_value(w)))
      closed = encode_fault(Fault::kPeerClosed, uint32_t(p), fault_value(w));
  }
  const uint64_t own = whole(a.rank);
  if (fault_kind(own) != Fault::kPeersExited) return own != 0 ? own : closed;
  const uint32_t gone = fault_detail(own) & pending;
  for (int p = 0; p < kMaxRanks; ++p)
    if (gone & (1u << p)) return encode_fault(Fault::kPeerExited, uint32_t(p), 0);
  return closed;
}

}  // namespace rocenante
