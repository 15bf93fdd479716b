// One thread per process that watches every open communicator without the GIL: it sees a peer's process end
// (within kWatchdogPeriodMs; the timeout no longer bounds that case), makes the waits of that communicator
// stop, and logs each communicator's first fault once, applying ROCENANTE_ON_FAULT (Communicator::watch).
#pragma once

namespace rocenante {

class Communicator;

// 50 ms: a dead peer is noticed well inside the 2 s a serving engine can afford, at no measurable CPU cost.
constexpr int kWatchdogPeriodMs = 50;

struct Watchdog {
  // Starts the thread on first use. add() after the communicator is connected; remove() before it frees
  // anything: when remove() returns, the watchdog is not inside watch() and will not call it again.
  static void add(Communicator* comm);
  static void remove(Communicator* comm);
};

}  // namespace rocenante
