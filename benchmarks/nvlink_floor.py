"""How fast bare pushes over NVLink can be: the data-movement floor under a one-shot all-reduce.

    python benchmarks/nvlink_floor.py [--out benchmarks/results/h200x2-nvlink-floor.json] [--rounds 25]

One process, GPUs 0 and 1 with peer access. A kernel of the one-shot kernel's shape at world 2 (4 CTAs of 256
threads per multiprocessor, a 16-byte load and store per thread and step) copies `bytes` from local memory
into the peer's memory, then waits for its stores to be complete (__threadfence_system); its time is from the
first CTA's start to the last CTA's end, read from %globaltimer inside the kernel, so no launch is counted.
Modes: "one_way" (GPU 0 pushes, GPU 1 idles) and "both_ways" (each GPU pushes to the other at once, as in an
all-reduce: the CTAs of both kernels first meet at a flag each GPU stores into the other's memory, so that both
pushes overlap; the slower GPU's time is kept). Arms: "push_volatile" stores with st.volatile.global.v4 (what
the kernel's push uses), "push_weak" with a plain st.global.v4. Every arm, mode and size in rotated order per
round; median, p10 and p90 over the rounds, in rocenante.bench/1 JSON (dtype "raw": bytes, not elements).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import cupy
import numpy

from rocenante.bench import provenance, runner

_SOURCE = r"""
extern "C" __device__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// go_peer/go_mine: the start flags (both_ways), null for one_way. times: [earliest start, latest end].
template <bool kVolatile>
__device__ void push(const uint4* src, uint4* dst, unsigned long long n, unsigned* go_peer, const unsigned* go_mine,
                     unsigned round, unsigned long long* times) {
  if (go_peer != nullptr) {
    if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(go_peer), "r"(round) : "memory");
    if (threadIdx.x == 0) {
      unsigned seen = 0;
      do asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(seen) : "l"(go_mine) : "memory");
      while (seen != round);
    }
    __syncthreads();
  }
  const unsigned long long start = now_ns();
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const uint4 v = src[i];
    if (kVolatile)
      asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + i), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    else
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + i), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  }
  __threadfence_system();  // this thread's stores are complete
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMin(&times[0], start);
    atomicMax(&times[1], now_ns());
  }
}

extern "C" __global__ void push_volatile(const uint4* src, uint4* dst, unsigned long long n, unsigned* go_peer,
                                         const unsigned* go_mine, unsigned round, unsigned long long* times) {
  push<true>(src, dst, n, go_peer, go_mine, round, times);
}
extern "C" __global__ void push_weak(const uint4* src, uint4* dst, unsigned long long n, unsigned* go_peer,
                                     const unsigned* go_mine, unsigned round, unsigned long long* times) {
  push<false>(src, dst, n, go_peer, go_mine, round, times);
}
"""

ARMS = ("push_volatile", "push_weak")
MODES = ("one_way", "both_ways")
CTAS_PER_SM, THREADS = 4, 256


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/h200x2-nvlink-floor.json")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--sizes", default="65536,262144,1048576,4194304,16777216,67108864")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()
    if cupy.cuda.runtime.getDeviceCount() < 2:
        sys.exit("needs 2 GPUs")

    module, src, dst, go, times = [], [], [], [], []
    for d in (0, 1):
        with cupy.cuda.Device(d):
            if not cupy.cuda.runtime.deviceCanAccessPeer(d, 1 - d):
                sys.exit(f"GPU {d} cannot access GPU {1 - d}")
            cupy.cuda.runtime.deviceEnablePeerAccess(1 - d)
            module.append(cupy.RawModule(code=_SOURCE, options=("-std=c++17",)))
            src.append(cupy.random.randint(0, 2**31, size=max(sizes) // 4, dtype=cupy.uint32))
            dst.append(cupy.zeros(max(sizes) // 4, dtype=cupy.uint32))
            go.append(cupy.zeros(1, dtype=cupy.uint32))
            times.append(cupy.zeros(2, dtype=cupy.uint64))
    blocks = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"] * CTAS_PER_SM

    start_flag = [0]  # each both_ways measurement meets at a flag value of its own

    def pointer(array) -> cupy.uint64:
        return cupy.uint64(array.data.ptr)

    def measure(arm: str, mode: str, nbytes: int) -> float:
        senders = (0, 1) if mode == "both_ways" else (0,)
        start_flag[0] += 1
        for d in senders:
            with cupy.cuda.Device(d):
                times[d].set(numpy.array([2**64 - 1, 0], dtype=numpy.uint64))
        for d in senders:
            with cupy.cuda.Device(d):
                flags = (pointer(go[1 - d]), pointer(go[d])) if mode == "both_ways" else (cupy.uint64(0),) * 2
                module[d].get_function(arm)(
                    (blocks,), (THREADS,),
                    (pointer(src[d]), pointer(dst[1 - d]), cupy.uint64(nbytes // 16), *flags,
                     cupy.uint32(start_flag[0]), pointer(times[d])))
        spans = []
        for d in senders:
            with cupy.cuda.Device(d):
                t = times[d].get()
                spans.append((int(t[1]) - int(t[0])) / 1000.0)
        return max(spans)

    cases = [(arm, mode, n) for n in sizes for mode in MODES for arm in ARMS]
    for case in cases:  # warm-up: module load, first touch of the peer mappings
        measure(*case)
    samples = {case: [] for case in cases}
    for r in range(args.rounds):
        for case in runner.round_order(cases, r):
            samples[case].append(measure(*case))

    rows = []
    for (arm, mode, n), values in samples.items():
        s = runner.summarize([values])
        rows.append({"arm": arm, "mode": mode, "dtype": "raw", "bytes": n, "median_us": s["median_us"],
                     "p10_us": s["p10_us"], "p90_us": s["p90_us"], "measurements": s["measurements"]})
        print(f"{arm:14s} {mode:9s} {n:>10d} B: {s['median_us']:8.2f} us (p10 {s['p10_us']:.2f}, p90 "
              f"{s['p90_us']:.2f})  {n / s['median_us'] / 1e3:6.1f} GB/s")
    method = {"what": "bare NVLink pushes, in-kernel %globaltimer from the first CTA's start to the last CTA's end "
                      "(after __threadfence_system); see benchmarks/nvlink_floor.py",
              "blocks": blocks, "threads": THREADS, "rounds": args.rounds}
    info = provenance.collect("cuda", method, load_before)
    info["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    result = {"schema": "rocenante.bench/1", "provenance": info, "world_size": 2, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
