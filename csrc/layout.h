// The receive region every rank exposes to its peers, and the two formats that carry data into it (protocol v6).
// One protocol for every transport: shared memory (host path), CUDA IPC (the kernel) and RDMA (a NIC writing
// into the region for the sender). Every byte of payload crosses the wire once.
//
// Region of rank r:  header | buffer[3] x peer area[world - 1] x capacity_bytes
//   header:  abort[world] ({u64 word, u64 check}, bytes 0..127) | flag[b][world][kMaxRails] (u32, from byte 128:
//            network peers' arrival flags, below) | call[b][world] (u32, buffer b's from byte 384 + 128 b) | padding
//            to 1024 bytes (kHeaderBytes)
//   area (b, s): where source s != r writes its part of a call that uses buffer b (area_offset());
//   written by: source s writes only abort[s], call[b][s] and area (b, s) of every peer's region (it pushes);
//               r's own host writes abort[r] (a fault only it knows of: a peer's process ended, a call it
//               refused), which stops r's own waits;
//   read by:    rank r reads call[b][*] and area (b, *) of its own region, and resets them (below).
//
// The empty word kEmpty = 0x80000000 fills every call word and area word that holds nothing of a current call
// (the region starts so, abort words at 0, flags at kNoEpoch). A rank waits for a 32-bit word until it is not
// kEmpty.
//
// Formats (format_of(collective, dtype)):
//   kLamport (float32, float16, bfloat16): the payload itself, at its own byte offsets (16-byte units, the last
//     one zero-padded). kEmpty is -0.0 in float32, and -0.0 in the high half of a pair of 16-bit elements, so a
//     sender turns every -0.0 element into +0.0 (sanitize_word()); then no word it sends is kEmpty and a word
//     that is not kEmpty has arrived. A rank reduces its own input sanitized the same way, or ranks would
//     disagree on the sign of a zero (max/min), and sanitizes each result as well (a rounding can make -0.0: a
//     tiny negative average, a float16 rounding of a tiny sum), since two-shot sends a reduced shard in this
//     format and one-shot must return the same bits — so rocenante's reductions never return -0.0, a
//     documented loss. NaN payloads are never kEmpty and pass unchanged.
//     We rely on each aligned 32-bit word being written whole (true of NVLink and PCIe stores and CPU stores of
//     aligned words), never on the order in which words land. RDMA gives no such promise (SoftRoCE under an
//     emulated CPU placed a word half written), so over RDMA a rank reads a peer's words only after that
//     peer's delivery signal arrived (transport.h, ibverbs.cc).
//   kLines (int32): 0x80000000 is INT32_MIN, a legal value, so int32 cannot use a sentinel (remapping it would
//     be a silent wrong answer). It travels in 16-byte lines {data0, flag, data1, flag}; each 8-byte half
//     {data, flag} is written whole (as NCCL's LL protocol assumes over NVLink and PCIe; RDMA: as above), so a half
//     whose flag is the call word holds this call's data. A line carries 8 payload bytes, so int32 calls carry
//     at most capacity_bytes / 2 per piece.
// Calls larger than a piece (piece_bytes()) are split by the communicator; each piece is one call here.
//
// Call word of a call = make_flag(signature, epoch): the signature says count, dtype, op, collective and
// algorithm, the epoch counts calls (pieces) identically on every rank. A sender writes it into call[b][sender]
// of every peer's region.
// No output element is written before its thread has read, for every peer, a call word equal to its own:
//   - equal: the peer makes this very call, so whatever is not kEmpty in its area is this call's data;
//   - kEmpty: not arrived yet; any other value: the peer made a different call (the signature says which),
//     which is reported, never reduced — even when both calls have the same byte count.
//
// Buffers rotate: call e uses buffer e % 3 (buffer_of()). During call e every rank resets (writes kEmpty over)
// buffer (e - 1) % 3 of its own region — the call words and the span the previous call used of every area
// (span_bytes(), or the slots of a sharded call: Shards) — off the critical path, while it waits for call e's
// data (one exception over a network wire: the collectives, below). Why nothing stale is ever taken for current
// data:
//   - A sender writes buffer e % 3 of rank r only in call e. It starts call e + 2, the next to use the buffer
//     rank r resets during call e, only after it has received r's data for call e + 1, which r sends after
//     it finished call e (on the GPU: the next kernel starts after the previous one completed, and a region in
//     host memory is reset with system-scope stores fenced before the kernel ends, memory_order.cuh; on the host: in
//     program order after the reset's release fence). So the reset lands before any write of call e + 2.
//   - Rank r resets only words it has seen arrive (every word of the span it polls, padding included), or that
//     no one wrote; so no write of call e - 1 can land after the reset. A peer that made a different call may
//     write other words, but a mismatch closes the communicator for good.
//   - Two buffers would not do: a peer may start call e + 1 (writing buffer (e + 1) % 2 = (e - 1) % 2) as soon as
//     it has our data of call e, before we have reset that buffer during call e.
//   - Shared memory and CUDA IPC stores are placed exactly once. Over RDMA a retransmitted packet is executed
//     at most once (a later duplicate is acknowledged, not executed), a queue pair executes a sender's writes in
//     the order posted, and the receiver reads call e's words only after the sender's signal of call e (its
//     flag, or its completion: below, Mailbox), posted after them: the argument in full, with its sources, is
//     beside the transport (csrc/transport/ibverbs.cc).
// That argument needs calls to execute in the order every rank issued them: the communicator orders each call
// after the previous one whatever stream or thread issues it (communicator.cc).
//
// Abort words: a rank that faults (timeout, mismatch, a call it refused alone, Ctrl-C) writes a nonzero
// abort word, encode_fault(its fault kind, detail, its epoch) (fault.h), into abort[rank] of every peer's region,
// over the same transport as the data. Every wait polls its own header at each timer read, so a survivor stops
// waiting for a peer known to be gone instead of running into the timeout. Abort words are never cleared:
// a faulted communicator stays faulted, and every output it does not compute is poisoned (poison_word(), fault.h).
// A rank that closes its communicator without a fault writes a goodbye there instead (Fault::kGoodbye, naming its
// last call), no fault by itself: it ends only a wait for that rank in a later call (abort_seen(), call_args.h).
// A reader decodes the cause, so it must read a word whole, which no wire promises for 8 bytes (an RDMA write
// may land byte by byte; the TCP wire places an abort slot in 4-byte quarters, in random order). So each abort
// word travels with its check word, its bitwise complement, in one slot, and a reader takes the word only when
// it is nonzero and equals the complement of the check (abort_whole()). Bytes land whole and a slot starts as
// zeros; a byte of the word that has not landed reads 0, and matches the check's byte only if that byte was 0
// anyway (the check's byte is then 0, complement 0xFF, or landed, complement the written byte): whatever order or
// pieces the slot's bytes come in, a word that passes is the word written. A wire writes a peer's slot once (the
// proxy's guard, proxy.cc); every other writer stores each 8-byte word whole, so no reader assembles a word out
// of two writes.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define ROCENANTE_HD __host__ __device__ __forceinline__
#else
#define ROCENANTE_HD inline
#endif

