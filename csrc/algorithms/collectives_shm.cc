// Every collective besides all-reduce through the node-local shared-memory
// arena (all ranks of the group on one host; see allreduce_shm.cc for the
// all-reduce and transport/shm_arena.h for the slots and counters).
//
// Each step of a collective is one arena segment g: a rank waits until its slot
// for g is free (everyone consumed segment g - depth), fills it, publishes
// kPosted, reads what it needs from the slots of the ranks it waits for, and
// publishes kConsumed. Every rank takes part in every step (an empty call takes
// one), so segment indices stay equal across ranks. Each step is posted with
// the call (collective, bytes, root, dtype, op: ArenaOp in comm.h); at the first
// step of a call every rank waits for every peer's post, even a root that reads
// nobody's slot, so ranks whose calls differ (tensor sizes that differ between
// ranks) all fail there with the difference, before any data is read.
// Collectives that send different data to different ranks split a slot into
// one sub-slot per destination.
//
// pycomm.stats() counts what a point-to-point algorithm would have moved: a
// rank "sends" the bytes of its slot that peers read (once per reader) and
// "receives" what it reads from peers' slots.
#include <algorithm>
#include <cstring>

#include "algorithms/collectives.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

class Steps {
 public:
  Steps(Comm& comm, const ShmArena::Call& call)
      : comm_(comm), arena_(*comm.arena()), me_(arena_.localRank()), call_(call) {}

  // Starts the next step; returns this rank's slot for it.
  char* begin() {
    g_ = arena_.nextSegment();
    if (g_ >= static_cast<uint64_t>(arena_.depth()))
      comm_.waitArenaAll(ShmArena::kConsumed, g_ - arena_.depth() + 1);
    return arena_.slot(me_, g_);
  }
  // `bytesSent`: what peers will read of this step's slot, once per reader.
  void post(uint64_t bytesSent = 0) {
    arena_.post(g_, call_);
    bytesIn_ += bytesSent;
    if (first_) {  // every peer is in the same call (waitArena compares)
      first_ = false;
      for (int j = 0; j < size(); ++j)
        if (j != me_) comm_.waitArena(j, ShmArena::kPosted, g_ + 1);
    }
  }
  // Rank j's slot of this step, once j has posted it.
  const char* from(int j, uint64_t bytesOut = 0) {
    comm_.waitArena(j, ShmArena::kPosted, g_ + 1);
    bytesOut_ += bytesOut;
    return arena_.slot(j, g_);
  }
  void end() { arena_.publish(ShmArena::kConsumed, g_ + 1); }
  ~Steps() { arena_.countBytes(bytesIn_, bytesOut_); }

  int rank() const { return me_; }
  int size() const { return arena_.localSize(); }
  size_t slotBytes() const { return arena_.slotBytes(); }
  // One destination's share of a slot (64-byte aligned).
  size_t subSlotBytes() const {
    const size_t sub = arena_.slotBytes() / static_cast<size_t>(size()) / 64 * 64;
    PYCOMM_CHECK_INTERNAL(sub > 0, "shared-memory slots too small for ", size(), " ranks");
    return sub;
  }
  ShmArena& arena() { return arena_; }

 private:
  Comm& comm_;
  ShmArena& arena_;
  const int me_;
  const ShmArena::Call call_;
  bool first_ = true;
  uint64_t g_ = 0;
  uint64_t bytesIn_ = 0;
  uint64_t bytesOut_ = 0;
};

size_t part(size_t total, size_t offset, size_t unit) {
  return offset >= total ? 0 : std::min(unit, total - offset);
}

size_t stepsFor(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit; }

// Steps of `unit` for `bytes`; an empty call takes one step (without data).
size_t atLeastOneStep(size_t bytes, size_t unit) { return std::max<size_t>(1, stepsFor(bytes, unit)); }

