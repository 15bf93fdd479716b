#include "watchdog.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "communicator.h"

namespace rocenante {
namespace {

struct Registry {
  std::mutex mutex;  // held while the thread runs watch(), so remove() waits for it
  std::vector<Communicator*> comms;
  bool running = false;
};

// Never destroyed: the detached thread may still run while static destructors do at exit.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void run() {
  Registry& r = registry();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      for (Communicator* c : r.comms) c->watch();
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
  std::lock_guard<std::mutex> lock(r.mutex);
  r.comms.erase(std::remove(r.comms.begin(), r.comms.end(), comm), r.comms.end());
}

}  // namespace rocenante