namespace rocenante {

enum class DType : uint32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3 };
enum class ReduceOp : uint32_t { kSum = 0, kAvg = 1, kMax = 2, kMin = 3 };
constexpr int kNumDTypes = 4;
constexpr int kNumOps = 4;

ROCENANTE_HD size_t dtype_size(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16 ? 2 : 4; }

enum class Format : uint32_t { kLamport = 0, kLines = 1 };
constexpr ROCENANTE_HD Format format_of(DType t) { return t == DType::kInt32 ? Format::kLines : Format::kLamport; }

// "Nothing here yet": in an area or a call word. Never a sent Lamport word, never a call word (bit 0 clear).
constexpr uint32_t kEmpty = 0x80000000u;

// A 32-bit word of float payload as it is sent: each -0.0 element becomes +0.0, so the word is never kEmpty.
ROCENANTE_HD uint32_t sanitize_word(uint32_t w, DType t) {
  if (t == DType::kFloat32) return w == kEmpty ? 0u : w;
  if ((w & 0xFFFFu) == 0x8000u) w &= 0xFFFF0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000FFFFu;
  return w;
}

// One unit of work (a GPU thread, a CPU loop step) reads 16 input bytes; the Lamport format sends them as they
// are, the line format as two lines.
constexpr size_t kChunkBytes = 16;
struct alignas(16) Line {
  uint32_t data0, flag0, data1, flag1;
};
static_assert(sizeof(Line) == 16, "a line is one 16-byte store");
constexpr size_t kLinePayloadBytes = 8;
constexpr size_t kLinesPerChunk = kChunkBytes / kLinePayloadBytes;
// Line chunks are laid out in groups of one warp: the group's first lines, then its second lines. A warp-wide
// 16-byte store (or poll) then covers 512 contiguous bytes, whole sectors, instead of every other 16 bytes.
constexpr size_t kChunksPerGroup = 32;
ROCENANTE_HD size_t chunk_line(size_t chunk, int half) {
  return (chunk / kChunksPerGroup) * (kChunksPerGroup * kLinesPerChunk) + half * kChunksPerGroup + chunk % kChunksPerGroup;
}
// Capacity is a whole number of line groups twice over, so that half of it (an int32 piece) still is.
constexpr size_t kCapacityGranule = 2 * kChunkBytes * kChunksPerGroup * kLinesPerChunk;

// Bytes of an area a call of `bytes` payload may write: whole chunks, and for lines whole groups of lines.
ROCENANTE_HD size_t span_bytes(size_t bytes, DType t) {
  if (format_of(t) == Format::kLamport) return (bytes + kChunkBytes - 1) / kChunkBytes * kChunkBytes;
  const size_t group = kChunkBytes * kChunksPerGroup;
  return (bytes + group - 1) / group * group * kLinesPerChunk;
}
// Largest payload of one call (a piece) for an area of `capacity_bytes`.
ROCENANTE_HD size_t piece_bytes(size_t capacity_bytes, DType t) {
  return format_of(t) == Format::kLamport ? capacity_bytes : capacity_bytes / kLinesPerChunk;
}

