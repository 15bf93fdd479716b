// ThreadSanitizer's workload (tests/tsan/run.sh), also run on aarch64 under emulation (tests/aarch64/run.sh): the
// host code, torch-free, with every rank a thread of this one process, over shared memory and over the TCP wire in
// both signal modes (so the host loops, the proxy threads, the wire's receiver threads and the watchdog of all ranks
// run side by side where TSan sees every access): calls of every collective
// (pieces and two-shot included) whose results are checked, a call mismatch, a rank that closes mid-run and a rank
// that refuses a call. Prints one line per scenario and "N passed, N failed"; exits non-zero on a failure.
// Built with -DROCENANTE_TSAN_PLANTED_RACE it also races two threads on a plain int, which TSan must report: the
// job's proof that it can fail.
#include <sys/utsname.h>

#include <barrier>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "communicator.h"
#include "errors.h"

using namespace rocenante;

namespace {

constexpr int kWorld = 3;
constexpr size_t kCapacity = 64 << 10;  // small, so that calls of a few hundred KiB go as pieces
constexpr double kTimeoutS = 30;        // TSan slows the host code down 5-15 times

// The ranks' communicators, connected as the Python rendezvous connects them (through a store there).
std::vector<std::unique_ptr<Communicator>> connect_world(Net net, Signal signal) {
  std::vector<std::unique_ptr<Communicator>> comms(kWorld);
  std::vector<std::string> handles(kWorld);
  std::barrier sync(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      comms[r] = std::make_unique<Communicator>(r, kWorld, -1, kCapacity, kTimeoutS, OnFault::kRaise, net,
                                                std::vector<std::vector<IbPath>>{}, 1, 0.0, signal, 128 << 10);
      handles[r] = comms[r]->local_handle();
      sync.arrive_and_wait();
      comms[r]->connect(handles);
      sync.arrive_and_wait();
      comms[r]->all_connected();
    });
  for (auto& t : threads) t.join();
  return comms;
}