size_t sum(const std::vector<size_t>& values) {
  size_t total = 0;
  for (size_t v : values) total += v;
  return total;
}

}  // namespace

void broadcastShm(Comm& comm, void* buf, size_t bytes, int root) {
  Steps steps(comm, arenaCall(Collective::kBroadcast, bytes, root));
  char* data = static_cast<char*>(buf);
  const size_t rounds = atLeastOneStep(bytes, steps.slotBytes());
  for (size_t s = 0; s < rounds; ++s) {
    const size_t off = s * steps.slotBytes();
    const size_t len = part(bytes, off, steps.slotBytes());
    char* slot = steps.begin();
    if (steps.rank() == root && len) std::memcpy(slot, data + off, len);
    steps.post(steps.rank() == root ? (steps.size() - 1) * len : 0);
    if (steps.rank() != root && len) std::memcpy(data + off, steps.from(root, len), len);
    steps.end();
  }
}

void allgatherShm(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes) {
  Steps steps(comm, arenaCall(Collective::kAllgather, sum(bytes)));
  const int n = steps.size();
  const int me = steps.rank();
  const size_t unit = steps.slotBytes();
  const size_t rounds = atLeastOneStep(*std::max_element(bytes.begin(), bytes.end()), unit);
  for (size_t s = 0; s < rounds; ++s) {
    const size_t off = s * unit;
    char* slot = steps.begin();
    const size_t mine = part(bytes[me], off, unit);
    if (mine) std::memcpy(slot, chunks[me] + off, mine);
    steps.post((n - 1) * mine);
    for (int j = 0; j < n; ++j) {
      const size_t len = part(bytes[j], off, unit);
      if (j != me && len) std::memcpy(chunks[j] + off, steps.from(j, len), len);
    }
    steps.end();
  }
}

void reduceScatterShm(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& counts,
                      DataType dtype, ReduceOp op) {
  Steps steps(comm, arenaCall(Collective::kReduceScatter, sum(counts) * elementSize(dtype), dtype, op));
  const int n = steps.size();
  const int me = steps.rank();
  const size_t elem = elementSize(dtype);
  const size_t sub = steps.subSlotBytes();
  const size_t unit = sub / elem;  // elements per destination per step
  const size_t rounds = atLeastOneStep(*std::max_element(counts.begin(), counts.end()), unit);
  for (size_t s = 0; s < rounds; ++s) {
    const size_t off = s * unit;
    char* slot = steps.begin();
    uint64_t in = 0;
    for (int j = 0; j < n; ++j) {
      const size_t len = part(counts[j], off, unit);
      if (j != me && len) std::memcpy(slot + j * sub, chunks[j] + off * elem, len * elem), in += len * elem;
    }
    steps.post(in);
    const size_t mine = part(counts[me], off, unit);
    for (int j = 0; j < n && mine; ++j) {
      if (j == me) continue;
      reduceInto(chunks[me] + off * elem, steps.from(j, mine * elem) + me * sub, mine, dtype, op);
    }
    steps.end();
  }
}

void gatherShm(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs,
               int root) {
  Steps steps(comm, arenaCall(Collective::kGather, bytes, root));
  const int n = steps.size();
  const int me = steps.rank();
  const char* in = static_cast<const char*>(input);
  const size_t rounds = atLeastOneStep(bytes, steps.slotBytes());
  for (size_t s = 0; s < rounds; ++s) {
    const size_t off = s * steps.slotBytes();
    const size_t len = part(bytes, off, steps.slotBytes());
    char* slot = steps.begin();
    if (me != root && len) std::memcpy(slot, in + off, len);
    steps.post(me != root ? len : 0);
    // The root's own part only once every rank's call is known to match.
    if (s == 0 && me == root && bytes > 0 && outputs[me] != in) std::memcpy(outputs[me], in, bytes);
    if (me == root && len)
      for (int j = 0; j < n; ++j)
        if (j != me) std::memcpy(outputs[j] + off, steps.from(j, len), len);
    steps.end();
  }
}

