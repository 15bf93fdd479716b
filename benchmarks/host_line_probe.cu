// Does a GPU that stored into a line of mapped host memory later read that line as a host thread wrote it? The
// kernel resets (kEmpty, system-scope stores) the call words and areas of its region, which in host memory a
// wire's host thread then writes; in some runs of the two-streams test over the TCP wire part of a launch's
// threads kept reading words as they were three calls earlier (memory_order.cuh, load_polled). On one H200 this probe
// found no stale read, with or without the store (benchmarks/logs/h200-two-streams-cv.log). Per round, every
// thread of the grid owns 16 bytes of pinned, mapped host memory, each on a 128-byte line of its own:
//   1. `stored`: the thread stores kEmpty into its 16 bytes (st.relaxed.sys.v4, as the reset does) or, in the
//      control, nothing; a system-scope fence; the grid's last CTA releases round r (device counter);
//   2. the host thread waits for round r, writes r into every word (plain stores), then releases r;
//   3. every thread acquires r, then polls its 16 bytes (ld.volatile.v4, as the kernel polls) until all four
//      words read r, or gives up after `limit` polls and counts a stale read.
// Printed: stale reads of each variant over all rounds and threads, and the polls a thread needed at most.
//   nvcc -O2 -arch=sm_90 -o /tmp/host_line_probe benchmarks/host_line_probe.cu -lpthread && /tmp/host_line_probe
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <cuda_runtime.h>

#include "../csrc/cuda_check.h"  // ROCENANTE_CHECK_CUDA: a failed call throws, naming itself

constexpr unsigned kEmpty = 0x80000000u;
constexpr int kLineWords = 32;  // 128 bytes

struct Turns {
  alignas(128) unsigned gpu;   // last round the GPU has stored (or not) and released
  alignas(128) unsigned host;  // last round the host has written
};

__device__ unsigned load_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void probe(unsigned* lines, Turns* turns, unsigned* done_ctas, unsigned long long* stale,
                      unsigned* max_polls, int rounds, bool stored, int limit) {
  unsigned* mine = lines + size_t(blockIdx.x * blockDim.x + threadIdx.x) * kLineWords;
  for (int r = 1; r <= rounds; ++r) {
    if (stored)
      asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(mine), "r"(kEmpty) : "memory");
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(done_ctas, 1) == r * gridDim.x - 1)
      asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(&turns->gpu), "r"(unsigned(r)) : "memory");
    if (threadIdx.x == 0)
      while (load_acquire_sys(&turns->host) != unsigned(r)) {
      }
    __syncthreads();
    (void)load_acquire_sys(&turns->host);
    int polls = 0;
    for (;; ++polls) {
      unsigned w[4];
      asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "l"(mine)
                   : "memory");
      if (w[0] == unsigned(r) && w[1] == unsigned(r) && w[2] == unsigned(r) && w[3] == unsigned(r)) break;
      if (polls == limit) {
        atomicAdd(stale, 1ull);
        break;
      }
    }
    atomicMax(max_polls, unsigned(polls));
  }
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int blocks = 132, threads = 256, limit = 1 << 16;
  const size_t lines_n = size_t(blocks) * threads;
  for (bool stored : {false, true}) {
    unsigned* lines = nullptr;
    Turns* turns = nullptr;
    ROCENANTE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&lines), lines_n * kLineWords * 4, cudaHostAllocMapped));
    ROCENANTE_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&turns), sizeof(Turns), cudaHostAllocMapped));
    for (size_t i = 0; i < lines_n * kLineWords; ++i) lines[i] = kEmpty;
    turns->gpu = turns->host = 0;
    unsigned *done_ctas, *max_polls, *d_lines;
    unsigned long long* stale;
    Turns* d_turns;
    ROCENANTE_CHECK_CUDA(cudaMalloc(&done_ctas, 4));
    ROCENANTE_CHECK_CUDA(cudaMalloc(&max_polls, 4));
    ROCENANTE_CHECK_CUDA(cudaMalloc(&stale, 8));
    ROCENANTE_CHECK_CUDA(cudaMemset(done_ctas, 0, 4));
    ROCENANTE_CHECK_CUDA(cudaMemset(max_polls, 0, 4));
    ROCENANTE_CHECK_CUDA(cudaMemset(stale, 0, 8));
    ROCENANTE_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_lines), lines, 0));
    ROCENANTE_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_turns), turns, 0));
    std::thread host([&] {
      auto* gpu = reinterpret_cast<std::atomic<unsigned>*>(&turns->gpu);
      auto* mine = reinterpret_cast<std::atomic<unsigned>*>(&turns->host);
      for (int r = 1; r <= rounds; ++r) {
        while (gpu->load(std::memory_order_acquire) != unsigned(r)) {
        }
        for (size_t l = 0; l < lines_n; ++l)
          for (int k = 0; k < 4; ++k) reinterpret_cast<volatile unsigned*>(lines)[l * kLineWords + k] = r;
        mine->store(r, std::memory_order_release);
      }
    });
    probe<<<blocks, threads>>>(d_lines, d_turns, done_ctas, stale, max_polls, rounds, stored, limit);
    ROCENANTE_CHECK_CUDA(cudaGetLastError());
    ROCENANTE_CHECK_CUDA(cudaDeviceSynchronize());
    host.join();
    unsigned long long stale_h = 0;
    unsigned max_h = 0;
    ROCENANTE_CHECK_CUDA(cudaMemcpy(&stale_h, stale, 8, cudaMemcpyDeviceToHost));
    ROCENANTE_CHECK_CUDA(cudaMemcpy(&max_h, max_polls, 4, cudaMemcpyDeviceToHost));
    std::printf("%-28s rounds %d, threads %zu: stale reads %llu (gave up after %d polls), most polls %u\n",
                stored ? "GPU stored into the line:" : "GPU never stored (control):", rounds, lines_n, stale_h,
                limit, max_h);
    ROCENANTE_CHECK_CUDA(cudaFreeHost(lines));
    ROCENANTE_CHECK_CUDA(cudaFreeHost(turns));
    ROCENANTE_CHECK_CUDA(cudaFree(done_ctas));
    ROCENANTE_CHECK_CUDA(cudaFree(max_polls));
    ROCENANTE_CHECK_CUDA(cudaFree(stale));
  }
  return 0;
}
