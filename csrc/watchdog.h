// One thread per process that watches every open communicator without the GIL: it sees a peer's process end
// (within kWatchdogPeriodMs; the timeout no longer bounds that case), makes the waits of that communicator
// stop, and logs each communicator's first fault once, applying ROCENANTE_ON_FAULT (Communicator::watch).
#pragma once

#include <cstdint>
#include <vector>

namespace rocenante {

// 50 ms: a dead peer is noticed well inside the 2 s a serving engine can afford, at no measurable CPU cost.
constexpr int kWatchdogPeriodMs = 50;

// What the watchdog watches (a communicator): the thread calls watch() every kWatchdogPeriodMs.
class Watched {
 public:
  virtual ~Watched() = default;
  virtual void watch() = 0;
};

struct Watchdog {
  // Starts the thread on first use. add() after the communicator is connected; remove() before it frees
  // anything: when remove() returns, the watchdog is not inside watch() and will not call it again.
  static void add(Watched* comm);
  static void remove(Watched* comm);
};

// Which process a rank is, so that its peers' watchdogs can see it end: the pid and the process's start time
// (clock ticks since boot, field 22 of /proc/PID/stat), which tells a reused pid or another pid namespace apart.
struct ProcessIdentity {
  int64_t pid;
  uint64_t start_time;
};
ProcessIdentity this_process();

// The peers' processes, as a communicator's watch() sees them: a pidfd per peer that can be watched. Not
// thread-safe: its owner calls watch() before Watchdog::add(), ended() only on the watchdog thread (in
// Watched::watch()), close() after Watchdog::remove().
class PeerProcesses {
 public:
  explicit PeerProcesses(int world) : pidfds_(world, -1) {}
  // Watches `peer`'s process from now on, if it can (watchdog.cc, open_pidfd).
  void watch(int peer, const ProcessIdentity& process);
  // The peers (bit p) whose process ended since the last call, each once; never waits.
  uint32_t ended();
  // Closes the pidfds; idempotent. Only here, never in a destructor: a forked child keeps its copies of its
  // creator's (Communicator::close).
  void close();

 private:
  std::vector<int> pidfds_;  // one per peer whose process is watched, else -1
};

}  // namespace rocenante
