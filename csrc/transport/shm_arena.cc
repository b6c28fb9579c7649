#include "transport/shm_arena.h"
#include "transport/shm_wait.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "common/stats.h"

namespace pycomm {
namespace {

constexpr uint64_t kMagic = 0x70796361726e6131ull;  // "pycarna1"

struct Header {
  uint64_t magic;
  uint64_t localSize;
  uint64_t slotBytes;
  uint64_t depth;
};

size_t roundUp(size_t value, size_t to) { return (value + to - 1) / to * to; }

// Where the control blocks start: after the header, at their own alignment (128:
// each rank's on cache lines of its own; right after the 32-byte header they were
// misaligned, which UBSan reports). Checked against Control in the constructor.
constexpr size_t kControlsOffset = 128;

}  // namespace

ShmArena::ShmArena(KeyValueStore& store, const std::string& prefix, std::vector<int> members,
                   int self, size_t slotBytes, int depth, bool spread)
    : members_(std::move(members)), slotBytes_(roundUp(slotBytes, 4096)), depth_(depth), spread_(spread) {
  auto it = std::find(members_.begin(), members_.end(), self);
  PYCOMM_CHECK_INTERNAL(it != members_.end() && depth_ > 0 && depth_ <= kMaxDepth, "bad arena membership");
  static_assert(kControlsOffset >= sizeof(Header) && kControlsOffset % alignof(Control) == 0,
                "control blocks misaligned");
  localRank_ = static_cast<int>(it - members_.begin());
  const size_t n = members_.size();
  slotsOffset_ = roundUp(kControlsOffset + n * sizeof(Control), 4096);
  const size_t bytes = slotsOffset_ + n * static_cast<size_t>(depth_) * slotBytes_;
  // One arena per host: the key names the host by its lowest rank.
  mapSharedSegment(segment_, store, prefix, strCat("arena", members_.front()), members_, self, bytes);
  auto* header = reinterpret_cast<Header*>(segment_.data());
  if (localRank_ == 0) *header = {kMagic, n, slotBytes_, static_cast<uint64_t>(depth_)};
  // Everyone has mapped the segment (mapSharedSegment waited), but the header
  // written above may not be visible yet to others: they only read what they own.
  control(localRank_).pid.store(static_cast<int32_t>(::getpid()), std::memory_order_release);
  // More local ranks than the CPUs this thread may run on (its affinity mask,
  // e.g. a container's cpuset): a spinning rank would steal its peer's core.
  allowed_ = allowedCpuSet();
  oversubscribed_ = n > static_cast<size_t>(std::max(1, CPU_COUNT(&allowed_)));
  // Oversubscribed: no spin (one look), the core goes to a peer at once (waitFor).
  spin_ = oversubscribed_ ? std::chrono::microseconds(0) : std::chrono::microseconds(50);
}

std::string ShmArena::rankName(int groupRank) const {
  return namer_ ? namer_(groupRank) : "rank " + std::to_string(groupRank);
}

ShmArena::Control& ShmArena::control(int localRank) const {
  return reinterpret_cast<Control*>(segment_.data() + kControlsOffset)[localRank];
}

char* ShmArena::slot(int localRank, uint64_t segment) const {
  const size_t index = static_cast<size_t>(localRank) * depth_ + segment % depth_;
  return segment_.data() + slotsOffset_ + index * slotBytes_;
}

void ShmArena::publish(Phase phase, uint64_t value) {
  Control& c = control(localRank_);
  c.counter[phase].store(value, std::memory_order_release);
  c.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_seq_cst) > 0) futexWakeAll(&c.doorbell);
}

void ShmArena::post(uint64_t segment, const Call& call) {
  Control& c = control(localRank_);
  const size_t at = segment % depth_;
  // Relaxed: publish()'s release store of the counter orders them before it.
  c.call[at][0].store(call.bytes, std::memory_order_relaxed);
  c.call[at][1].store(call.what, std::memory_order_relaxed);
  publish(kPosted, segment + 1);
}

ShmArena::Call ShmArena::callOf(int localRank, uint64_t segment) const {
  const Control& c = control(localRank);
  const size_t at = segment % depth_;
  return {c.call[at][0].load(std::memory_order_relaxed), c.call[at][1].load(std::memory_order_relaxed)};
}