// What a call wrote into each area of its buffer, as one word that the next call of that buffer reads to reset
// it: a one-shot call's span_bytes() (below 2^30), or a sharded call's slot_chunks with bit 31 set, and bit 30
// for the line format (Shards), or a split all-to-all's headed footprint (below). footprint_ranges() gives the
// byte ranges of area (b, source) of receiver's region to reset, at most two (they may overlap: resetting a word
// twice is harmless).
constexpr uint32_t kShardedFootprint = 0x80000000u, kLinesFootprint = 0x40000000u;
ROCENANTE_HD uint32_t sharded_footprint(size_t slot_chunks, Format f) {
  return kShardedFootprint | (f == Format::kLines ? kLinesFootprint : 0u) | uint32_t(slot_chunks);
}
// A split all-to-all (kAllToAllV, below) writes into each area one slot of 2^k chunks, and of it only the first
// `used` chunks: its footprint is kShardedFootprint | kLinesFootprint | kHeadedFootprint | k << 21 | used.
constexpr uint32_t kHeadedFootprint = 0x10000000u;
constexpr int kHeadedLog2Shift = 21;
ROCENANTE_HD uint32_t headed_footprint(int slot_log2, size_t used) {
  return kShardedFootprint | kLinesFootprint | kHeadedFootprint | (uint32_t(slot_log2) << kHeadedLog2Shift) |
         uint32_t(used);
}
// Bytes [begin, end) of an area that chunks [c0, c1) take, in whole groups of lines for the line format.
ROCENANTE_HD void chunk_range(size_t c0, size_t c1, bool lines, size_t& begin, size_t& end) {
  if (lines) {
    c0 = c0 / kChunksPerGroup * kChunksPerGroup * kLinesPerChunk;
    c1 = (c1 + kChunksPerGroup - 1) / kChunksPerGroup * kChunksPerGroup * kLinesPerChunk;
  }
  begin = c0 * kChunkBytes, end = c1 * kChunkBytes;
}
// Bytes of an area that slot `index` of `slot_chunks` chunks takes (Shards, below).
ROCENANTE_HD void slot_range(size_t index, size_t slot_chunks, bool lines, size_t& begin, size_t& end) {
  chunk_range(index * slot_chunks, (index + 1) * slot_chunks, lines, begin, end);
}
// What of slot `index` a headed footprint (or delivery) covers: its first `used` chunks.
ROCENANTE_HD void headed_range(uint32_t word, size_t index, size_t& begin, size_t& end) {
  const size_t slot = size_t(1) << ((word >> kHeadedLog2Shift) & 31u);
  chunk_range(index * slot, index * slot + (word & ((1u << kHeadedLog2Shift) - 1)), true, begin, end);
}
ROCENANTE_HD int footprint_ranges(uint32_t footprint, int receiver, int source, size_t (&begin)[2], size_t (&end)[2]) {
  if (!(footprint & kShardedFootprint)) {
    begin[0] = 0, end[0] = footprint;
    return 1;
  }
  if (footprint & kHeadedFootprint) {  // only slot `receiver` was written
    headed_range(footprint, size_t(receiver), begin[0], end[0]);
    return 1;
  }
  const size_t slot = footprint & (kLinesFootprint - 1);
  slot_range(size_t(receiver), slot, footprint & kLinesFootprint, begin[0], end[0]);
  slot_range(size_t(source), slot, footprint & kLinesFootprint, begin[1], end[1]);
  return 2;
}

// What of a call's area the proxy delivers to each network peer: exactly what that peer reads, so that no peer
// receives the blocks of the others. A ring's delivery word (delivery_of(), call_args.h) is the call's footprint,
// with kSenderSlot set where each peer reads the sender's slot (all-gather, two-shot's second exchange) rather than
// its own (two-shot's first exchange, reduce-scatter, all-to-all): a one-shot call delivers its span, a sharded
// one that slot, in whole groups of lines for the line format, a split all-to-all the first chunks of that slot
// that the sender writes to any peer (its headed footprint). A delivered range may reach into a neighbouring slot
// (a group of lines shared by two slots, a shard shorter than its slot): that is the image as an earlier call left
// it, which the receiver never reads, as it never reads outside the slot it waits for (layout.h's argument above
// holds for what it reads: all of it was written by this call, and delivered before the call's signal).
constexpr uint32_t kSenderSlot = 0x20000000u;  // above any slot's chunk count (call_args.h checks it)
ROCENANTE_HD void delivery_range(uint32_t delivery, int receiver, int sender, size_t& begin, size_t& end) {
  if (!(delivery & kShardedFootprint)) {
    begin = 0, end = delivery;
    return;
  }
  if (delivery & kHeadedFootprint) return headed_range(delivery, size_t(receiver), begin, end);
  slot_range(size_t(delivery & kSenderSlot ? sender : receiver), delivery & (kSenderSlot - 1),
             delivery & kLinesFootprint, begin, end);
}

