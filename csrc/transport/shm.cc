// Shared-memory transport: each rank's receive region is a POSIX shared-memory segment that every peer maps.
// The segment's name is unlinked as soon as all ranks have mapped it, so nothing is left in /dev/shm after
// setup, whatever happens to the processes later.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <random>

#include "../errors.h"
#include "transport.h"

namespace rocenante {
namespace {

class ShmTransport final : public Transport {
 public:
  ShmTransport(int rank, const RegionLayout& layout)
      : rank_(rank), bytes_(layout.region_bytes()), regions_(layout.world, nullptr) {
    std::random_device rd;
    name_ = "/rocenante-" + std::to_string(getpid()) + "-" + std::to_string(rd()) + "-r" + std::to_string(rank);
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ROCENANTE_CHECK_SYS(fd);
    linked_ = true;
    try {
      ROCENANTE_CHECK_SYS(ftruncate(fd, off_t(bytes_)));  // a new segment reads as zeros: no line has arrived
      regions_[rank] = map(fd);
    } catch (...) {
      close(fd);
      unlink_name();
      throw;
    }
    close(fd);
  }

  ~ShmTransport() override {
    for (Line* r : regions_)
      if (r != nullptr) munmap(r, bytes_);
    unlink_name();
  }

  std::string local_handle() const override { return name_; }

  void connect(const std::vector<std::string>& handles) override {
    for (int p = 0; p < int(handles.size()); ++p) {
      if (p == rank_) continue;
      // The name comes from the store: open only a name of ours, never a path or whatever a NUL would cut it to.
      if (handles[p].size() > NAME_MAX || handles[p].rfind("/rocenante-", 0) != 0 ||
          handles[p].find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", 1) != std::string::npos)
        ROCENANTE_THROW(Error, "rank " + std::to_string(p) + " published a shared-memory name (" +
                                   std::to_string(handles[p].size()) + " bytes) that is not one of rocenante's");
      const int fd = shm_open(handles[p].c_str(), O_RDWR, 0);
      if (fd == -1)
        ROCENANTE_THROW(Error, "cannot open rank " + std::to_string(p) + "'s shared memory " + handles[p] +
                                   " (is every rank on this host?)");
      try {
        struct stat st {};
        ROCENANTE_CHECK_SYS(fstat(fd, &st));
        if (size_t(st.st_size) != bytes_)  // mapping past the end would fault: configurations differ
          ROCENANTE_THROW(Error, "rank " + std::to_string(p) + "'s region is " + std::to_string(st.st_size) +
                                     " bytes, this rank's is " + std::to_string(bytes_) + " (capacity differs)");
        regions_[p] = map(fd);
      } catch (...) {
        close(fd);
        throw;
      }
      close(fd);
    }
  }

  void all_connected() override { unlink_name(); }

  Line* local_region() const override { return regions_[rank_]; }
  Line* peer_region(int peer) const override { return regions_[peer]; }
  void post_abort(int peer, uint64_t word) noexcept override {
    if (regions_[peer] != nullptr) __atomic_store_n(abort_word(regions_[peer], rank_), word, __ATOMIC_RELEASE);
  }

 private:
  Line* map(int fd) const {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw_system_error("mmap", __FILE__, __LINE__);
    return static_cast<Line*>(p);
  }
  void unlink_name() {
    if (linked_) shm_unlink(name_.c_str());
    linked_ = false;
  }

  int rank_;
  size_t bytes_;
  std::string name_;
  bool linked_ = false;
  std::vector<Line*> regions_;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(int rank, const RegionLayout& layout) {
  return std::make_unique<ShmTransport>(rank, layout);
}

}  // namespace rocenante
