// Sharded all-reduce: rank i owns shard i. Reduce-scatter brings every shard's
// contributions to its owner, then an all-gather spreads the reduced shards.
// Power-of-two groups use recursive halving then recursive doubling
// (Rabenseifner): log2(n) exchanges each way with a partner r xor d. Other
// sizes exchange directly with every owner (n-1 messages in flight per phase).
#include <algorithm>
#include <utility>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

void halvingDoubling(Comm& comm, char* data, const std::vector<size_t>& offsets, DataType dtype,
                     ReduceOp op) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t elementBytes = elementSize(dtype);
  const size_t segElems = std::max<size_t>(1, comm.segmentBytes() / elementBytes);
  const size_t segBytes = segElems * elementBytes;
  auto at = [&](int chunk) { return data + offsets[chunk] * elementBytes; };
  auto elems = [&](int lo, int hi) { return offsets[hi] - offsets[lo]; };

  // Recursive halving, step by step (d = n/2 .. 1): exchange with partner r ^ d,
  // keep the half of the current range that holds chunk r, give the other.
  struct Step {
    int d, keepLo, keepHi, giveLo, giveHi;
    size_t scratchOffset;  // elements: each step receives into its own part of scratch
  };
  std::vector<Step> steps;
  size_t scratchElems = 0;
  for (int d = n / 2, lo = 0, hi = n; d >= 1; d /= 2) {
    const bool lower = (r & d) == 0;
    const int mid = lo + d;
    Step step{d, lower ? lo : mid, lower ? mid : hi, lower ? mid : lo, lower ? hi : mid, scratchElems};
    scratchElems += elems(step.keepLo, step.keepHi);
    steps.push_back(step);
    lo = step.keepLo;
    hi = step.keepHi;
  }
  char* scratch = comm.scratch(0, scratchElems * elementBytes);  // under S: S/2 + S/4 + ...

  // Every receive is posted before anything is sent. A partner that is ahead (it
  // started earlier, or finished its earlier steps sooner) sends its part of a
  // later step, or its reduced block of the doubling phase, as soon as it can;
  // posted, it lands in place instead of in the transport's unexpected-message
  // buffer (allocated, then copied out: a 64 MiB call on 2 ranks over loopback
  // took 79.5 ms that way, 57.9 ms posted, docs/planner.md "Open"). Per partner (each step has its own), the halving segments are
  // posted before the reduced block, the order it sends them (one tag per
  // collective: a peer's messages match receives in posting order). Safe: a
  // partner's reduced block [theirLo, theirLo + d) lies in what this rank gives
  // it at step d, and the partner sends the block only after it has received all
  // of that, so this rank's reductions into that range (earlier steps) and its
  // sends from it are done by then.
  std::vector<std::vector<RequestPtr>> halving(steps.size());
  std::vector<RequestPtr> gathered(n);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const int partner = r ^ step.d;
    const size_t keep = elems(step.keepLo, step.keepHi);
    char* slot = scratch + step.scratchOffset * elementBytes;
    for (size_t j = 0; j < segmentCount(keep, segElems); ++j)
      halving[i].push_back(comm.recv(partner, slot + j * segBytes,
                                     std::min(segElems, keep - j * segElems) * elementBytes));
    const int theirLo = partner & ~(step.d - 1);
    gathered[step.d] = comm.recv(partner, at(theirLo), elems(theirLo, theirLo + step.d) * elementBytes);
  }

  // Halving: send the given range segment by segment, reduce the kept one as the
  // partner's segments land.
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const int partner = r ^ step.d;
    const size_t give = elems(step.giveLo, step.giveHi);
    const size_t keep = elems(step.keepLo, step.keepHi);
    std::vector<RequestPtr> sends;
    for (size_t j = 0; j < segmentCount(give, segElems); ++j)
      sends.push_back(comm.send(partner, at(step.giveLo) + j * segBytes,
                                std::min(segElems, give - j * segElems) * elementBytes));
    const char* slot = scratch + step.scratchOffset * elementBytes;
    for (size_t j = 0; j < halving[i].size(); ++j) {
      comm.wait(halving[i][j]);
      reduceInto(at(step.keepLo) + j * segBytes, slot + j * segBytes, std::min(segElems, keep - j * segElems),
                 dtype, op);
    }
    comm.waitAll(sends);
  }
  // Recursive doubling: swap the reduced blocks with partners at growing distance.
  for (int d = 1; d < n; d *= 2) {
    const int partner = r ^ d;
    const int myLo = r & ~(d - 1);
    std::vector<RequestPtr> requests;
    requests.push_back(std::move(gathered[d]));
    requests.push_back(comm.send(partner, at(myLo), elems(myLo, myLo + d) * elementBytes));
    comm.waitAll(requests);
  }
}