// Buffer rotation (see above). The epoch wraps at a multiple of 3, so that buffer_of() keeps rotating across
// the wrap; call words need not be unique over time, since every one is reset after use.
// Every epoch number is legal, 0 included (a communicator's first call is 1, and after the wrap 0 follows
// kEpochPeriod - 1); kNoEpoch, outside the period, stands for "no call" where a word must say so (Mailbox).
constexpr int kBuffers = 3;
constexpr uint32_t kEpochPeriod = 3u << 30;
constexpr uint32_t kNoEpoch = 0xFFFFFFFFu;
ROCENANTE_HD uint32_t next_epoch(uint32_t e) { return e + 1 == kEpochPeriod ? 0 : e + 1; }
ROCENANTE_HD uint32_t previous_epoch(uint32_t e) { return e == 0 ? kEpochPeriod - 1 : e - 1; }
// Whether call `a` came at or before call `b`, across the wrap: the calls a rank compares are never half a
// period apart (that would take 1.6e9 calls in flight).
ROCENANTE_HD bool epoch_at_or_before(uint32_t a, uint32_t b) {
  const uint32_t distance = b >= a ? b - a : b + (kEpochPeriod - a);  // below kEpochPeriod: no overflow
  return distance < kEpochPeriod / 2;
}
ROCENANTE_HD int buffer_of(uint32_t epoch) { return int(epoch % kBuffers); }
ROCENANTE_HD int previous_buffer(uint32_t epoch) { return int((epoch + kBuffers - 1) % kBuffers); }

// Most ranks a communicator serves: the kernel holds one line pair per rank in registers while it waits,
// and one-shot (every rank receives world-1 full inputs) stops paying beyond one 8-GPU host anyway.
constexpr int kMaxRanks = 8;
// Capacity bounds: a multiple of kCapacityGranule, and small enough that a piece's element count fits the
// signature.
constexpr size_t kMaxCapacityBytes = size_t(32) << 20;

// The collectives, and how an all-reduce moves its data (protocol v6):
//   all-reduce, one-shot: every rank pushes its whole input into its area of every peer's region; each rank
//     reduces all inputs. The fused variant adds the residual and applies RMSNorm to the sum (CallArgs).
//   all-reduce, two-shot: the tensor is cut into `world` shards (Shards, below); every rank pushes shard p of its
//     input into peer p's region, reduces its own shard from every rank's, and pushes the reduced shard into every
//     peer's region; each rank then holds every reduced shard. Each element is reduced by one rank, in rank order
//     with the same arithmetic as one-shot, so the bits equal one-shot's and every rank's.
//   reduce-scatter: the first exchange of two-shot, each rank's output its own reduced shard.
//   all-gather: each rank pushes its input (a shard) into every peer's region; each rank concatenates them.
//   all-to-all: the tensor is `world` blocks; every rank pushes block p of its input into peer p's region (as
//     reduce-scatter does) and copies what each peer s pushed into block s of its output, its own block from its
//     input: the exchange that cuts tokens to their experts' ranks (expert parallelism).
// Over a network wire a delivery carries one call, so there a two-shot piece is two calls, numbers e and e + 1
// (calls_of(), call_args.h): a reduce-scatter that leaves each rank's reduced shard in its place in the
// output, then an all-gather of that shard. Both carry the two-shot signature, so a peer that makes another call
// differs at the first, and the second is never mistaken for a call of its own; and both the dtype's format (the
// shard is reduced, so sanitized: the Lamport format carries it; format_of(args)). The host loop makes them one
// after the other. The kernel makes both in one launch: it pushes and rings call e, resets the buffer of the call
// before, reduces its shard into its image of call e + 1 (with e + 1's call word), rings e + 1 once every CTA has
// (a second count), then gathers. The peers and the proxy see the calls as two launches would make them; the
// mailbox's slot per buffer holds, as e + 1 is rung only once the peers' data of e is in. Only the reset differs:
// the launch leaves buffer e % 3 as call e left it (no CTA knows for sure when the launch's reads of call e are
// over: the gate before the gather, sharded_kernel, may give up at the timeout), where a launch of its own would
// reset it during call e + 1. That buffer is next written by call e + 3, which a peer sends once it has our data of
// e + 2; a reset would then have to come before the next launch's push, on its critical path. None is needed:
// a network peer's words are read only after its delivery's signal, and a delivery writes its call word and all
// that the receiver reads before that (Mailbox), so nothing left there from call e is read by a later call of the
// buffer.
// The buffer's next reset is the usual one of call e + 3's footprint, by the call after it (the kernel keeps the
// footprint of each launch's last call).
enum class Collective : uint32_t {
  kAllReduce = 0,
  kFusedAllReduce = 1,
  kAllGather = 2,
  kReduceScatter = 3,
  kAllToAll = 4,
  kAllToAllV = 5,
};
enum class Algorithm : uint32_t { kOneShot = 0, kTwoShot = 1 };

