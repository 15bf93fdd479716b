// Between two polls of a host thread's spin-wait.
#pragma once

namespace rocenante {

// Tells the core it is spinning (x86 pause, AArch64 yield): it leaves the loop without a pipeline flush and
// spends less power meanwhile (and yields the pipeline to a sibling hyperthread), without a system call;
// elsewhere nothing.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace rocenante
