#include "watchdog.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "communicator.h"

namespace rocenante {
namespace {

// The thread calls each communicator's watch() without the mutex: a watch that waits on a wire (telling network
// peers of a fault) holds up no other communicator's add() or remove(). remove() waits only while the
// communicator it removes is the one being watched.
struct Registry {
  std::mutex mutex;
  std::condition_variable watched;  // `watching` went back to null
  std::vector<Communicator*> comms;
  Communicator* watching = nullptr;  // inside watch() now, outside the mutex
  bool running = false;
};

// Never destroyed: the detached thread may still run while static destructors do at exit.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void run() {
  Registry& r = registry();
  std::vector<Communicator*> round;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      round = r.comms;
    }
    for (Communicator* c : round) {
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

}  // namespace

void Watchdog::add(Communicator* comm) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.comms.push_back(comm);
  if (!r.running) {
    std::thread(run).detach();
    r.running = true;
  }
}

void Watchdog::remove(Communicator* comm) {
  Registry& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  r.comms.erase(std::remove(r.comms.begin(), r.comms.end(), comm), r.comms.end());
  r.watched.wait(lock, [&] { return r.watching != comm; });
}

}  // namespace rocenante
