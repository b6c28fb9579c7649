#include "algorithms/comm.h"

#include <algorithm>
#include <cstdio>

#include "transport/sub_transport.h"

namespace pycomm {

void Comm::begin(const std::string& op, const std::string& algorithm) {
  ++sequence_;
  tag_ = kCollectiveTagBit | (sequence_ & 0xffffffffull);  // no call bits yet (setCall)
  op_ = op;
  algorithm_ = algorithm;
  start_ = Clock::now();
  deadline_ = start_ + timeout_;
}

void Comm::begin(const std::string& op, std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  begin(op);
}

void Comm::refreshTopology() {
  topology_ = Topology();
  topology_.ranks = size();
  topology_.hosts = static_cast<int>(hostLeaders_.size());
  topology_.oneHost = size() == 1 || (arena_ != nullptr && arena_->localSize() == size());
  topology_.cost = costModel_;
}

Comm& Comm::leaderComm() {
  if (!leaderComm_) {
    leaderView_ = std::make_unique<SubTransport>(transport_, hostLeaders_);
    leaderComm_ = std::make_unique<Comm>(*leaderView_, timeout_, segmentBytes_);
    leaderComm_->setCostModel(costModel_);
  }
  return *leaderComm_;
}

void Comm::beginWithin(const Comm& outer, const std::string& algorithm) {
  sequence_ = outer.sequence_;
  tag_ = outer.tag_;
  op_ = outer.op_;
  algorithm_ = algorithm;
  timeout_ = outer.timeout_;
  start_ = outer.start_;
  deadline_ = outer.deadline_;
}

void Comm::letGo(const std::string& reason) const {
  if (arena_ != nullptr) arena_->abort(reason);
  transport_.abort(reason);
}

void Comm::wait(const RequestPtr& request) {
  if (!request->waitUntil(deadline_)) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.1f", timeout_.count() / 1000.0);
    const int peer = request->peer();
    const std::string pending = transport_.describePending(peer);
    fail(ErrorKind::kTimeout, transport_.rankName(rank()), ": Timed out after ",
               seconds, " s waiting for ",
               peer == kAnySource ? std::string("any rank") : transport_.rankName(peer),
               " (did it call the same collective? is it alive?",
               pending.empty() ? "" : " " + pending, ")");
  }
  if (request->failed()) fail(ErrorKind::kConnection, request->error());
}

namespace {

// ShmArena::Call::what: op | dtype + 1 << 8 | reduce op + 1 << 16 | root + 1 << 32
// (0: not part of this collective's call).
constexpr uint64_t kNoField = 0;

const char* arenaOpName(uint64_t op) {
  switch (op) {
    case static_cast<uint64_t>(Collective::kAllreduce): return "allreduce";
    case static_cast<uint64_t>(Collective::kBroadcast): return "broadcast";
    case static_cast<uint64_t>(Collective::kAllgather): return "allgather";
    case static_cast<uint64_t>(Collective::kReduceScatter): return "reduce_scatter";
    case static_cast<uint64_t>(Collective::kGather): return "gather";
    case static_cast<uint64_t>(Collective::kScatter): return "scatter";
    case static_cast<uint64_t>(Collective::kAlltoall): return "alltoall";
    case static_cast<uint64_t>(Collective::kBarrier): return "barrier";
  }
  return "an unknown collective";
}

// Why `theirs` (posted by `peer`) is not `mine`, in the words of the TCP
// algorithms' size checks.
std::string callMismatch(const std::string& peer, const ShmArena::Call& theirs, const ShmArena::Call& mine) {
  auto field = [](uint64_t what, int at) { return (what >> at) & 0xff; };
  if (field(theirs.what, 0) != field(mine.what, 0))
    return strCat(peer, " called ", arenaOpName(field(theirs.what, 0)), " where ", arenaOpName(field(mine.what, 0)),
                  " was expected (ranks called different collectives, or in a different order?)");
  if (theirs.bytes != mine.bytes)
    return strCat(peer, " called with ", theirs.bytes, " bytes where ", mine.bytes,
                  " were expected (tensor sizes differ between ranks?)");
  if (field(theirs.what, 8) != field(mine.what, 8) && field(theirs.what, 8) != kNoField && field(mine.what, 8) != kNoField)
    return strCat(peer, " called with ", dataTypeName(static_cast<DataType>(field(theirs.what, 8) - 1)), " where ",
                  dataTypeName(static_cast<DataType>(field(mine.what, 8) - 1)),
                  " was expected (dtypes differ between ranks?)");
  if (field(theirs.what, 16) != field(mine.what, 16) && field(theirs.what, 16) != kNoField && field(mine.what, 16) != kNoField)
    return strCat(peer, " called with ReduceOp.", reduceOpName(static_cast<ReduceOp>(field(theirs.what, 16) - 1)),
                  " where ReduceOp.", reduceOpName(static_cast<ReduceOp>(field(mine.what, 16) - 1)), " was expected");
  const auto rootOf = [](uint64_t what) { return static_cast<int64_t>(what >> 32) - 1; };
  if (rootOf(theirs.what) != rootOf(mine.what))
    return strCat(peer, " called with root ", rootOf(theirs.what), " where ", rootOf(mine.what), " was expected");
  return strCat(peer, " made a different call (", theirs.bytes, " bytes, ", theirs.what, ") where (", mine.bytes,
                " bytes, ", mine.what, ") was expected");
}

}  // namespace

