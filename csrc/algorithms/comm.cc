#include "algorithms/comm.h"

#include <algorithm>
#include <cstdio>

#include "transport/sub_transport.h"

namespace pycomm {

void Comm::begin(const std::string& op, const std::string& algorithm) {
  ++sequence_;
  tag_ = kCollectiveTagBit | sequence_;
  op_ = op;
  algorithm_ = algorithm;
  start_ = Clock::now();
  deadline_ = start_ + timeout_;
}

void Comm::begin(const std::string& op, std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  begin(op);
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

std::string Comm::prefix() const {
  return algorithm_.empty() ? strCat("pycomm ", op_) : strCat("pycomm ", op_, " (", algorithm_, ")");
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
    fail(ErrorKind::kTimeout, transport_.rankName(rank()), " timed out after ",
               seconds, " s waiting for ",
               peer == kAnySource ? std::string("any rank") : transport_.rankName(peer),
               " (did it call the same collective? is it alive?",
               pending.empty() ? "" : " " + pending, ")");
  }
  if (request->failed()) fail(ErrorKind::kConnection, request->error());
}

void Comm::waitArena(int peer, ShmArena::Phase phase, uint64_t value) {
  bool timedOut = false;
  const std::string failure = arena_->waitFor(peer, phase, value, deadline_, &timedOut);
  if (failure.empty()) return;
  const std::string peerName = transport_.rankName(arena_->members()[peer]);
  if (timedOut) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.1f", timeout_.count() / 1000.0);
    fail(ErrorKind::kTimeout, transport_.rankName(rank()), " timed out after ",
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