// Signature of a call: the element count minus one (< 2^24, since capacity <= 32 MiB and elements are >= 2
// bytes; the count of the whole tensor: an all-gather's output, a reduce-scatter's input, an all-to-all's
// input), dtype, op, and what the call is (its kind: collective and algorithm), packed injectively into bits
// 1..31. Bit 0 stays clear for make_flag. A rank whose call differs from its peer's in any of these is told which
// call the peer made, never reduces or copies its data:
//   - the collective and algorithm decide where each rank's data lies in the areas (Shards) and what it is (an
//     input, a reduced shard), so calls that differ there exchange words that mean different things even when
//     their byte counts agree;
//   - the fused all-reduce exchanges exactly the data of a plain one of the same count, dtype and op, but its
//     rounding of the norm can differ in the last bit from the caller's own ops, and every rank must produce the
//     same bits. What the fused epilogue takes besides (row length, eps, gamma, the residual) shapes only what
//     each rank computes from the reduced rows, as a caller's ops after a plain all-reduce would; like the data
//     itself, keeping it alike is the caller's part.
// An all-gather and an all-to-all move bits, not values: their op field is sum, whatever the caller's.
// The kind takes bits 29..31: the first four collectives with the algorithm (bit 31), all-to-all code 6 (v4 had
// no all-to-all; its collective field, two bits, was full). Two-shot serves all-reduces only, so the codes of
// an all-gather or a reduce-scatter with two-shot (6, 7) were never signed, and 6 is all-to-all's, 7 the split
// all-to-all's (v6; kAllToAllV, below: its count field is the capacity of a block): one code per kind, as the
// signature must be injective. (A two-shot piece's calls over a network wire carry collectives of their own in
// CallArgs, piece_call(), but the piece's signature.)
constexpr uint32_t kAllToAllKind = 6, kAllToAllVKind = 7;
ROCENANTE_HD uint32_t call_kind(Collective collective, Algorithm algorithm) {
  if (collective == Collective::kAllToAll) return kAllToAllKind;
  if (collective == Collective::kAllToAllV) return kAllToAllVKind;
  return (uint32_t(algorithm) << 2) | uint32_t(collective);
}
ROCENANTE_HD uint32_t call_signature(size_t count, DType dtype, ReduceOp op, Collective collective = Collective::kAllReduce,
                                     Algorithm algorithm = Algorithm::kOneShot) {
  return (call_kind(collective, algorithm) << 29) | (uint32_t(count - 1) << 5) | (uint32_t(dtype) << 3) |
         (uint32_t(op) << 1);
}
ROCENANTE_HD size_t signature_count(uint32_t sig) { return ((sig >> 5) & 0xFFFFFFu) + 1; }
ROCENANTE_HD DType signature_dtype(uint32_t sig) { return DType((sig >> 3) & 3); }
ROCENANTE_HD ReduceOp signature_op(uint32_t sig) { return ReduceOp((sig >> 1) & 3); }
ROCENANTE_HD Collective signature_collective(uint32_t sig) {
  if (sig >> 29 == kAllToAllKind) return Collective::kAllToAll;
  return sig >> 29 == kAllToAllVKind ? Collective::kAllToAllV : Collective((sig >> 29) & 3);
}
ROCENANTE_HD Algorithm signature_algorithm(uint32_t sig) {
  return sig >> 29 >= kAllToAllKind ? Algorithm::kOneShot : Algorithm(sig >> 31);
}
static_assert(kMaxCapacityBytes / 2 <= (size_t(1) << 24), "count - 1 of the largest piece fits in 24 bits");

// Format of a call's data in the areas: an all-gather or an all-to-all returns every bit it was given (-0.0 and
// NaN payloads included), which the Lamport format cannot carry (its empty word is a float's -0.0), so they travel
// as lines (but a two-shot piece's second call: format_of(args), call_args.h); the reductions as format_of(dtype).
constexpr ROCENANTE_HD Format format_of(Collective c, DType t) {
  return c == Collective::kAllGather || c == Collective::kAllToAll || c == Collective::kAllToAllV ? Format::kLines
                                                                                                  : format_of(t);
}

