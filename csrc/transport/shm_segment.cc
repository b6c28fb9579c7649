#include "transport/shm_segment.h"

#include <algorithm>

#include <thread>

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

#include "common/error.h"

namespace pycomm {
namespace {

std::string readFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespaceId(const char* name) {
  char buf[256];
  const std::string path = std::string("/proc/self/ns/") + name;
  const ssize_t n = ::readlink(path.c_str(), buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
}

// The inode of this process's PID namespace (0 if unknown). Segment names carry
// it, so the pid in a name is only ever looked up in the namespace it belongs to.
uint64_t pidNamespaceInode() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Unlinks this user's segments whose creator (same PID namespace) is gone: what
// a creator killed between shm_open and its unlink leaves behind.
void removeAbandonedSegments(uint64_t pidNamespace) {
  if (pidNamespace == 0) return;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string prefix = strCat("pycomm-", pidNamespace, "-");
  std::vector<std::string> abandoned;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (end == name.c_str() + prefix.size() || *end != '-' || pid <= 0) continue;
    struct stat st {};
    if (::fstatat(::dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != ::geteuid())
      continue;
    if (!processAlive(static_cast<int>(pid))) abandoned.push_back("/" + name);
  }
  ::closedir(dir);
  for (const auto& name : abandoned) ::shm_unlink(name.c_str());
}

std::string randomHex(size_t bytes) {
  std::random_device device;
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes; ++i) {
    const unsigned v = device() & 0xff;
    out += kDigits[v >> 4];
    out += kDigits[v & 15];
  }
  return out;
}

}  // namespace

std::string hostKey() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  // The boot id first: it alone names the machine (the kernel), see machineOf.
  return strCat(readFirstLine("/proc/sys/kernel/random/boot_id"), "|", host, "|", namespaceId("net"),
                "|", namespaceId("ipc"), "|", namespaceId("mnt"), "|", namespaceId("pid"));
}

cpu_set_t allowedCpuSet() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
    for (unsigned c = 0; c < std::max(1u, std::thread::hardware_concurrency()) && c < CPU_SETSIZE; ++c)
      CPU_SET(c, &allowed);
  }
  return allowed;
}

namespace {
std::string machineOf(const std::string& key) { return key.substr(0, key.find('|')); }
}  // namespace

std::vector<int> hostLeaders(KeyValueStore& store, const std::string& prefix, int rank, int size,
                             const std::string& salt, int* ranksOnMachine) {
  const std::string mine = hostKey();
  store.set(prefix + "host/" + std::to_string(rank), mine + "|" + salt);
  std::vector<std::string> keys(size);
  std::vector<int> leader(size);
  const std::string machine = machineOf(mine);
  if (ranksOnMachine) *ranksOnMachine = 0;
  for (int r = 0; r < size; ++r) {
    keys[r] = store.get(prefix + "host/" + std::to_string(r));
    if (ranksOnMachine && machineOf(keys[r]) == machine) ++*ranksOnMachine;
    leader[r] = r;
    for (int q = 0; q < r; ++q) {
      if (keys[q] == keys[r]) {
        leader[r] = q;
        break;
      }
    }
  }
  return leader;
}

ShmSegment::~ShmSegment() {
  if (data_) ::munmap(data_, bytes_);
  unlink();
}

void ShmSegment::create(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throwError(ErrorKind::kConnection, "shm_open(", name, ") failed: ", std::strerror(errno));
  name_ = name;
  linked_ = true;
  // 0600 whatever the umask (it can only take bits away; the peers check for exactly 0600).
  if (::fchmod(fd, 0600) != 0) {
    const int err = errno;
    ::close(fd);
    throwError(ErrorKind::kConnection, "could not set the mode of ", name, ": ", std::strerror(err));
  }
  // ftruncate alone reserves nothing on tmpfs: a /dev/shm too small for the
  // segment would only show later, as SIGBUS on first touch. Allocate now.
  int err = ::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno : 0;
  if (err == 0) err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    ::close(fd);
    throwError(ErrorKind::kConnection, "could not allocate ", bytes, " bytes of shared memory for ",
               name, ": ", std::strerror(err), " (is /dev/shm too small?)");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throwError(ErrorKind::kConnection, "mmap of ", name, " failed: ", std::strerror(err));
  data_ = static_cast<char*>(p);
  bytes_ = bytes;
}

void ShmSegment::open(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throwError(ErrorKind::kConnection, "shm_open(", name, ") failed: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throwError(ErrorKind::kConnection, "fstat of shared memory ", name, " failed: ", std::strerror(err));
  }
  // Only a segment this user made for this group alone: another user's (or one
  // others may read or write) could be a trap or a spy, whatever name the store gave.
  if (st.st_uid != ::geteuid() || (st.st_mode & 07777) != 0600 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throwError(ErrorKind::kConnection, "refusing shared memory ", name, ": owned by uid ", st.st_uid, " with mode 0",
               std::oct, (st.st_mode & 07777), std::dec, " (expected this user's, uid ", ::geteuid(),
               ", with mode 0600)");
  }
  if (static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    throwError(ErrorKind::kConnection, "shared memory ", name, " has ", st.st_size, " bytes where ",
               bytes, " were expected");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throwError(ErrorKind::kConnection, "mmap of ", name, " failed: ", std::strerror(err));
  name_ = name;
  data_ = static_cast<char*>(p);
  bytes_ = bytes;
}

void ShmSegment::unlink() {
  if (!linked_) return;
  linked_ = false;
  ::shm_unlink(name_.c_str());
}

void mapSharedSegment(ShmSegment& segment, KeyValueStore& store, const std::string& prefix,
                      const std::string& tag, const std::vector<int>& members, int self,
                      size_t bytes) {
  // A failure on any member is published (empty name, "0" mapped) before it
  // is thrown, so no member waits on the store for the one that failed.
  const std::string base = prefix + "shm/" + tag + "/";
  if (self == members.front()) {
    const uint64_t pidNamespace = pidNamespaceInode();
    removeAbandonedSegments(pidNamespace);
    const std::string name = strCat("/pycomm-", pidNamespace, "-", ::getpid(), "-", randomHex(8));
    try {
      segment.create(name, bytes);
    } catch (const Error&) {
      store.set(base + "name", "");
      throw;
    }
    store.set(base + "name", name);
    std::string failed;
    for (size_t i = 1; i < members.size(); ++i)
      if (store.get(base + "mapped/" + std::to_string(members[i])) != "1" && failed.empty())
        failed = std::to_string(members[i]);
    segment.unlink();
    if (!failed.empty())
      throwError(ErrorKind::kConnection, "rank ", failed, " could not map the shared memory ", name);
  } else {
    const std::string name = store.get(base + "name");
    try {
      if (name.empty())
        throwError(ErrorKind::kConnection, "rank ", members.front(), " could not create shared memory");
      segment.open(name, bytes);
    } catch (const Error&) {
      store.set(base + "mapped/" + std::to_string(self), "0");
      throw;
    }
    store.set(base + "mapped/" + std::to_string(self), "1");
  }
}

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word size");
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000000) * 1000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool processAlive(int pid) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child stays a zombie until its parent reaps it: that is not alive.
  const std::string stat = readFirstLine(("/proc/" + std::to_string(pid) + "/stat").c_str());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return true;
  const char state = stat[close + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace pycomm
