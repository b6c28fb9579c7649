// The node-local arena: shared memory among the ranks of a group that share a
// host, for shm-native collectives (algorithms/allreduce_shm.cc). Each local
// rank owns `depth` slots of `slotBytes` and a few monotonic progress counters;
// peers read each other's slots directly and wait on each other's counters
// (spin briefly, then sleep on a futex). The arena knows nothing of reductions.
//
// Every local rank runs the same sequence of arena collectives, so a segment
// index (nextSegment) names the same step everywhere; slot `g % depth` carries
// segment g. Each step is posted with a Call (which collective, how many bytes,
// ...; opaque here, encoded by algorithms/comm.cc) that peers compare where they
// wait for the posted counter: ranks running different calls (tensor sizes that
// differ between ranks) fail at the first step instead of reading each other's
// slots as if they matched.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "transport/shm_segment.h"
#include "transport/transport.h"

namespace pycomm {

class ShmArena {
 public:
  // Progress counters a rank publishes (values are segment indices + 1).
  enum Phase { kPosted = 0, kReduced = 1, kConsumed = 2, kPhases = 3 };

  // Collective over `members` (the group ranks on this host, ascending; `self`
  // among them), through the group's store under `prefix`. `spread`: an
  // oversubscribed rank crowded on one CPU moves to a freer one (see waitFor).
  ShmArena(KeyValueStore& store, const std::string& prefix, std::vector<int> members, int self,
           size_t slotBytes, int depth, bool spread);

  int localRank() const { return localRank_; }
  int localSize() const { return static_cast<int>(members_.size()); }
  const std::vector<int>& members() const { return members_; }
  size_t slotBytes() const { return slotBytes_; }
  int depth() const { return depth_; }

  // The next segment index (the same on every local rank for the same step).
  uint64_t nextSegment() { return nextSegment_++; }
  char* slot(int localRank, uint64_t segment) const;

  void publish(Phase phase, uint64_t value);

  // What a step belongs to. Two words, opaque to the arena.
  struct Call {
    uint64_t bytes = 0;
    uint64_t what = 0;
    bool operator==(const Call& other) const { return bytes == other.bytes && what == other.what; }
    bool operator!=(const Call& other) const { return !(*this == other); }
  };
  // Records `call` for `segment`, then publishes kPosted = segment + 1.
  void post(uint64_t segment, const Call& call);
  // The call local rank `localRank` posted `segment` with: valid once its
  // kPosted reached segment + 1, until this rank publishes kConsumed for it
  // (the slot, and its call, are not reused before).
  Call callOf(int localRank, uint64_t segment) const;
  static constexpr int kMaxDepth = 16;
  // Waits until local rank `peer` has published `phase` >= value. Returns "" on
  // success, else why not (timeout, a peer's abort, a dead peer); the caller
  // adds the op name. `timedOut` tells a timeout from the other failures.
  std::string waitFor(int peer, Phase phase, uint64_t value, Clock::time_point deadline,
                      bool* timedOut);

  // Tells every local peer that this rank gives up (they fail at their next
  // wait instead of timing out). Idempotent.
  void abort(const std::string& reason);

  // How ranks are named in failure messages (the transport's rankName).
  void setRankNamer(std::function<std::string(int)> namer) { namer_ = std::move(namer); }
  std::string rankName(int groupRank) const;

  // Says this rank has left (its group was destroyed normally): a peer waiting
  // on it fails at once instead of at its timeout. Idempotent.
  void leave();

  // Every local rank's progress counters, for timeout messages.
  std::string describe() const;

  // Bytes this rank copied into and read out of shared memory (pycomm.stats()).
  void countBytes(uint64_t in, uint64_t out);

 private:
  struct alignas(128) Control {
    std::atomic<uint64_t> counter[kPhases];
    std::atomic<uint32_t> doorbell;
    std::atomic<uint32_t> sleepers;
    std::atomic<int32_t> pid;
    std::atomic<uint32_t> aborted;
    std::atomic<uint32_t> departed;
    std::atomic<int32_t> cpuPlusOne;  // CPU + 1 where this rank last waited (0: not yet)
    std::atomic<uint64_t> call[kMaxDepth][2];  // per slot: the Call its step was posted with
    char reason[256];
  };
  Control& control(int localRank) const;
  // "" or why a peer's state means the wait cannot succeed.
  std::string peerFailure(int peer, bool checkAlive);
  // Oversubscribed waits: records this rank's CPU and, when more local ranks
  // share it than their fair share while an allowed CPU has two fewer, moves
  // this thread there (see docs/architecture.md, "Waiting").
  void spreadRanks();

  ShmSegment segment_;
  std::vector<int> members_;
  int localRank_ = 0;
  size_t slotBytes_ = 0;
  int depth_ = 0;
  size_t slotsOffset_ = 0;
  uint64_t nextSegment_ = 0;
  std::chrono::nanoseconds spin_;
  bool oversubscribed_ = false;
  bool spread_ = true;  // PYCOMM_SHM_SPREAD=0 turns spreadRanks off
  cpu_set_t allowed_;  // this thread's affinity mask when the arena was made
  Clock::time_point lastMove_{};
  // Whether more threads are runnable on the machine than there are local ranks
  // (/proc/loadavg), looked up at most every kLoadCheckMillis: other jobs want the
  // cores, and an oversubscribed wait sleeps at once instead of yielding (waitFor).
  bool othersRunnable();
  static int runnableTasks();  // the machine's runnable threads, 0 where unknown
  Clock::time_point nextLoadCheck_{};
  bool othersRunnable_ = false;
  static constexpr int kLoadCheckMillis = 20;
  // Oversubscribed waits poll with sched_yield this long before they sleep on the
  // futex (Open MPI polls with sched_yield without end on oversubscribed nodes).
  // Long enough to cover the skew of ranks leaving a barrier on a crowded host
  // (hundreds of us), so a rank that arrives early is awake when its peers post;
  // short enough that a rank waiting for a peer's computation soon sleeps.
  static constexpr int kYieldMicros = 5000;
  // A yield this long ends the polling (the core is busy with other work; see waitFor).
  static constexpr int kLongYieldMicros = 500;
  // cpuRelax() calls between two looks at the peer's counter while spinning.
  static constexpr int kPausesPerLook = 4;
  // How many yields between checks of the peers' abort flags while polling.
  static constexpr int kYieldsPerCheck = 256;
  std::function<std::string(int)> namer_;
};

}  // namespace pycomm