// Where the calls that cut the tensor into shards (two-shot, reduce-scatter, all-gather, all-to-all) put each
// rank's data. The tensor (an all-gather's output, a reduce-scatter's or two-shot's input, an all-to-all's input
// and output alike) is `world` shards of shard_bytes each (two-shot: a whole number of chunks, the last shards
// shorter or empty; the others: count / world elements each). In an area, shard s takes slot s: chunks
// [s * slot_chunks, (s + 1) * slot_chunks), its chunk j holding the shard's bytes [16 j, 16 j + 16) (the last
// one zero-padded). What lands in area (b, s) of rank r's region, all of it written by s:
//   - slot r: shard r of s's input (two-shot's first exchange, reduce-scatter), which r reduces, or which r copies
//     out as block s of its output (all-to-all);
//   - slot s: s's reduced shard (two-shot's second exchange) or s's input (all-gather), which r copies out.
// The two never overlap (r != s), so one call word and one buffer serve both exchanges of a two-shot call: what
// is not kEmpty in either slot is this call's (layout.h's argument, above, holds word for word). Over a network
// wire each peer is delivered the slot it reads (delivery_range(), above), in whole groups of lines, which may
// reach into a neighbouring slot; a reducer reads only the slots above, and only after the delivery's signal, so
// what else lands there is never taken for data.
// A reset (during the next call of the buffer's) writes kEmpty over slots r and s of each area (b, s): whatever
// the call was, every slot written was one of those.
struct Shards {
  size_t shard_bytes;   // bytes of the tensor per shard
  size_t slot_chunks;   // chunks of a slot: ceil(shard_bytes / 16)
  size_t total_bytes;   // bytes of the whole tensor
  ROCENANTE_HD size_t bytes_of(int s) const {  // bytes of shard s (two-shot: the last ones shorter or empty)
    const size_t begin = size_t(s) * shard_bytes;
    return begin >= total_bytes ? 0 : (total_bytes - begin < shard_bytes ? total_bytes - begin : shard_bytes);
  }
  ROCENANTE_HD size_t chunks_of(int s) const { return (bytes_of(s) + kChunkBytes - 1) / kChunkBytes; }
};
// Two-shot cuts `bytes` into whole chunks, `world` shards as even as chunks allow.
ROCENANTE_HD Shards two_shot_shards(size_t bytes, int world) {
  const size_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  const size_t slot = (chunks + size_t(world) - 1) / size_t(world);
  return {slot * kChunkBytes, slot, bytes};
}
// Reduce-scatter, all-gather and all-to-all: `world` shards of `shard_bytes` each.
ROCENANTE_HD Shards even_shards(size_t shard_bytes, int world) {
  return {shard_bytes, (shard_bytes + kChunkBytes - 1) / kChunkBytes, shard_bytes * size_t(world)};
}
// Bytes of an area a sharded call may write (span_bytes() of its slots).
ROCENANTE_HD size_t slots_span_bytes(const Shards& s, int world, Format f) {
  const size_t bytes = size_t(world) * s.slot_chunks * kChunkBytes;
  if (f == Format::kLamport) return bytes;
  const size_t group = kChunkBytes * kChunksPerGroup;
  return (bytes + group - 1) / group * group * kLinesPerChunk;
}
// Largest slot (in chunks) of a sharded call in an area of `capacity_bytes`.
ROCENANTE_HD size_t max_slot_chunks(size_t capacity_bytes, int world, Format f) {
  return capacity_bytes / (kChunkBytes * size_t(world) * (f == Format::kLamport ? 1 : kLinesPerChunk));
}

// A split all-to-all (kAllToAllV: blocks of any size, as torch's all_to_all_single with split lists) moves at most
// `capacity` elements (the signature's count) from each rank to each. Each block takes a slot of 2^k chunks
// (blocks_slot_log2()) in its area, slot r for receiver r as the other sharded calls place it: the slot's first
// chunk a header {the block's bytes, 0, 0, 0}, the block from its second chunk on, all of it in lines. Rank s
// writes into area (b, s) of rank r's region only slot r, and of it only its first 1 + ceil(bytes / 16) chunks.
// Rank r waits for the header, checks the size against the one it expects from s (a fact only the two of them
// share: its own split lists, or at most the capacity in the counts form), and only then waits for and copies out
// the block: a size it does not expect is a fault naming s (kSplitMismatch), never a block cut short or read past.
// The call's footprint and its deliveries cover only the chunks written (headed_footprint(): from its lists each
// rank knows the most it sends and receives; in the counts form, where the host knows neither, the whole slot).
ROCENANTE_HD int blocks_slot_log2(size_t capacity, DType t) {
  const size_t chunks = 1 + (capacity * dtype_size(t) + kChunkBytes - 1) / kChunkBytes;
  int k = 0;
  while ((size_t(1) << k) < chunks) ++k;
  return k;
}
static_assert(kMaxCapacityBytes / (kChunkBytes * kLinesPerChunk * 2) < (1u << kHeadedLog2Shift),
              "a slot's chunks (at least two slots of lines an area) lie below a headed footprint's log2 field");
// The most elements a block may hold in an area of `capacity_bytes`: the largest slot of 2^k chunks that world
// slots of lines fit, less its header.
ROCENANTE_HD size_t largest_block(size_t capacity_bytes, int world, DType t) {
  const size_t slots = max_slot_chunks(capacity_bytes, world, Format::kLines);
  size_t slot = 1;
  while (slot * 2 <= slots) slot *= 2;
  return (slot - 1) * kChunkBytes / dtype_size(t);
}

// Never kEmpty (bit 0 set). For a fixed epoch it is injective in the signature, so a flag tells exactly which
// call the peer made: signature = (flag ^ (epoch << 1)) & ~1.
ROCENANTE_HD uint32_t make_flag(uint32_t signature, uint32_t epoch) { return (signature ^ (epoch << 1)) | 1u; }
ROCENANTE_HD uint32_t flag_signature(uint32_t flag, uint32_t epoch) { return (flag ^ (epoch << 1)) & ~1u; }

