#include "watchdog.h"

#include <poll.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"

namespace rocenante {
namespace {

// The thread calls each communicator's watch() without the mutex: a watch that waits on a wire (telling network
// peers of a fault) holds up no other communicator's add() or remove(). remove() waits only while the
// communicator it removes is the one being watched.
struct Registry {
  std::mutex mutex;
  std::condition_variable watched;  // `watching` went back to null
  std::vector<Watched*> comms;
  Watched* watching = nullptr;  // inside watch() now, outside the mutex
  bool running = false;
};

// This process's registry, never destroyed: the detached thread may still run while static destructors do at
// exit. A forked child starts a fresh one (the pthread_atfork handler below, which runs in the child before fork()
// returns there): its copy of its parent's says a thread runs where none came along, lists the parent's
// communicators, and may hold a mutex that a parent thread had locked at the fork. The copy is left as it is.
std::atomic<Registry*> current{new Registry};
const bool fresh_in_child = [] {
  return pthread_atfork(nullptr, nullptr, [] { current.store(new Registry, std::memory_order_relaxed); }) == 0;
}();

Registry& registry() {
  if (!fresh_in_child) ROCENANTE_THROW(Error, "pthread_atfork failed: a forked child's communicators would go unwatched");
  return *current.load(std::memory_order_relaxed);
}

void run() {
  Registry& r = registry();
  std::vector<Watched*> round;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      round = r.comms;
    }
    for (Watched* c : round) {
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (std::find(r.comms.begin(), r.comms.end(), c) == r.comms.end()) continue;  // removed meanwhile
        r.watching = c;
      }
      c->watch();
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        r.watching = nullptr;
      }
      r.watched.notify_all();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kWatchdogPeriodMs));
  }
}

// Read through the main thread's entry, /proc/PID/task/PID/stat, whose field 22 on Linux is the process's: qemu-user
// (aarch64 tests on x86, tests/aarch64) fakes /proc/self/stat and /proc/<own pid>/stat for the program it runs, with
// a start time that no other process reads, and then every peer would look like a reused pid.
uint64_t process_start_time(int64_t pid) {
  const std::string id = std::to_string(pid);
  std::ifstream f("/proc/" + id + "/task/" + id + "/stat");
  std::string stat;
  std::getline(f, stat);
  const size_t end_of_name = stat.rfind(')');  // the name may hold spaces and parentheses
  if (end_of_name == std::string::npos) return 0;
  size_t pos = end_of_name + 2;  // field 3 (state) starts here; field 22 is 19 fields further
  for (int field = 3; field < 22 && pos != std::string::npos; ++field) pos = stat.find(' ', pos) + 1;
  return pos == 0 || pos == std::string::npos ? 0 : std::strtoull(stat.c_str() + pos, nullptr, 10);
}

// A pidfd for the process, or -1 when it cannot be watched (not in our pid namespace, an old kernel): then only
// the timeout bounds the wait for it.
int open_pidfd(const ProcessIdentity& process) {
#ifndef SYS_pidfd_open
  constexpr long SYS_pidfd_open = 434;  // the same number on every Linux architecture
#endif
  const int fd = int(syscall(SYS_pidfd_open, pid_t(process.pid), 0));
  if (fd < 0) return -1;
  if (process.start_time == 0 || process_start_time(process.pid) != process.start_time) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

void Watchdog::add(Watched* comm) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.comms.push_back(comm);
  if (!r.running) {
    std::thread(run).detach();
    r.running = true;
  }
}

void Watchdog::remove(Watched* comm) {
  Registry& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  r.comms.erase(std::remove(r.comms.begin(), r.comms.end(), comm), r.comms.end());
  r.watched.wait(lock, [&] { return r.watching != comm; });
}

ProcessIdentity this_process() { return {getpid(), process_start_time(getpid())}; }

void PeerProcesses::watch(int peer, const ProcessIdentity& process) { pidfds_[peer] = open_pidfd(process); }

uint32_t PeerProcesses::ended() {
  uint32_t ended = 0;
  for (int p = 0; p < int(pidfds_.size()); ++p) {
    if (pidfds_[p] < 0) continue;
    pollfd fd{pidfds_[p], POLLIN, 0};
    if (poll(&fd, 1, 0) <= 0) continue;  // still running
    ::close(pidfds_[p]);
    pidfds_[p] = -1;
    ended |= 1u << p;
  }
  return ended;
}

void PeerProcesses::close() {
  for (int& fd : pidfds_)
    if (fd >= 0) ::close(fd), fd = -1;
}

}  // namespace rocenante