// Runs body(rank, comm) on a thread per rank; returns each rank's error message ("" if none).
std::vector<std::string> on_every_rank(std::vector<std::unique_ptr<Communicator>>& comms,
                                       const std::function<void(int, Communicator&)>& body) {
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, *comms[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

uintptr_t ptr(const std::vector<float>& v) { return reinterpret_cast<uintptr_t>(v.data()); }

// Every collective, one-shot and two-shot, in and over the capacity (rank r's element i is r + i % 7), and a split
// all-to-all.
void calls(int r, Communicator& c) {
  for (size_t count : {size_t(1000), size_t(40000), size_t(70000)}) {  // 4 KB, 160 KB (two-shot), 280 KB (pieces)
    std::vector<float> in(count), out(count, NAN);
    for (size_t i = 0; i < count; ++i) in[i] = float(r + i % 7);
    c.all_reduce(ptr(in), ptr(out), count, DType::kFloat32, ReduceOp::kSum, 0);
    for (size_t i = 0; i < count; ++i)
      if (out[i] != float(kWorld * (i % 7) + kWorld * (kWorld - 1) / 2)) throw Error("all_reduce: wrong sum");
    std::vector<float> gathered(kWorld * count, NAN);
    c.all_gather(ptr(in), ptr(gathered), count, DType::kFloat32, 0);
    for (size_t i = 0; i < kWorld * count; ++i)
      if (gathered[i] != float(i / count + (i % count) % 7)) throw Error("all_gather: wrong element");
    std::vector<float> whole(kWorld * count), part(count, NAN);
    for (size_t i = 0; i < kWorld * count; ++i) whole[i] = float(r + i % 5);
    c.reduce_scatter(ptr(whole), ptr(part), count, DType::kFloat32, ReduceOp::kMax, 0);
    for (size_t i = 0; i < count; ++i)
      if (part[i] != float(kWorld - 1 + (r * count + i) % 5)) throw Error("reduce_scatter: wrong element");
    std::vector<float> blocks(kWorld * count), swapped(kWorld * count, NAN);  // block p of rank r: 100 r + p
    for (size_t i = 0; i < kWorld * count; ++i) blocks[i] = float(100 * r + i / count);
    c.all_to_all(ptr(blocks), ptr(swapped), count, DType::kFloat32, 0);
    for (size_t i = 0; i < kWorld * count; ++i)
      if (swapped[i] != float(100 * (i / count) + r)) throw Error("all_to_all: wrong element");
  }
  // A split all-to-all: rank r sends 10 (r + p + 1) elements of 100 r + p to rank p.
  std::vector<size_t> send(kWorld), recv(kWorld);
  std::vector<float> in, out;
  for (int p = 0; p < kWorld; ++p) {
    send[p] = 10 * (r + p + 1), recv[p] = 10 * (p + r + 1);
    in.insert(in.end(), send[p], float(100 * r + p));
  }
  out.assign(in.size(), NAN);  // as much as it sends: the sizes are symmetric
  c.all_to_all_v(ptr(in), ptr(out), DType::kFloat32, send, recv, 0);
  for (size_t i = 0, s = 0, n = 0; i < out.size(); ++i, ++n) {
    if (n == recv[s]) ++s, n = 0;
    if (out[i] != float(100 * s + r)) throw Error("all_to_all_v: wrong element");
  }
}

int passed = 0, failed = 0;

void expect(bool ok, const std::string& what, const std::vector<std::string>& errors) {
  std::string detail;
  for (int r = 0; r < kWorld; ++r) detail += " [rank " + std::to_string(r) + ": " + errors[r] + "]";
  std::printf("%s %s%s\n", ok ? "PASS" : "FAIL", what.c_str(), ok ? "" : detail.c_str());
  std::fflush(stdout);
  (ok ? passed : failed)++;
}

bool all_empty(const std::vector<std::string>& e) {
  for (const auto& s : e)
    if (!s.empty()) return false;
  return true;
}
bool all_mention(const std::vector<std::string>& e, const std::string& word) {
  for (const auto& s : e)
    if (s.find(word) == std::string::npos) return false;
  return true;
}

void scenarios(Net net, Signal signal, const std::string& mode) {
  {  // calls, then a call mismatch: rank 1 all-reduces another count
    auto comms = connect_world(net, signal);
    expect(all_empty(on_every_rank(comms, calls)), mode + ": every collective, results checked", {"", "", ""});
    std::vector<std::string> errors = on_every_rank(comms, [](int r, Communicator& c) {
      std::vector<float> in(r == 1 ? 100 : 200, 1.0f), out(in.size());
      c.all_reduce(ptr(in), ptr(out), in.size(), DType::kFloat32, ReduceOp::kSum, 0);
    });
    expect(all_mention(errors, "rank"), mode + ": a call mismatch fails every rank", errors);
    for (auto& c : comms) c->close();
  }
  {  // a rank that closes mid-run: its peers' next call fails at once
    auto comms = connect_world(net, signal);
    std::vector<std::string> errors = on_every_rank(comms, [](int r, Communicator& c) {
      calls(r, c);
      if (r == 2) {
        c.close();
        return;
      }
      calls(r, c);
    });
    expect(errors[2].empty() && !errors[0].empty() && !errors[1].empty(), mode + ": a rank that closed fails its peers",
           errors);
    for (auto& c : comms) c->close();
  }
  {  // a refusal: rank 0 refuses its call (its cause is its own), the others fail naming rank 0
    auto comms = connect_world(net, signal);
    std::vector<std::string> errors = on_every_rank(comms, [](int r, Communicator& c) {
      calls(r, c);
      if (r == 0) c.refuse("a test refuses this call");
      std::vector<float> in(500, 1.0f), out(500);
      c.all_reduce(ptr(in), ptr(out), in.size(), DType::kFloat32, ReduceOp::kSum, 0);
    });
    expect(all_mention(errors, "refused"), mode + ": a refusal fails every rank, naming the rank that refused", errors);
    for (auto& c : comms) c->close();
  }
}

}  // namespace

int main() {
  // What ran, for the logs (tests/aarch64/run.sh checks it: an emulated run must not quietly be a native one).
  utsname host{};
  uname(&host);
#if defined(__aarch64__)
  const char* built_for = "aarch64";
#elif defined(__x86_64__)
  const char* built_for = "x86_64";
#else
  const char* built_for = "another architecture";
#endif
  std::printf("driver: built for %s, running on %s\n", built_for, host.machine);
#ifdef ROCENANTE_TSAN_PLANTED_RACE
  int planted = 0;
  std::thread a([&] { for (int i = 0; i < 1000; ++i) ++planted; });
  std::thread b([&] { for (int i = 0; i < 1000; ++i) ++planted; });
  a.join();
  b.join();
  std::printf("planted race: %d\n", planted);
#endif
  scenarios(Net::kShm, Signal::kFlag, "shm");
  scenarios(Net::kTcp, Signal::kFlag, "tcp flag");
  scenarios(Net::kTcp, Signal::kCompletion, "tcp completion");
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
