// Shared-memory transport: each rank's receive region is a POSIX shared-memory segment that every peer maps.
//
// Segments are created with O_EXCL and mode 0600 under a name no one can guess ahead,
// /rocenante-<pid namespace>-<pid>-<64 random bits>-r<rank>, and fully reserved (posix_fallocate) before use:
// a /dev/shm too small fails setup with a clear error instead of a SIGBUS at the first large call. A peer maps
// a segment only if this user owns it, with mode 0600 and the size its own configuration gives. The name is
// unlinked as soon as all ranks have mapped it; a process that died before that left its segment behind, so
// every new transport first removes this user's segments whose creator (same pid namespace) no longer exists.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>

#include "../errors.h"
#include "transport.h"

namespace rocenante {
namespace {

constexpr const char* kShmDir = "/dev/shm";  // where glibc's shm_open keeps its segments

// Names the pid namespace this process sees pids in (its inode); "0" when unknown, which no sweep matches.
std::string pid_namespace() {
  struct stat st {};
  return std::to_string(stat("/proc/self/ns/pid", &st) == 0 ? uint64_t(st.st_ino) : 0);
}

// Removes this user's segments left by processes of our pid namespace that no longer exist.
void remove_orphans(const std::string& ns) {
  if (ns == "0") return;
  const std::string prefix = "rocenante-" + ns + "-";
  DIR* dir = opendir(kShmDir);
  if (dir == nullptr) return;
  while (const dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const long long pid = std::strtoll(name.c_str() + prefix.size(), nullptr, 10);
    struct stat st {};
    if (pid <= 0 || kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    if (fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_uid == geteuid())
      shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

std::string random_hex() {
  std::random_device rd;
  const uint64_t bits = (uint64_t(rd()) << 32) | rd();
  std::string hex;
  for (int shift = 60; shift >= 0; shift -= 4) hex += "0123456789abcdef"[(bits >> shift) & 15];
  return hex;
}

std::string octal_mode(mode_t mode) {
  std::string s = "0";
  for (int shift = 6; shift >= 0; shift -= 3) s += char('0' + ((mode >> shift) & 7));
  return s;
}

// Reserves the whole region in /dev/shm now: a segment sized by ftruncate alone reserves nothing, and a write
// past the space left would kill the process with SIGBUS in the middle of a call.
void reserve(int fd, int rank, const RegionLayout& layout) {
  const size_t bytes = layout.region_bytes();
  int err;
  do err = posix_fallocate(fd, 0, off_t(bytes));  // returns the error number; errno is left alone
  while (err == EINTR);
  if (err == 0) return;
  struct statvfs fs {};
  const std::string space =
      statvfs(kShmDir, &fs) == 0 ? " (" + std::to_string(uint64_t(fs.f_bavail) * fs.f_frsize) + " bytes free)" : "";
  ROCENANTE_THROW(Error, "rank " + std::to_string(rank) + ": cannot reserve " + std::to_string(bytes) +
                             " bytes of shared memory in " + kShmDir + " for its region: " + std::strerror(err) +
                             space + "; each rank's region is 3 x (world - 1) x capacity (world " +
                             std::to_string(layout.world) + ", capacity " + std::to_string(layout.capacity_bytes) +
                             " bytes): lower ROCENANTE_CAPACITY_BYTES or enlarge " + kShmDir);
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(int rank, const RegionLayout& layout)
      : rank_(rank), bytes_(layout.region_bytes()), regions_(layout.world, nullptr) {
    const std::string ns = pid_namespace();
    remove_orphans(ns);
    name_ = "/rocenante-" + ns + "-" + std::to_string(getpid()) + "-" + random_hex() + "-r" + std::to_string(rank);
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ROCENANTE_CHECK_SYS(fd);
    linked_ = true;
    try {
      ROCENANTE_CHECK_SYS(fchmod(fd, 0600));  // whatever the umask: peers check it
      reserve(fd, rank, layout);
      regions_[rank] = map(fd);
      // Empty before any peer learns the name (layout.h).
      for (size_t i = 0; i < bytes_ / sizeof(uint32_t); ++i) regions_[rank][i] = initial_word(i);
    } catch (...) {
      close(fd);
      unlink_name();
      throw;
    }
    close(fd);
  }

  ~ShmTransport() override {
    for (uint32_t* r : regions_)
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
      const std::string where =
          "rank " + std::to_string(rank_) + ": rank " + std::to_string(p) + "'s shared memory " + handles[p];
      const int fd = shm_open(handles[p].c_str(), O_RDWR, 0);
      if (fd == -1)
        ROCENANTE_THROW(Error, where + " cannot be opened: " + std::strerror(errno) + " (is every rank on this host?)");
      try {
        struct stat st {};
        ROCENANTE_CHECK_SYS(fstat(fd, &st));
        if (st.st_uid != geteuid())
          ROCENANTE_THROW(Error, where + " is owned by uid " + std::to_string(st.st_uid) + ", not " +
                                     std::to_string(geteuid()) + " (this process's): refused");
        if ((st.st_mode & 0777) != 0600)
          ROCENANTE_THROW(Error, where + " has mode " + octal_mode(st.st_mode & 0777) + ", not 0600: refused");
        if (size_t(st.st_size) != bytes_)  // mapping past the end would fault: configurations differ
          ROCENANTE_THROW(Error, where + " is " + std::to_string(st.st_size) + " bytes, this rank's region " +
                                     std::to_string(bytes_) + " (capacity differs)");
        regions_[p] = map(fd);
      } catch (...) {
        close(fd);
        throw;
      }
      close(fd);
    }
  }

  void all_connected() override { unlink_name(); }

  uint32_t* local_region() const override { return regions_[rank_]; }
  uint32_t* peer_region(int peer) const override { return regions_[peer]; }
  void post_abort(int peer, uint64_t word) noexcept override {
    if (regions_[peer] != nullptr) store_abort(regions_[peer], rank_, word);
  }

 private:
  uint32_t* map(int fd) const {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw_system_error("mmap", __FILE__, __LINE__);
    return static_cast<uint32_t*>(p);
  }
  void unlink_name() {
    if (linked_) shm_unlink(name_.c_str());
    linked_ = false;
  }

  int rank_;
  size_t bytes_;
  std::string name_;
  bool linked_ = false;
  std::vector<uint32_t*> regions_;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(int rank, const RegionLayout& layout) {
  return std::make_unique<ShmTransport>(rank, layout);
}

}  // namespace rocenante