// Words that a GPU writes and words that another agent (a host thread, a NIC) writes never share a 128-byte line
// (the GPU's L2 line): nothing promises that the GPU's write of part of a line of host memory leaves the rest
// of the line as the other agent last wrote it. What made us look: on an H200 over the TCP wire, with the
// mailbox's ring words (the kernel's) and arrival words (the proxy's) in one line, in 4 of 11 runs of 1,000
// iterations of calls on two streams a call timed out on both ranks while some threads of the same launch had
// completed it, and at the timeout its arrival word held the buffer's previous epoch (which only the proxy
// writes, one epoch after another; benchmarks/logs/h200-two-streams-arrival-lost.log). The split alone did not
// end those timeouts; the kernel also reads such words with a load that refetches cached system-memory lines
// (memory_order.cuh, load_polled).
constexpr size_t kLineBytes = 128;

// The region header: the abort words (written by the peers and this rank's host, never by its GPU), the
// arrival flags (written by network peers' wires, Mailbox), then the call words of each buffer on a line of
// their own (the GPU resets the previous buffer's while a peer's next call word may be landing in the current
// one's), then padding so that the areas start on a 512-byte boundary (a warp's 16-byte stores then cover
// whole sectors).
constexpr size_t kHeaderBytes = 1024;
// A network peer's data may come striped over up to kMaxRails queue pairs ("rails": the two PCIe functions of a
// DGX Spark's port), each stripe followed by its own flag word on its own queue pair (Mailbox, below).
constexpr int kMaxRails = 2;
constexpr size_t kArrivalFlagsOffset = kLineBytes;
constexpr size_t kCallWordsOffset = 3 * kLineBytes;
static_assert(kMaxRanks * 2 * sizeof(uint64_t) <= kArrivalFlagsOffset &&
                  kBuffers * kMaxRanks * kMaxRails * sizeof(uint32_t) <= kCallWordsOffset - kArrivalFlagsOffset &&
                  kMaxRanks * sizeof(uint32_t) <= kLineBytes && kCallWordsOffset + kBuffers * kLineBytes <= kHeaderBytes &&
                  kHeaderBytes % 512 == 0,
              "the header holds the abort words, the flags, and a line of call words per buffer");

struct RegionLayout {
  size_t capacity_bytes;  // bytes of one area: a multiple of kCapacityGranule
  int world;

  ROCENANTE_HD size_t region_bytes() const {
    return kHeaderBytes + size_t(kBuffers) * size_t(world - 1) * capacity_bytes;
  }
  // Byte offset, in `receiver`'s region, of the area where `source` writes for a call using `buffer`. A rank
  // has no area for itself (it reduces its own input in place), so sources above the receiver move down one.
  ROCENANTE_HD size_t area_offset(int buffer, int receiver, int source) const {
    const int index = source < receiver ? source : source - 1;
    return kHeaderBytes + (size_t(buffer) * size_t(world - 1) + size_t(index)) * capacity_bytes;
  }
};
// A region is addressed as 32-bit words (the unit of kEmpty); these name its parts. An abort slot is {word,
// check} (Abort words, above).
constexpr size_t kAbortSlotBytes = 2 * sizeof(uint64_t);
ROCENANTE_HD uint64_t* abort_word(uint32_t* region, int source) { return reinterpret_cast<uint64_t*>(region) + 2 * source; }
ROCENANTE_HD uint64_t* abort_check(uint32_t* region, int source) { return abort_word(region, source) + 1; }
// Whether an abort slot read as (word, check) holds a word, whole (Abort words, above).
ROCENANTE_HD bool abort_whole(uint64_t word, uint64_t check) { return word != 0 && word == ~check; }
// The word in abort slot `source` of `region`, read with `load` (the host's and the kernel's atomic loads differ),
// once whole; else 0.
template <class Load>
ROCENANTE_HD uint64_t whole_abort_word(uint32_t* region, int source, Load load) {
  const uint64_t w = load(abort_word(region, source));
  return w != 0 && abort_whole(w, load(abort_check(region, source))) ? w : 0;
}
ROCENANTE_HD size_t call_word_offset(int buffer, int source) {
  return kCallWordsOffset + size_t(buffer) * kLineBytes + size_t(source) * sizeof(uint32_t);
}
ROCENANTE_HD uint32_t* call_word(uint32_t* region, int buffer, int source) {
  return region + call_word_offset(buffer, source) / sizeof(uint32_t);
}
// The arrival flags as an array [buffer][source][rail] of u32, kNoEpoch until written (Mailbox says by whom).
ROCENANTE_HD size_t arrival_index(int buffer, int source) { return (size_t(buffer) * kMaxRanks + size_t(source)) * kMaxRails; }
ROCENANTE_HD size_t arrival_flag_offset(int buffer, int source) {
  return kArrivalFlagsOffset + arrival_index(buffer, source) * sizeof(uint32_t);
}
ROCENANTE_HD uint32_t* arrival_flags(uint32_t* region) { return region + kArrivalFlagsOffset / sizeof(uint32_t); }
// Whether source s's call `epoch` has arrived whole, its arrival words (arrivals + arrival_index(b, s)) read with
// `load` (the host's and the kernel's loads differ): every rail's word holds the epoch (Mailbox, below).
template <class Load>
ROCENANTE_HD bool arrived_whole(const uint32_t* words, uint32_t epoch, Load load) {
#pragma unroll
  for (int k = 0; k < kMaxRails; ++k)
    if (load(words + k) != epoch) return false;
  return true;
}
ROCENANTE_HD uint32_t* area(uint32_t* region, const RegionLayout& l, int buffer, int receiver, int source) {
  return region + l.area_offset(buffer, receiver, source) / sizeof(uint32_t);
}
// The value word `index` of a fresh region holds: 0 in the abort words, kNoEpoch in the arrival flags' line,
// kEmpty everywhere else.
ROCENANTE_HD uint32_t initial_word(size_t index) {
  if (index < kArrivalFlagsOffset / sizeof(uint32_t)) return 0u;
  return index < kCallWordsOffset / sizeof(uint32_t) ? kNoEpoch : kEmpty;
}

