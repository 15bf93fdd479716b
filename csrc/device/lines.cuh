// The only memory accesses of the protocol that cross GPUs. See layout.h for why 16-byte volatile accesses
// with the flag in each 8-byte half need no fence: a half is written and observed whole.
#pragma once

#include <cstdint>

#include "../layout.h"

namespace rocenante {

// Store to a peer's region (remote memory through CUDA IPC). volatile: not combined, not cached.
__device__ __forceinline__ void store_line(Line* p, uint32_t d0, uint32_t d1, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag), "r"(d1), "r"(flag)
               : "memory");
}

// Load from our own region; volatile so that every poll reads memory again instead of a cached copy.
__device__ __forceinline__ Line load_line(const Line* p) {
  Line v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.data0), "=r"(v.flag0), "=r"(v.data1), "=r"(v.flag1)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void zero_line(Line* p) {
  asm volatile("st.global.v4.u32 [%0], {%1, %1, %1, %1};" ::"l"(p), "r"(0u) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace rocenante
