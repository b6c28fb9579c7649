// The context one collective runs in: a transport, the group timeout, the
// pipeline segment size, and the names used in errors. Algorithms post and wait
// through it so every wait has a deadline and every failure names the op.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "algorithms/topology.h"
#include "common/call.h"
#include "common/cost_model.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/reduce_op.h"
#include "transport/shm_arena.h"
#include "transport/transport.h"

namespace pycomm {

// Tags: collectives set the top bit (plus a per-group sequence number, mod 2^32, and
// a hash of the call: setCall); user point-to-point tags never do.
constexpr uint64_t kCollectiveTagBit = 1ull << 63;
// A collective's flow-control credits travel on its tag plus kCreditTagBit
// (transport.h), so they never match its data, in whatever order the two cross.

class Comm {
 public:
  Comm(Transport& transport, std::chrono::milliseconds timeout, size_t segmentBytes)
      : transport_(transport), timeout_(timeout), segmentBytes_(segmentBytes) {
    refreshTopology();
  }

  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }
  size_t segmentBytes() const { return segmentBytes_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // When the current collective's waits time out (begin() sets it).
  Clock::time_point deadline() const { return deadline_; }
  Transport& transport() { return transport_; }

  // Starts one collective: a fresh tag, a deadline of now + timeout, and the
  // "pycomm <op> (<algorithm>)" prefix errors carry.
  void begin(const std::string& op, const std::string& algorithm = "");
  // As above with a per-op timeout (torch's per-call options).
  void begin(const std::string& op, std::chrono::milliseconds timeout);
  // Starts the collective `call` describes (its op and timeout).
  void begin(const CallDescriptor& call) { begin(call.op, call.timeout); }
  void setAlgorithm(const std::string& algorithm) { algorithm_ = algorithm; }
  // Puts `hash` (of the call: collective, dtype, reduce op, root) into the current
  // collective's tag (transport.h, kCallTagMask): a peer in another call at this
  // collective then fails the receive that meets its message. Ranks must agree on
  // it exactly when their calls agree.
  void setCall(uint64_t hash) {
    tag_ = (tag_ & ~kCallTagMask) | ((hash << kCallTagShift) & kCallTagMask);
  }
  // The cost model `auto` uses on this group (common/cost_model.h).
  const CostModel& costModel() const { return costModel_; }
  void setCostModel(const CostModel& model) {
    costModel_ = model;
    refreshTopology();
  }
  // The group's shape (ranks, hosts, one host, cost model), computed once from the
  // setters above rather than on every call.
  const Topology& topology() const { return topology_; }
  // Starts a collective that is part of `outer`'s (a sub-group's share of it):
  // same op, tag, timeout and deadline.
  void beginWithin(const Comm& outer, const std::string& algorithm);
  const std::string& opName() const { return op_; }
  // The algorithm the current collective runs ("" before it chose one).
  const std::string& algorithmName() const { return algorithm_; }
  // "pycomm <op> (<algorithm>)" (errorPrefix, common/call.h): runtime errors' prefix.
  std::string prefix() const { return errorPrefix(op_, algorithm_); }
  // Throws an Error of `kind`: prefix() + ": " + the arguments, which are also
  // its detail() (what an aborting rank tells its peers, without the prefix).
  // A runtime failure (any kind but kUsage) first makes the transport and the
  // arena let go of every buffer (letGo()), so the frames the throw unwinds may
  // free what their receives were posted into.
  template <typename... Args>
  [[noreturn]] void fail(ErrorKind kind, Args&&... args) const {
    const std::string detail = strCat(std::forward<Args>(args)...);
    if (kind != ErrorKind::kUsage) letGo(detail);
    throw Error(kind, prefix(), detail);
  }
  // Aborts the transport and the arena with `reason` (idempotent; the first
  // reason is the one peers are told). After it no request of this group is
  // pending and the transport's I/O thread writes into nothing: the rule that
  // keeps a failed collective memory-safe is that it leaves early only by a
  // throw, and every runtime throw passes here first. A runtime failure ends
  // the group anyway (the backend refuses later calls).
  void letGo(const std::string& reason) const;

  RequestPtr send(int peer, const void* data, size_t bytes) {
    return transport_.isend(peer, tag_, data, bytes);
  }
  RequestPtr recv(int peer, void* data, size_t bytes) {
    return transport_.irecv(peer, tag_, data, bytes);
  }
  // A credit: a 0-byte message telling `peer` that receives it may now fill
  // are posted (flow control: what the sender holds back is not buffered as
  // unexpected at a receiver that is behind). Matched in order among credits.
  RequestPtr sendCredit(int peer) { return transport_.isend(peer, tag_ | kCreditTagBit, &creditByte_, 0); }
  RequestPtr recvCredit(int peer) { return transport_.irecv(peer, tag_ | kCreditTagBit, &creditByte_, 0); }
  // Waits before the deadline; throws a timeout (naming the peer) or the
  // request's failure, prefixed with the op.
  void wait(const RequestPtr& request);
  void waitAll(std::vector<RequestPtr>& requests);

  // The node-local shared-memory arena, when the group has one (ranks that
  // share a host); shm-native algorithms use it, the others ignore it.
  ShmArena* arena() const { return arena_; }
  void setArena(ShmArena* arena) {
    arena_ = arena;
    refreshTopology();
  }
  // The lowest rank on each host, ascending (empty when unknown). With the
  // arena it gives the hierarchical all-reduce its two levels.
  const std::vector<int>& hostLeaders() const { return hostLeaders_; }
  void setHostLeaders(std::vector<int> leaders) {
    hostLeaders_ = std::move(leaders);
    refreshTopology();
  }
  // The host leaders as a group of their own (a SubTransport view of this
  // transport), for a rank among them; kept across calls, so its scratch
  // buffers persist and outlive any receive still posted into them.
  Comm& leaderComm();
  // Waits until local rank `peer` of the arena has published `phase` >= value,
  // before the deadline; failures and timeouts throw like wait(). For kPosted
  // it then compares the Call the peer posted step value - 1 with (this rank
  // posts before it waits) with this rank's: a peer in a different call (other
  // tensor size, dtype, op, root or collective) fails the collective here, on
  // every rank that reads the step.
  void waitArena(int peer, ShmArena::Phase phase, uint64_t value);
  // The same for every other local rank.
  void waitArenaAll(ShmArena::Phase phase, uint64_t value);

  // Scratch memory that outlives one collective (not zeroed): slot `slot` holds
  // at least `bytes` bytes until the next call for the same slot. Reusing it
  // spares every large collective an allocation and its page faults.
  char* scratch(int slot, size_t bytes);

 private:
  void refreshTopology();

  Transport& transport_;
  std::chrono::milliseconds timeout_;
  const size_t segmentBytes_;
  uint64_t sequence_ = 0;
  uint64_t tag_ = kCollectiveTagBit;
  Clock::time_point start_;
  Clock::time_point deadline_;
  std::string op_;
  std::string algorithm_;
  CostModel costModel_;
  Topology topology_;
  ShmArena* arena_ = nullptr;
  std::vector<int> hostLeaders_;
  std::unique_ptr<Transport> leaderView_;
  std::unique_ptr<Comm> leaderComm_;
  std::vector<std::unique_ptr<char[]>> scratch_;
  std::vector<size_t> scratchBytes_;
  char creditByte_ = 0;  // where 0-byte credits point; nothing is ever written to it
};

// What an arena collective posts with each step (ShmArena::Call): the collective
// (kAllreduce..kBarrier), the bytes every rank must agree on, and where they matter
// the dtype, reduce op and root (backend/call_check.h: why this check is per step).
ShmArena::Call arenaCall(Collective op, uint64_t bytes, int root = -1);
ShmArena::Call arenaCall(Collective op, uint64_t bytes, DataType dtype, ReduceOp reduce);

// Splits `count` elements into `parts` near-equal chunks; returns the n+1 offsets.
std::vector<size_t> balancedOffsets(size_t count, int parts);

// Number of pipeline segments for `count` elements of `elementBytes` each.
inline size_t segmentCount(size_t count, size_t segmentElems) {
  return (count + segmentElems - 1) / segmentElems;
}

}  // namespace pycomm
