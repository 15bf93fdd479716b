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

#define CHECK(x)                                                                                    \
  do {                                                                                              \
    cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

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
  if (kernel != nullptr) CHECK(cudaLaunchKernelEx(&config, kernel, running, spin_ns));
  else CHECK(cudaLaunchKernelEx(&config, kernel2, running, overlapped));
}

// One round: `first` on s1 after s2's last work (the previous round's `second`), then `second` on s2 after it.
void round(cudaStream_t s1, cudaStream_t s2, cudaEvent_t e1, cudaEvent_t e2, bool pdl, unsigned* running,
           unsigned* overlapped, unsigned long long spin_ns) {
  CHECK(cudaEventRecord(e2, s2));
  CHECK(cudaStreamWaitEvent(s1, e2, 0));
  launch(first, nullptr, true, s1, 64, running, overlapped, spin_ns);
  CHECK(cudaEventRecord(e1, s1));
  CHECK(cudaStreamWaitEvent(s2, e1, 0));
  launch(nullptr, second, pdl, s2, 64, running, overlapped, spin_ns);
}

int main() {
  unsigned* words = nullptr;  // running, overlapped
  CHECK(cudaMalloc(&words, 2 * sizeof(unsigned)));
  cudaStream_t s1, s2, origin;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&origin, cudaStreamNonBlocking));
  cudaEvent_t e1, e2, fork, join;
  for (cudaEvent_t* e : {&e1, &e2, &fork, &join}) CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  const int rounds = 2000;
  const unsigned long long spin_ns = 20000;
  for (int graph = 0; graph < 2; ++graph) {
    for (int pdl = 1; pdl >= 0; --pdl) {
      CHECK(cudaMemset(words, 0, 2 * sizeof(unsigned)));
      CHECK(cudaDeviceSynchronize());
      if (graph == 0) {
        for (int i = 0; i < rounds; ++i) round(s1, s2, e1, e2, pdl, words, words + 1, spin_ns);
      } else {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal));
        CHECK(cudaEventRecord(fork, origin));
        CHECK(cudaStreamWaitEvent(s1, fork, 0));
        CHECK(cudaStreamWaitEvent(s2, fork, 0));
        for (int i = 0; i < 50; ++i) round(s1, s2, e1, e2, pdl, words, words + 1, spin_ns);
        CHECK(cudaEventRecord(join, s1));
        CHECK(cudaStreamWaitEvent(origin, join, 0));
        CHECK(cudaEventRecord(join, s2));
        CHECK(cudaStreamWaitEvent(origin, join, 0));
        CHECK(cudaStreamEndCapture(origin, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
        for (int i = 0; i < rounds / 50; ++i) CHECK(cudaGraphLaunch(exec, origin));
        CHECK(cudaStreamSynchronize(origin));
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(g));
      }
      CHECK(cudaDeviceSynchronize());
      unsigned got[2];
      CHECK(cudaMemcpy(got, words, sizeof(got), cudaMemcpyDeviceToHost));
      std::printf("%s, second %s the PDL attribute: %u of %d rounds saw first still running\n",
                  graph ? "one graph capture, forked streams" : "eager", pdl ? "with" : "without", got[1], rounds);
    }
  }
  return 0;
}
