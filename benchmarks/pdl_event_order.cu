// Does a kernel launched with programmatic stream serialization (PDL) still wait for a kernel of another
// stream that its stream waits for through an event? The communicator's launch relies on it when consecutive
// calls come from two streams (order_after_previous_call). Two streams, as the two-streams GPU test issues its
// calls: per round, `first` on s1 (it lets dependents launch at once, then runs `spin_ns`) and `second` on s2,
// after cudaStreamWaitEvent on an event recorded on s1 after `first`. `second` counts the rounds in which it saw
// `first` still running after its own griddepcontrol.wait. Printed for `second` launched with and without the
// PDL attribute, eagerly and inside one graph capture (forked streams).
//   nvcc -O2 -arch=sm_90 -o /tmp/pdl_event_order benchmarks/pdl_event_order.cu && /tmp/pdl_event_order
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "../csrc/cuda_check.h"  // ROCENANTE_CHECK_CUDA: a failed call throws, naming itself

__device__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void first(unsigned* running, unsigned long long spin_ns) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  if (threadIdx.x == 0) atomicAdd(running, 1u);
  const unsigned long long until = now_ns() + spin_ns;
  while (now_ns() < until) {
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicSub(running, 1u);
  }
}

__global__ void second(unsigned* running, unsigned* overlapped) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  const unsigned long long until = now_ns() + 3000;  // so that a `first` launched just before has begun
  while (now_ns() < until) {
  }
  if (threadIdx.x == 0 && atomicAdd(running, 0u) != 0) atomicAdd(overlapped, 1u);
}

void launch(void (*kernel)(unsigned*, unsigned long long), void (*kernel2)(unsigned*, unsigned*), bool pdl,
            cudaStream_t stream, unsigned blocks, unsigned* running, unsigned* overlapped,
            unsigned long long spin_ns) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(128);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  if (kernel != nullptr) ROCENANTE_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, running, spin_ns));
  else ROCENANTE_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel2, running, overlapped));
}

// One round: `first` on s1 after s2's last work (the previous round's `second`), then `second` on s2 after it.
void round(cudaStream_t s1, cudaStream_t s2, cudaEvent_t e1, cudaEvent_t e2, bool pdl, unsigned* running,
           unsigned* overlapped, unsigned long long spin_ns) {
  ROCENANTE_CHECK_CUDA(cudaEventRecord(e2, s2));
  ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(s1, e2, 0));
  launch(first, nullptr, true, s1, 64, running, overlapped, spin_ns);
  ROCENANTE_CHECK_CUDA(cudaEventRecord(e1, s1));
  ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(s2, e1, 0));
  launch(nullptr, second, pdl, s2, 64, running, overlapped, spin_ns);
}

int main() {
  unsigned* words = nullptr;  // running, overlapped
  ROCENANTE_CHECK_CUDA(cudaMalloc(&words, 2 * sizeof(unsigned)));
  cudaStream_t s1, s2, origin;
  ROCENANTE_CHECK_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  ROCENANTE_CHECK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  ROCENANTE_CHECK_CUDA(cudaStreamCreateWithFlags(&origin, cudaStreamNonBlocking));
  cudaEvent_t e1, e2, fork, join;
  for (cudaEvent_t* e : {&e1, &e2, &fork, &join}) ROCENANTE_CHECK_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  const int rounds = 2000;
  const unsigned long long spin_ns = 20000;
  for (int graph = 0; graph < 2; ++graph) {
    for (int pdl = 1; pdl >= 0; --pdl) {
      ROCENANTE_CHECK_CUDA(cudaMemset(words, 0, 2 * sizeof(unsigned)));
      ROCENANTE_CHECK_CUDA(cudaDeviceSynchronize());
      if (graph == 0) {
        for (int i = 0; i < rounds; ++i) round(s1, s2, e1, e2, pdl, words, words + 1, spin_ns);
      } else {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        ROCENANTE_CHECK_CUDA(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal));
        ROCENANTE_CHECK_CUDA(cudaEventRecord(fork, origin));
        ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(s1, fork, 0));
        ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(s2, fork, 0));
        for (int i = 0; i < 50; ++i) round(s1, s2, e1, e2, pdl, words, words + 1, spin_ns);
        ROCENANTE_CHECK_CUDA(cudaEventRecord(join, s1));
        ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(origin, join, 0));
        ROCENANTE_CHECK_CUDA(cudaEventRecord(join, s2));
        ROCENANTE_CHECK_CUDA(cudaStreamWaitEvent(origin, join, 0));
        ROCENANTE_CHECK_CUDA(cudaStreamEndCapture(origin, &g));
        ROCENANTE_CHECK_CUDA(cudaGraphInstantiate(&exec, g, 0));
        for (int i = 0; i < rounds / 50; ++i) ROCENANTE_CHECK_CUDA(cudaGraphLaunch(exec, origin));
        ROCENANTE_CHECK_CUDA(cudaStreamSynchronize(origin));
        ROCENANTE_CHECK_CUDA(cudaGraphExecDestroy(exec));
        ROCENANTE_CHECK_CUDA(cudaGraphDestroy(g));
      }
      ROCENANTE_CHECK_CUDA(cudaDeviceSynchronize());
      unsigned got[2];
      ROCENANTE_CHECK_CUDA(cudaMemcpy(got, words, sizeof(got), cudaMemcpyDeviceToHost));
      std::printf("%s, second %s the PDL attribute: %u of %d rounds saw first still running\n",
                  graph ? "one graph capture, forked streams" : "eager", pdl ? "with" : "without", got[1], rounds);
    }
  }
  return 0;
}