void scatterShm(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes,
                int root) {
  Steps steps(comm, arenaCall(Collective::kScatter, bytes, root));
  const int n = steps.size();
  const int me = steps.rank();
  char* out = static_cast<char*>(output);
  const size_t sub = steps.subSlotBytes();
  const size_t rounds = atLeastOneStep(bytes, sub);
  for (size_t s = 0; s < rounds; ++s) {
    const size_t off = s * sub;
    const size_t len = part(bytes, off, sub);
    char* slot = steps.begin();
    if (me == root && len)
      for (int j = 0; j < n; ++j)
        if (j != me) std::memcpy(slot + j * sub, inputs[j] + off, len);
    steps.post(me == root ? (n - 1) * len : 0);
    // The root's own part only once every rank's call is known to match.
    if (s == 0 && me == root && bytes > 0 && inputs[me] != out) std::memcpy(out, inputs[me], bytes);
    if (me != root && len) std::memcpy(out + off, steps.from(root, len) + me * sub, len);
    steps.end();
  }
}

void alltoallShm(Comm& comm, const std::vector<const char*>& sends, const std::vector<size_t>& sendBytes,
                 const std::vector<char*>& recvs, const std::vector<size_t>& recvBytes) {
  // Ranks send different sizes: the call carries none, the table below checks them.
  Steps steps(comm, arenaCall(Collective::kAlltoall, 0));
  const int n = steps.size();
  const int me = steps.rank();
  const size_t sub = steps.subSlotBytes();
  PYCOMM_CHECK_INTERNAL(static_cast<size_t>(n) * sizeof(uint64_t) <= steps.slotBytes(),
                        "too many ranks for the shared-memory slots");
  // Step 1: everyone publishes what it sends to whom; each rank checks what it
  // expects and all agree on the number of data steps.
  uint64_t* table = reinterpret_cast<uint64_t*>(steps.begin());
  for (int j = 0; j < n; ++j) table[j] = sendBytes[j];
  steps.post();
  size_t rounds = 0;
  std::string mismatch;
  for (int j = 0; j < n; ++j) {
    const uint64_t* theirs = j == me ? table : reinterpret_cast<const uint64_t*>(steps.from(j));
    for (int k = 0; k < n; ++k) rounds = std::max(rounds, k == j ? 0 : stepsFor(theirs[k], sub));
    if (theirs[me] != recvBytes[j] && mismatch.empty())
      mismatch = strCat(comm.transport().rankName(steps.arena().members()[j]), " sent ", theirs[me],
                        " bytes where ", recvBytes[j], " were expected (tensor sizes differ between ranks?)");
  }
  steps.end();
  if (!mismatch.empty()) comm.fail(ErrorKind::kConnection, mismatch);
  if (sendBytes[me] > 0 && recvs[me] != sends[me]) std::memcpy(recvs[me], sends[me], sendBytes[me]);
  for (size_t s = 0; s < rounds; ++s) {
    const size_t off = s * sub;
    char* slot = steps.begin();
    uint64_t in = 0;
    for (int j = 0; j < n; ++j) {
      const size_t len = part(sendBytes[j], off, sub);
      if (j != me && len) std::memcpy(slot + j * sub, sends[j] + off, len), in += len;
    }
    steps.post(in);
    for (int j = 0; j < n; ++j) {
      const size_t len = part(recvBytes[j], off, sub);
      if (j != me && len) std::memcpy(recvs[j] + off, steps.from(j, len) + me * sub, len);
    }
    steps.end();
  }
}

void barrierShm(Comm& comm) {
  Steps steps(comm, arenaCall(Collective::kBarrier, 0));
  steps.begin();
  steps.post();
  for (int j = 0; j < steps.size(); ++j)
    if (j != steps.rank()) steps.from(j);
  steps.end();
}

}  // namespace pycomm
