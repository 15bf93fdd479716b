// The fused add + RMSNorm's side of the kernel (CallArgs::norm, collective_kernels.cu): which chunks of a
// row a thread holds, and the row's norm once the CTA holds the whole row.
#pragma once

#include <cstdint>

#include "chunk_io.cuh"
#include "collective_kernel.h"

namespace rocenante {

// A walk (as Strided, collective_kernels.cu) for fused calls: CTA b takes rows b, b + gridDim.x, ...; of each,
// its thread t the chunks t + m * split.threads that lie within the row (m < split.per_thread). The cursor
// counts a thread's (row, m) pairs.
constexpr size_t kNoChunk = ~size_t(0);
struct Rows {
  static constexpr bool kGaps = true;  // a thread may hold fewer chunks of a row than per_thread
  RowSplit split;
  size_t rows;
  __device__ bool holds(uint32_t m) const { return m * split.threads + threadIdx.x < split.row_chunks; }
  __device__ size_t chunk(size_t row, uint32_t m) const {
    return row * split.row_chunks + m * split.threads + threadIdx.x;
  }
  __device__ size_t row_of(size_t k) const { return blockIdx.x + (k / split.per_thread) * gridDim.x; }
  __device__ size_t start() const { return 0; }
  __device__ bool done(size_t k) const { return row_of(k) >= rows; }
  __device__ size_t chunk(size_t k, int i) const {
    const uint32_t m = uint32_t((k + i) % split.per_thread);
    return !done(k + i) && holds(m) ? chunk(row_of(k + i), m) : kNoChunk;
  }
  __device__ size_t next(size_t k) const { return k + kSendBatch; }
};

// The sum of `v` over the CTA's threads, in a fixed order (every rank and every run get the same bits), given
// to every thread. blockDim.x is a multiple of a warp. The caller passes a __syncthreads between two calls, so
// that no warp overwrites its partial sum before every thread has read the previous one.
__device__ inline float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, lanes);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0;
  for (int i = 0; i < int(blockDim.x / 32); ++i) total += warp_sums[i];
  return total;
}

// The fused epilogue of one row, once every thread of the CTA holds its chunks of residual_out (v, rounded to
// the dtype) and the sum of their squares: the CTA adds up the squares, then every thread writes its chunks of
// norm_out = residual_out * rsqrt(mean + eps) * (weight_bias + gamma), in fp32, rounded once.
template <DType D>
__device__ __forceinline__ void write_norm(const CallArgs& a, const Rows& rows, size_t row,
                                           const uint32_t (&v)[kMaxRowChunks][4], float squares) {
  using C = Chunk<D>;
  const RowNorm& n = a.norm;
  uint32_t g[kMaxRowChunks][4];  // loaded before the CTA's sum, so that their latency hides behind it
#pragma unroll
  for (uint32_t m = 0; m < kMaxRowChunks; ++m)
    if (m < rows.split.per_thread && rows.holds(m))
      load_words(n.gamma, (m * rows.split.threads + threadIdx.x) * kChunkBytes,
                 size_t(rows.split.row_chunks) * kChunkBytes, D, g[m]);
  // mean = sum * (1 / hidden), as torch's mean computes it; __fmul_rn: rounded before eps is added (two torch
  // ops), never contracted into one FMA.
  const float scale = rsqrtf(__fmul_rn(block_sum(squares), 1.0f / float(n.hidden)) + n.eps);
#pragma unroll
  for (uint32_t m = 0; m < kMaxRowChunks; ++m) {
    if (m >= rows.split.per_thread || !rows.holds(m)) continue;
#pragma unroll
    for (int i = 0; i < C::kElems; ++i)
      C::store(g[m], i, C::load(v[m], i) * scale * (n.weight_bias + C::load(g[m], i)));
    store_words(n.norm_out, rows.chunk(row, m) * kChunkBytes, a.bytes, D, g[m]);
  }
}

// The fused epilogue serves sums of float dtypes (Communicator::fuses_add_rmsnorm()).
template <DType D, ReduceOp Op>
constexpr bool kFusable = format_of(D) == Format::kLamport && Op == ReduceOp::kSum;

}  // namespace rocenante
