// Shared-memory building blocks for the node-local arena (shm_arena.h), over
// which the shared-memory algorithm family runs (there is no shm transport: TCP
// carries every byte between ranks that is not in the arena): a POSIX shared-memory segment (0600, named per job, unlinked as soon as every
// local peer has mapped it), futex waits that work across processes, the "same
// host" key, and a liveness check for local peers.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <sched.h>

#include <string>
#include <vector>

#include "transport/transport.h"

namespace pycomm {

// What makes two ranks "on the same host" for shared memory: boot id, hostname,
// and the network, IPC, mount and PID namespaces. Ranks in different network
// namespaces are different hosts (multi-host tests on one machine use TCP).
std::string hostKey();

// The CPUs this thread may run on (its affinity mask, e.g. a container's cpuset);
// every CPU the machine has where the mask cannot be read.
cpu_set_t allowedCpuSet();

// Which ranks share a host: entry r is the lowest rank on rank r's host (its
// leader). Publishes this rank's key under `<prefix>host/<rank>` and reads
// everyone's, so every rank computes the same vector. Ranks passing different
// `salt`s count as different hosts. `ranksOnMachine`, when given, receives how
// many ranks share this rank's machine (its boot id: one kernel, whatever the
// namespaces or salts), this rank included.
std::vector<int> hostLeaders(KeyValueStore& store, const std::string& prefix, int rank, int size,
                             const std::string& salt = "", int* ranksOnMachine = nullptr);

// A mapped shared-memory segment. The creator makes it with O_EXCL, sets it to
// `bytes` (zero-filled), and removes the name once every user has mapped it
// (see mapSharedSegment); the mapping lives until the object dies.
class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  void create(const std::string& name, size_t bytes);
  void open(const std::string& name, size_t bytes);
  void unlink();  // idempotent; only the creator calls it

  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  char* data_ = nullptr;
  size_t bytes_ = 0;
  bool linked_ = false;
};

// Collective over `members` (ranks of the group whose store this is, `self`
// among them): members[0] creates a segment under a fresh random name
// (/dev/shm/pycomm-<pid>-<random>), publishes the name under
// `<prefix>shm/<tag>/name` (`tag` must differ between hosts of one group), the others map it and say so, and the creator
// unlinks the name once all have it: past that point nothing is left in
// /dev/shm whatever happens to the processes.
void mapSharedSegment(ShmSegment& segment, KeyValueStore& store, const std::string& prefix,
                      const std::string& tag, const std::vector<int>& members, int self,
                      size_t bytes);

// Sleeps while *word == expected, at most `timeout` (spurious wake-ups allowed).
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout);
void futexWakeAll(std::atomic<uint32_t>* word);

// False once process `pid` no longer exists (it crashed or was killed).
bool processAlive(int pid);

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace pycomm
