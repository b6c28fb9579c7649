// Torch-free tests of a group's bootstrap (transport/bootstrap.h): ranks as
// threads of one process over memory_store.h. Built and run by
// tests/transport/test_bootstrap_cpp.py; prints one line per check, exits non-zero on failure.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/collectives.h"
#include "transport/bootstrap.h"
#include "transport/memory_store.h"
#include "transport/shm_segment.h"

using namespace pycomm;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

struct Outcome {
  GroupTransport group;
  std::string error;
  ErrorKind kind = ErrorKind::kInternal;
};

// Bootstraps `modes.size()` ranks in parallel, rank r with transport modes[r].
std::vector<Outcome> bootstrap(const std::vector<std::string>& modes, const std::string& prefix) {
  MemoryStore store(std::chrono::seconds(20));
  const int n = static_cast<int>(modes.size());
  std::vector<Outcome> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      GroupConfig config;
      config.timeout = std::chrono::seconds(20);
      config.storePrefix = prefix;
      config.transport = modes[r];
      config.segmentBytes = 64 * 1024;
      try {
        out[r].group = bootstrapGroup(store, r, n, config);
      } catch (const Error& e) {
        out[r].error = e.what();
        out[r].kind = e.kind();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// A SUM all-reduce of (rank + 1) on every rank through the bootstrapped groups.
bool allreduceWorks(std::vector<Outcome>& ranks) {
  const int n = static_cast<int>(ranks.size());
  std::vector<float> values(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Comm comm(*ranks[r].group.transport, std::chrono::seconds(20), 64 * 1024);
        comm.setArena(ranks[r].group.arena.get());
        comm.setHostLeaders(ranks[r].group.hostLeaders);
        comm.begin("allreduce");
        float value = static_cast<float>(r + 1);
        allreduce(comm, &value, 1, DataType::kFloat32, ReduceOp::kSum, nullptr);
        values[r] = value;
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    if (!errors[r].empty() || values[r] != n * (n + 1) / 2.0f) return false;
  return true;
}

// Opens a segment made by the test with `mode` (and owner `uid`, when it may
// chown): "" if ShmSegment::open took it, else its error.
std::string openSegmentWith(mode_t mode, uid_t uid) {
  const std::string name = "/pycomm-test-" + std::to_string(::getpid()) + "-mode";
  ::shm_unlink(name.c_str());
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return "the test could not create " + name;
  int rc = ::ftruncate(fd, 4096);
  rc |= ::fchmod(fd, mode);  // umask does not apply to fchmod
  if (uid != ::geteuid()) rc |= ::fchown(fd, uid, static_cast<gid_t>(-1));
  ::close(fd);
  std::string error;
  if (rc != 0) {
    error = "the test could not set up " + name;
  } else {
    try {
      ShmSegment segment;
      segment.open(name, 4096);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  ::shm_unlink(name.c_str());
  return error;
}

// Item: shared-memory segments are refused unless this user's and 0600.
void foreignSegmentsAreRefused() {
  expect(openSegmentWith(0600, ::geteuid()).empty(), "a segment of this user with mode 0600 opens");
  const std::string loose = openSegmentWith(0644, ::geteuid());
  expect(loose.find("mode 0644") != std::string::npos, "a segment with mode 0644 is refused: " + loose);
  if (::geteuid() == 0) {  // root may give it away: another owner is refused too
    const std::string foreign = openSegmentWith(0600, 65534);
    expect(foreign.find("owned by uid 65534") != std::string::npos,
           "a segment owned by another user is refused: " + foreign);
  }
}

}  // namespace

int main() {
  foreignSegmentsAreRefused();
  {
    auto ranks = bootstrap({"auto", "auto", "auto"}, "p1/");
    bool ok = true;
    for (auto& o : ranks)
      ok = ok && o.error.empty() && o.group.arena && o.group.arena->localSize() == 3 &&
           o.group.hostLeaders == std::vector<int>{0};
    expect(ok, "auto, one host: every rank shares one arena, one host leader");
    expect(ok && allreduceWorks(ranks), "auto, one host: an all-reduce over the bootstrapped group");
  }
  {
    auto ranks = bootstrap({"tcp", "tcp", "tcp"}, "p2/");
    bool ok = true;
    for (auto& o : ranks) ok = ok && o.error.empty() && !o.group.arena && o.group.hostLeaders.empty();
    expect(ok, "tcp: no arena, no host leaders");
    expect(ok && allreduceWorks(ranks), "tcp: an all-reduce over the bootstrapped group");
  }
  {
    // One rank refuses shared memory: everyone runs over TCP, nobody waits.
    auto ranks = bootstrap({"auto", "auto", "tcp"}, "p3/");
    bool ok = true;
    for (auto& o : ranks) ok = ok && o.error.empty() && !o.group.arena && o.group.hostLeaders.empty();
    expect(ok, "mixed auto/tcp: every rank falls back to TCP");
  }
  {
    // Under "shm" the same refusal is an error naming the rank that refused.
    auto ranks = bootstrap({"shm", "shm", "tcp"}, "p4/");
    const bool ok = ranks[0].kind == ErrorKind::kConnection &&
                    ranks[0].error.find("rank 2: PYCOMM_TRANSPORT=tcp") != std::string::npos &&
                    ranks[1].kind == ErrorKind::kConnection && ranks[2].error.empty();
    expect(ok, "shm with a tcp rank: the shm ranks fail naming rank 2 (" + ranks[0].error + ")");
  }
  {
    MemoryStore store;
    GroupConfig config;
    config.transport = "udp";
    std::string error;
    try {
      bootstrapGroup(store, 0, 1, config);
    } catch (const Error& e) {
      error = e.kind() == ErrorKind::kUsage ? e.what() : "";
    }
    expect(error.find("unknown transport 'udp'") != std::string::npos, "an unknown transport is a usage error");
  }
  if (failures == 0) std::cout << "all passed" << std::endl;
  return failures == 0 ? 0 : 1;
}