ShmArena::Call arenaCall(Collective op, uint64_t bytes, int root) {
  return {bytes, static_cast<uint64_t>(op) | static_cast<uint64_t>(static_cast<uint32_t>(root + 1)) << 32};
}

ShmArena::Call arenaCall(Collective op, uint64_t bytes, DataType dtype, ReduceOp reduce) {
  return {bytes, static_cast<uint64_t>(op) | (static_cast<uint64_t>(dtype) + 1) << 8 |
                     (static_cast<uint64_t>(reduce) + 1) << 16};
}

void Comm::waitArena(int peer, ShmArena::Phase phase, uint64_t value) {
  bool timedOut = false;
  const std::string failure = arena_->waitFor(peer, phase, value, deadline_, &timedOut);
  if (failure.empty()) {
    if (phase != ShmArena::kPosted) return;
    const ShmArena::Call theirs = arena_->callOf(peer, value - 1);
    const ShmArena::Call mine = arena_->callOf(arena_->localRank(), value - 1);
    if (theirs == mine) return;
    fail(ErrorKind::kConnection, callMismatch(transport_.rankName(arena_->members()[peer]), theirs, mine));
  }
  const std::string peerName = transport_.rankName(arena_->members()[peer]);
  if (timedOut) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.1f", timeout_.count() / 1000.0);
    fail(ErrorKind::kTimeout, transport_.rankName(rank()), ": Timed out after ",
               seconds, " s waiting for ", peerName,
               " (did it call the same collective? is it alive? waiting for its counter to reach ",
               value, "; ", arena_->describe(), ")");
  }
  fail(ErrorKind::kConnection, failure);
}

void Comm::waitArenaAll(ShmArena::Phase phase, uint64_t value) {
  for (int j = 0; j < arena_->localSize(); ++j)
    if (j != arena_->localRank()) waitArena(j, phase, value);
}

void Comm::waitAll(std::vector<RequestPtr>& requests) {
  for (auto& request : requests) wait(request);
  requests.clear();
}

char* Comm::scratch(int slot, size_t bytes) {
  if (scratch_.size() <= static_cast<size_t>(slot)) {
    scratch_.resize(slot + 1);
    scratchBytes_.resize(slot + 1, 0);
  }
  if (scratchBytes_[slot] < bytes || !scratch_[slot]) {
    scratch_[slot].reset(new char[std::max<size_t>(bytes, 1)]);
    scratchBytes_[slot] = bytes;
  }
  return scratch_[slot].get();
}

std::vector<size_t> balancedOffsets(size_t count, int parts) {
  std::vector<size_t> offsets(static_cast<size_t>(parts) + 1, 0);
  const size_t base = count / parts;
  const size_t extra = count % parts;
  for (int i = 0; i < parts; ++i)
    offsets[i + 1] = offsets[i] + base + (static_cast<size_t>(i) < extra ? 1 : 0);
  return offsets;
}

}  // namespace pycomm