// Network transports: the reducer (kernel or host loop) and its proxy thread (transport/proxy.cc) meet in a
// mailbox of host memory (mapped for the kernel). The reducer writes into an image of each network peer's region,
// and:
//   ring[b] = (delivery << 32) | epoch of the last call that used buffer b, stored with release at system
//     scope once every store of that call into the image is visible (the kernel: by its last CTA, after a
//     system-scope fence); the proxy then delivers that call's call word and, of its area, what each network
//     peer reads (delivery_range(), above) to that peer.
//     A reducer rings only for a call it wrote whole, call word and every chunk. The image is never reset, so
//     a part it did not write holds an older call's words, which a peer would take for this call's: a call
//     word of epoch e - 3 equals one of epoch e whose signature differs just so (make_flag), and any area
//     word passes for data. A reducer that found its communicator faulted sends nothing and does not ring (nor
//     does a launch of which any thread sent nothing); its peers, waiting for a delivery that never comes, stop
//     at its abort word, which the host sends (Communicator::current_fault), and name its root cause.
// The reducer reads network peer s's call word and area of call e (buffer b = e % 3) only after it read the
// arrival word of (b, s) equal to e (acquire; the kernel: a refetching load, then a fence, memory_order.cuh). Which word
// that is, the signal says (Signal, transport.h; every rank alike):
//   flag (default): flag[b][s][0..kMaxRails) in the reducer's own region, each word written with e by s's wire
//     after call e's call word and area, over the same connection (an RDMA reliable-connected queue pair, which
//     places its writes in order: ibverbs.cc says on what grounds; the TCP wire places them after the delivery's
//     data). A delivery striped over rails (ibverbs.cc) is a stripe per queue pair, and each rail's word follows
//     its own stripe on its own queue pair; the words of rails that carried nothing of the call follow the data
//     on the first rail, as all of them do for a call not striped. So every word equals e only once every stripe
//     was placed, and the reducer waits for all of them (arrived_whole()). No host thread of the receiving rank
//     takes part.
//   completion: the mailbox's arrived[b][s][*], stored with release by this rank's proxy once the wire reported
//     s's delivery whole (a receive completion after the data: for fabrics that place writes out of order; such
//     a delivery is never striped).
// Each arrival word of buffer b holds, one after another, the epochs of the calls that used b (e, e + 3, ...)
// and is never reset: before call e's delivery is whole it holds e - 3 or kNoEpoch (its start), never e. A
// rail's word of call e - 3 cannot land after the first rail's word of call e: the reducer read it before its
// call e - 3 ended, and the sender makes call e only after that (the slot argument below), while an RC queue
// pair executes a write once. A wire
// guarantees neither placement order among a delivery's data nor word atomicity while it lands (transport.h);
// this wait is why neither is needed. No stale delivery after a fault follows: a call's flag is posted only
// after its call word and area, and only for a call the reducer rang, that is, wrote whole.
// One slot per buffer, since neither side may overwrite a value the other has not taken yet: a rank can ring
// call e + 1 before its proxy took call e (the peers' data of call e lets this rank finish call e, whether or not
// ours has left), but not call e + 2 (the peers send call e + 1 only once they have our data of call e); in the
// same way a peer's call e + 1 may arrive before this rank's reducer read the arrival word of call e, its call
// e + 2 cannot. The proxy counts calls exactly as the reducers do (every call goes to every peer, one delivery each),
// so the n-th delivery it takes from a peer is that peer's call of the n-th epoch.
// The ring (the reducer's) and the arrival words (the proxy's) lie on separate lines (kLineBytes).
struct Mailbox {
  alignas(kLineBytes) uint64_t ring[kBuffers];               // kNoEpoch (its low half) until the buffer's first call
  alignas(kLineBytes) uint32_t arrived[kBuffers][kMaxRanks][kMaxRails];  // completion signal only; as the flags
};
ROCENANTE_HD uint64_t ring_word(uint32_t delivery, uint32_t epoch) { return (uint64_t(delivery) << 32) | epoch; }

}  // namespace rocenante