std::string ShmArena::peerFailure(int peer, bool checkAlive) {
  for (int j = 0; j < localSize(); ++j) {
    Control& c = control(j);
    if (c.aborted.load(std::memory_order_acquire)) {  // this rank's own abort included
      return strCat(rankName(members_[j]), " aborted the group: ",
                    std::string(c.reason, strnlen(c.reason, sizeof(c.reason))));
    }
  }
  if (control(peer).departed.load(std::memory_order_acquire))
    return strCat(rankName(members_[peer]), " left the group (its process group was destroyed)");
  if (checkAlive) {
    const int pid = control(peer).pid.load(std::memory_order_acquire);
    if (!processAlive(pid)) return strCat(rankName(members_[peer]), " exited (process ", pid, " is gone)");
  }
  return "";
}

int ShmArena::runnableTasks() {
  // /proc/loadavg: "0.52 0.58 0.59 3/712 12345", the 4th field runnable/total threads.
  char text[128];
  FILE* f = std::fopen("/proc/loadavg", "re");
  if (f == nullptr) return 0;
  const size_t got = std::fread(text, 1, sizeof(text) - 1, f);
  std::fclose(f);
  text[got] = '\0';
  int running = 0, total = 0;
  double a = 0, b = 0, c = 0;
  if (std::sscanf(text, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) return 0;
  return running;
}

namespace {
std::atomic<bool> ignoreOtherJobs{false};
}  // namespace

void shmIgnoreOtherJobs(bool ignore) { ignoreOtherJobs.store(ignore, std::memory_order_relaxed); }

bool ShmArena::othersRunnable() {
  if (ignoreOtherJobs.load(std::memory_order_relaxed)) return false;
  const auto now = Clock::now();
  if (now >= nextLoadCheck_) {
    nextLoadCheck_ = now + std::chrono::milliseconds(kLoadCheckMillis);
    othersRunnable_ = runnableTasks() > localSize();
  }
  return othersRunnable_;
}

std::string ShmArena::waitFor(int peer, Phase phase, uint64_t value, Clock::time_point deadline,
                              bool* timedOut) {
  *timedOut = false;
  Control& c = control(peer);
  auto ready = [&] { return c.counter[phase].load(std::memory_order_acquire) >= value; };
  if (ready()) return "";
  if (oversubscribed_ && spread_) spreadRanks();
  const auto spinEnd = Clock::now() + spin_;
  do {
    // A few pauses per look: 64 took 1.7 us on an EPYC (Zen 4), the delay between
    // a peer's post and this rank seeing it.
    for (int i = 0; i < kPausesPerLook; ++i) cpuRelax();
    if (ready()) return "";
  } while (Clock::now() < spinEnd);
  // Oversubscribed, the wait polls with sched_yield (below) only while no thread
  // besides the local ranks is runnable on the machine. Where other jobs are, a yield
  // hands one of them the core for its time slice, and the scheduler (EEVDF) pushes
  // the yielder's deadline back a slice at every yield: next to 2 busy processes, 4
  // ranks on 2 cores took 12-17 times as long per all-reduce (2 KiB to 512 KiB) as
  // without them while they yielded, 2.8-5.5 times sleeping at once on the futex
  // (benchmarks/results/inference_allreduce_noisy_main.md, inference_allreduce_noisy.md).
  if (oversubscribed_ && !othersRunnable()) {
    // More local ranks than cores: the peer we wait for is likely runnable on
    // our core. Yielding hands it the core at once, without the futex round trip,
    // and a poller is awake when the peer posts: a futex wake-up on a crowded
    // host costs hundreds of us (4 ranks, 2 cores: 8 B after a barrier took
    // ~800 us with 200 us of polling, most of it waking the sleepers).
    // A yield that kept this rank off the core for kLongYieldMicros or more means
    // something ran there for a whole time slice: the peer computing, or other
    // jobs on the host. Then every further yield costs a slice too, while the futex
    // wakes this rank when the peer posts: it goes to sleep at once.
    auto before = Clock::now();
    const auto yieldEnd =
        std::min<Clock::time_point>(before + std::chrono::microseconds(kYieldMicros), deadline);
    int yields = 0;
    while (before < yieldEnd) {
      std::this_thread::yield();
      if (ready()) return "";
      if (++yields % kYieldsPerCheck == 0) {  // a peer's abort ends the wait at once
        std::string failure = peerFailure(peer, false);
        if (!failure.empty()) return failure;
      }
      const auto now = Clock::now();
      if (now - before >= std::chrono::microseconds(kLongYieldMicros)) break;
      before = now;
    }
  }
  auto lastCheck = Clock::now();
  for (;;) {
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = c.doorbell.load(std::memory_order_seq_cst);
    if (ready()) {
      c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return "";
    }
    const auto now = Clock::now();
    const auto slice = std::min<Clock::duration>(std::chrono::milliseconds(10), deadline - now);
    if (slice > Clock::duration::zero()) {
      futexWait(&c.doorbell, seen,
                std::chrono::duration_cast<std::chrono::microseconds>(slice) +
                    std::chrono::microseconds(1));
    }
    c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return "";
    const auto after = Clock::now();
    const bool checkAlive = after - lastCheck >= std::chrono::milliseconds(50);
    if (checkAlive) lastCheck = after;
    std::string failure = peerFailure(peer, checkAlive);
    if (!failure.empty()) return failure;
    if (after >= deadline) {
      *timedOut = true;
      return "timed out";
    }
  }
}

void ShmArena::spreadRanks() {
  const int cpu = sched_getcpu();
  if (cpu < 0) return;
  control(localRank_).cpuPlusOne.store(cpu + 1, std::memory_order_relaxed);
  const int n = localSize();
  auto ranksOn = [&](int c) {
    int count = 0;
    for (int j = 0; j < n; ++j) count += control(j).cpuPlusOne.load(std::memory_order_relaxed) == c + 1;
    return count;
  };
  const int here = ranksOn(cpu);
  const int cpus = CPU_COUNT(&allowed_);
  if (cpus < 2 || here <= (n + cpus - 1) / cpus) return;  // at most its fair share here
  // Of the ranks crowded on this CPU, the highest moves (one decision per CPU).
  for (int j = localRank_ + 1; j < n; ++j)
    if (control(j).cpuPlusOne.load(std::memory_order_relaxed) == cpu + 1) return;
  const auto now = Clock::now();
  if (now - lastMove_ < std::chrono::milliseconds(1)) return;  // no ping-pong
  int target = -1, fewest = here - 1;  // the move must leave the target below `here`
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (c == cpu || !CPU_ISSET(c, &allowed_)) continue;
    const int count = ranksOn(c);
    if (count < fewest) target = c, fewest = count;
  }
  if (target < 0) return;
  lastMove_ = now;
  // The mask may have changed since the arena was made (the user's own pinning).
  if (sched_getaffinity(0, sizeof(allowed_), &allowed_) != 0 || !CPU_ISSET(target, &allowed_)) return;
  // Pinning to the target migrates this thread now; restoring the mask at once
  // leaves it there and the scheduler free to move it again.
  cpu_set_t only;
  CPU_ZERO(&only);
  CPU_SET(target, &only);
  if (sched_setaffinity(0, sizeof(only), &only) != 0) return;
  sched_setaffinity(0, sizeof(allowed_), &allowed_);
  control(localRank_).cpuPlusOne.store(target + 1, std::memory_order_relaxed);
}

