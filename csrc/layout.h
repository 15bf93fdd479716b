// The receive region every rank exposes to its peers, and the line format that carries data into it.
// Shared by the host path (shared memory, CPU reduction) and the kernel (CUDA IPC): one protocol, one layout.
//
// Region of rank r:   header (abort[world]) | slot[2] x source[world] x line[capacity_bytes / 8]   (Line = 16 bytes)
//   written by: source s writes only abort[s] and source[s] of every peer's region (its own input, pushed);
//               r's own host writes abort[r] of r's region (a fault only it knows of: a peer's process ended,
//               a call it refused), which stops r's own waits;
//   read by:    rank r reads source[*] of its own region, then writes every line it read back to zero.
//
// Line: {data0, flag, data1, flag} carries 8 payload bytes. The sender writes it with one 16-byte store and
// the receiver reads it with one 16-byte load. We rely only on each 8-byte half {data, flag} being written
// atomically (as NCCL's LL protocol does, over NVLink, PCIe and RDMA alike): a half whose flag is current
// holds current data, so the flag can never become visible before its payload and no fence is needed.
//
// Flag of a call = make_flag(signature of the call, epoch). The epoch counts calls, identically on every rank.
//   - A half with flag == the expected value is this call's data from that peer.
//   - A half with flag == 0 has not arrived yet (the receiver zeroed it after its last use).
//   - Any other value means the peer made a different call (size, dtype or op); the signature inside the
//     flag says which, and the communicator reports both calls.
// Because the receiver zeroes what it read, no stale flag survives into a later call, so flags never need
// to be unique over time and epoch wrap-around is harmless.
//
// Why two slots suffice: calls alternate slots (slot = epoch & 1). A sender in call e+1 writes slot (e+1)&1,
// last read by the receiver in call e-1. The sender got past call e only after receiving the receiver's data
// for call e, which the receiver sends only after it finished (and zeroed) everything of call e-1.
// That argument needs calls to execute in the order every rank issued them: the communicator orders each
// call after the previous one whatever stream or thread issues it (communicator.cc).
//
// Abort words: a rank that faults (timeout, mismatch, a call it refused alone, Ctrl-C) writes a nonzero
// abort word, encode_fault(its fault kind, detail, its epoch), into abort[rank] of every peer's region, over
// the same transport as the data. Every wait polls its own header at each timer read, so a survivor stops
// waiting for a peer known to be gone instead of running into the timeout. Abort words are never cleared:
// a faulted communicator stays faulted, and every output it does not compute is poisoned (poison_word()).
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

struct alignas(16) Line {
  uint32_t data0, flag0, data1, flag1;
};
static_assert(sizeof(Line) == 16, "a line is one 16-byte store");
constexpr size_t kLinePayloadBytes = 8;
// One unit of work (a GPU thread, a CPU loop step) reads 16 input bytes and sends them as two lines.
constexpr size_t kChunkBytes = 16;
constexpr size_t kLinesPerChunk = kChunkBytes / kLinePayloadBytes;
// Chunks are laid out in groups of one warp: the group's first lines, then its second lines. A warp-wide
// 16-byte store (or poll) then covers 512 contiguous bytes, whole sectors, instead of every other 16 bytes.
constexpr size_t kChunksPerGroup = 32;
ROCENANTE_HD size_t chunk_line(size_t chunk, int half) {
  return (chunk / kChunksPerGroup) * (kChunksPerGroup * kLinesPerChunk) + half * kChunksPerGroup + chunk % kChunksPerGroup;
}
// Capacity is a whole number of chunk groups, so chunk_line() stays inside a source's slot.
constexpr size_t kCapacityGranule = kChunkBytes * kChunksPerGroup;

// Most ranks a communicator serves: the kernel holds one line pair per rank in registers while it waits,
// and one-shot (every rank receives world-1 full inputs) stops paying beyond one 8-GPU host anyway.
constexpr int kMaxRanks = 8;
// Capacity bounds: a multiple of one chunk, and small enough that the element count fits the signature.
constexpr size_t kMaxCapacityBytes = size_t(128) << 20;

// Signature of a call: the element count (< 2^27, since capacity <= 128 MiB and elements are >= 2 bytes),
// dtype and op, packed injectively into bits 1..31. Bit 0 stays clear for make_flag.
ROCENANTE_HD uint32_t call_signature(size_t count, DType dtype, ReduceOp op) {
  return (uint32_t(count) << 5) | (uint32_t(dtype) << 3) | (uint32_t(op) << 1);
}
ROCENANTE_HD size_t signature_count(uint32_t sig) { return sig >> 5; }
ROCENANTE_HD DType signature_dtype(uint32_t sig) { return DType((sig >> 3) & 3); }
ROCENANTE_HD ReduceOp signature_op(uint32_t sig) { return ReduceOp((sig >> 1) & 3); }

