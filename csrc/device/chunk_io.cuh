// One 16-byte chunk as a thread of the kernel moves it: from and to the caller's tensors (any element
// alignment), and over the wire in its dtype's format (layout.h: Lamport words, or int32 lines).
#pragma once

#include <cstdint>

#include "../call_args.h"
#include "../chunk_reduce.h"
#include "../fault.h"
#include "memory_order.cuh"

namespace rocenante {

constexpr int kSendBatch = 4;  // chunks a thread loads before it sends them (their loads all in flight)

// The 16 bytes at byte `begin` of a tensor of `bytes` bytes, as four words (little-endian, as in memory).
__device__ inline void load_words(const void* base, size_t begin, size_t bytes, DType dtype, uint32_t (&w)[4]) {
  const char* src = static_cast<const char*>(base) + begin;
  if (begin + kChunkBytes <= bytes && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    return;
  }
  // Tail chunk, or a tensor that is only element-aligned: element by element, zero-padded.
  w[0] = w[1] = w[2] = w[3] = 0;
  const int n = int(min(kChunkBytes, bytes - begin));
  // Constant trip counts keep w[] in registers (a run-time index would move it to local memory).
  if (dtype_size(dtype) == 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (2 * i < n) w[i / 2] |= uint32_t(reinterpret_cast<const uint16_t*>(src)[i]) << (16 * (i % 2));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * i < n) w[i] = reinterpret_cast<const uint32_t*>(src)[i];
  }
}

__device__ inline void store_words(void* base, size_t begin, size_t bytes, DType dtype, const uint32_t (&w)[4]) {
  char* dst = static_cast<char*>(base) + begin;
  if (begin + kChunkBytes <= bytes && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
  const int n = int(min(kChunkBytes, bytes - begin));
  if (dtype_size(dtype) == 2) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (2 * i < n) reinterpret_cast<uint16_t*>(dst)[i] = uint16_t(w[i / 2] >> (16 * (i % 2)));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * i < n) reinterpret_cast<uint32_t*>(dst)[i] = w[i];
  }
}

__device__ inline void store_poison(void* base, size_t begin, size_t bytes, DType dtype) {
  const uint32_t p = poison_word(dtype);
  const uint32_t w[4] = {p, p, p, p};
  store_words(base, begin, bytes, dtype, w);
}

// Chunk c of the input, of the output.
__device__ inline void load_chunk(const CallArgs& a, size_t c, uint32_t (&w)[4]) {
  load_words(a.in, c * kChunkBytes, a.bytes, a.dtype, w);
}
__device__ inline void store_chunk(const CallArgs& a, size_t c, const uint32_t (&w)[4]) {
  store_words(a.out, c * kChunkBytes, a.bytes, a.dtype, w);
}

// Words one thread holds per peer for its chunk: the chunk itself (Lamport), or its two lines.
template <Format F>
constexpr int kWireWords = F == Format::kLamport ? 4 : 4 * int(kLinesPerChunk);

template <Format F>
__device__ __forceinline__ void send_chunk(uint32_t* dst, size_t c, const uint32_t (&w)[4], uint32_t call) {
  if constexpr (F == Format::kLamport) {
    store_remote(dst + c * (kChunkBytes / sizeof(uint32_t)), w);
  } else {
    Line* lines = reinterpret_cast<Line*>(dst);
    store_line(lines + chunk_line(c, 0), w[0], w[1], call);
    store_line(lines + chunk_line(c, 1), w[2], w[3], call);
  }
}

// One poll of a peer's chunk: true once all of it has arrived (its words in `got`).
template <Format F>
__device__ __forceinline__ bool poll_chunk(const uint32_t* src, size_t c, uint32_t call, uint32_t (&got)[kWireWords<F>],
                                           bool host) {
  if constexpr (F == Format::kLamport) {
    uint32_t w[4];
    load_polled(src + c * (kChunkBytes / sizeof(uint32_t)), w, host);
#pragma unroll
    for (int i = 0; i < 4; ++i) got[i] = w[i];
    return w[0] != kEmpty && w[1] != kEmpty && w[2] != kEmpty && w[3] != kEmpty;
  } else {
    const uint32_t* lines = src;
    uint32_t l0[4], l1[4];
    load_polled(lines + chunk_line(c, 0) * 4, l0, host);
    load_polled(lines + chunk_line(c, 1) * 4, l1, host);
#pragma unroll
    for (int i = 0; i < 4; ++i) got[i] = l0[i], got[4 + i] = l1[i];
    return l0[1] == call && l0[3] == call && l1[1] == call && l1[3] == call;
  }
}

// The payload words of a chunk as polled.
template <Format F>
__device__ __forceinline__ void payload(const uint32_t (&got)[kWireWords<F>], uint32_t (&w)[4]) {
  if constexpr (F == Format::kLamport) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = got[i];
  } else {
    w[0] = got[0], w[1] = got[2], w[2] = got[4], w[3] = got[6];
  }
}

// A chunk as it is sent in format F, and as every rank reduces its own input and its results (layout.h).
template <DType D, Format F = format_of(D)>
__device__ __forceinline__ void sanitize(uint32_t (&w)[4]) {
  if constexpr (F == Format::kLamport) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = sanitize_word(w[i], D);
  }
}

}  // namespace rocenante