void ShmArena::abort(const std::string& reason) {
  Control& mine = control(localRank_);
  if (mine.aborted.load(std::memory_order_acquire)) return;
  const size_t n = std::min(reason.size(), sizeof(mine.reason) - 1);
  std::memcpy(mine.reason, reason.data(), n);
  mine.reason[n] = '\0';
  mine.aborted.store(1, std::memory_order_release);
  for (int j = 0; j < localSize(); ++j) {
    control(j).doorbell.fetch_add(1, std::memory_order_seq_cst);
    futexWakeAll(&control(j).doorbell);
  }
}

std::string ShmArena::describe() const {
  std::string text = strCat("shared-memory progress (posted/reduced/consumed):");
  for (int j = 0; j < localSize(); ++j) {
    const Control& c = control(j);
    text += strCat(j ? ";" : "", " ", rankName(members_[j]), " ", c.counter[kPosted].load(), "/",
                   c.counter[kReduced].load(), "/", c.counter[kConsumed].load());
  }
  return text + strCat("; this rank's next step ", nextSegment_);
}

void ShmArena::leave() {
  control(localRank_).departed.store(1, std::memory_order_release);
  for (int j = 0; j < localSize(); ++j) {
    control(j).doorbell.fetch_add(1, std::memory_order_seq_cst);
    futexWakeAll(&control(j).doorbell);
  }
}

void ShmArena::countBytes(uint64_t in, uint64_t out) {
  Stats::instance().addSent(in);
  Stats::instance().addReceived(out);
}

}  // namespace pycomm