void directExchange(Comm& comm, char* data, const std::vector<size_t>& offsets, DataType dtype,
                    ReduceOp op) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t elementBytes = elementSize(dtype);
  const size_t mine = offsets[r + 1] - offsets[r];
  char* myShard = data + offsets[r] * elementBytes;
  const size_t segElems = std::max<size_t>(1, comm.segmentBytes() / elementBytes);
  const size_t segBytes = segElems * elementBytes;
  const size_t segments = segmentCount(mine, segElems);

  // Reduce-scatter: every peer's copy of my shard lands in its own scratch slot.
  char* scratch = comm.scratch(0, static_cast<size_t>(n - 1) * mine * elementBytes);
  std::vector<std::vector<RequestPtr>> recvs(n);
  std::vector<RequestPtr> sends;
  // Each peer's reduced shard (the all-gather) is received in place, posted right
  // after that peer's reduce-scatter receives so it never arrives unexpected: the
  // peer sends it only after receiving every contribution to it, ours included,
  // so our sends from that range are done reading it (as in halvingDoubling).
  std::vector<RequestPtr> requests;
  for (int k = 1; k < n; ++k) {
    const int peer = (r + k) % n;
    char* slot = scratch + static_cast<size_t>(k - 1) * mine * elementBytes;
    for (size_t j = 0; j < segments; ++j)
      recvs[k].push_back(comm.recv(peer, slot + j * segBytes,
                                   std::min(segElems, mine - j * segElems) * elementBytes));
    requests.push_back(comm.recv(peer, data + offsets[peer] * elementBytes,
                                 (offsets[peer + 1] - offsets[peer]) * elementBytes));
  }
  for (int k = 1; k < n; ++k) {
    const int peer = (r + n - k) % n;  // staggered so owners are not all hit at once
    const size_t theirs = offsets[peer + 1] - offsets[peer];
    const char* shard = data + offsets[peer] * elementBytes;
    for (size_t j = 0; j < segmentCount(theirs, segElems); ++j)
      sends.push_back(comm.send(peer, shard + j * segBytes,
                                std::min(segElems, theirs - j * segElems) * elementBytes));
  }
  for (int k = 1; k < n; ++k) {
    const char* slot = scratch + static_cast<size_t>(k - 1) * mine * elementBytes;
    for (size_t j = 0; j < segments; ++j) {
      comm.wait(recvs[k][j]);
      reduceInto(myShard + j * segBytes, slot + j * segBytes, std::min(segElems, mine - j * segElems),
                 dtype, op);
    }
  }
  comm.waitAll(sends);
  // All-gather: my reduced shard to everyone, theirs straight into place (posted above).
  for (int k = 1; k < n; ++k)
    requests.push_back(comm.send((r + n - k) % n, myShard, mine * elementBytes));
  comm.waitAll(requests);
}

}  // namespace

void allreduceSharded(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  const int n = comm.size();
  if (n == 1) return;
  const std::vector<size_t> offsets = balancedOffsets(count, n);
  char* data = static_cast<char*>(buf);
  if ((n & (n - 1)) == 0) halvingDoubling(comm, data, offsets, dtype, op);
  else directExchange(comm, data, offsets, dtype, op);
}

}  // namespace pycomm