// Never zero (bit 0 set). For a fixed epoch it is injective in the signature, so a flag tells exactly which
// call the peer made: signature = (flag ^ (epoch << 1)) & ~1.
ROCENANTE_HD uint32_t make_flag(uint32_t signature, uint32_t epoch) { return (signature ^ (epoch << 1)) | 1u; }
ROCENANTE_HD uint32_t flag_signature(uint32_t flag, uint32_t epoch) { return (flag ^ (epoch << 1)) & ~1u; }

// The region header: one abort word per source rank, padded so that the slots start on a 512-byte boundary
// (a warp's 16-byte stores then cover whole sectors).
constexpr size_t kHeaderBytes = 512;
static_assert(kMaxRanks * sizeof(uint64_t) <= kHeaderBytes, "the header holds one abort word per rank");

struct RegionLayout {
  size_t capacity_bytes;  // largest payload of one call, a multiple of kCapacityGranule
  int world;

  ROCENANTE_HD size_t lines_per_source() const { return capacity_bytes / kLinePayloadBytes; }
  ROCENANTE_HD size_t region_bytes() const {
    return kHeaderBytes + 2 * size_t(world) * lines_per_source() * sizeof(Line);
  }
  // First line of `source`'s data in `slot` of a region.
  ROCENANTE_HD size_t line_index(int slot, int source) const {
    return kHeaderBytes / sizeof(Line) + (size_t(slot) * world + source) * lines_per_source();
  }
};
// abort[source] of a region.
ROCENANTE_HD uint64_t* abort_word(Line* region, int source) { return reinterpret_cast<uint64_t*>(region) + source; }

// Why a call failed, packed in one 64-bit word so that one plain store publishes it whole.
enum class Fault : uint32_t {
  kNone = 0,
  kPeerTimeout = 1,   // detail: bit mask of the peers that did not arrive
  kCallMismatch = 2,  // detail: the peer; value: the signature of the call it made
  kPeerAborted = 3,   // detail: the peer whose abort word we read; value: abort_cause() of that word
  kPeerExited = 4,    // detail: the peer whose process ended (seen by this rank's watchdog)
  kRefused = 5,       // detail: the rank that refused a call for a reason only it could see
  kInterrupted = 6,   // detail: the rank whose wait a signal (Ctrl-C) interrupted
};
ROCENANTE_HD uint64_t encode_fault(Fault f, uint32_t detail, uint32_t value) {
  return (uint64_t(f) << 56) | (uint64_t(detail & 0xFFFFFFu) << 32) | value;
}
ROCENANTE_HD Fault fault_kind(uint64_t w) { return Fault(w >> 56); }
ROCENANTE_HD uint32_t fault_detail(uint64_t w) { return uint32_t(w >> 32) & 0xFFFFFFu; }
ROCENANTE_HD uint32_t fault_value(uint64_t w) { return uint32_t(w); }
// An abort word is the root cause (kind and detail) of the writer's fault, with its epoch as value: a rank that
// aborts because a peer did passes that peer's cause on, so every rank names the same root cause.
ROCENANTE_HD uint64_t abort_from(uint64_t own_fault, uint32_t epoch) {
  if (fault_kind(own_fault) == Fault::kPeerAborted)
    return encode_fault(Fault(fault_value(own_fault) >> 24), fault_value(own_fault) & 0xFFFFFFu, epoch);
  return encode_fault(fault_kind(own_fault), fault_detail(own_fault), epoch);
}
ROCENANTE_HD uint32_t abort_cause(uint64_t abort) { return (uint32_t(abort >> 56) << 24) | fault_detail(abort); }
// What a rank records when it reads `abort` in abort[source] of its region.
ROCENANTE_HD uint64_t peer_aborted(int source, uint64_t abort) {
  return encode_fault(Fault::kPeerAborted, source, abort_cause(abort));
}

// Where a rank records its first fault: the word, then the call (epoch) it happened in.
// On the GPU it lives in mapped host memory: the kernel writes epoch, then the word (release, system scope);
// the host reads the word (acquire), then the epoch.
struct FaultRecord {
  uint64_t word;
  uint32_t epoch;
  uint32_t zero;
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
