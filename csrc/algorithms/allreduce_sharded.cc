// Sharded all-reduce: rank i owns shard i. Reduce-scatter brings every shard's
// contributions to its owner, then an all-gather spreads the reduced shards.
// Power-of-two groups use recursive halving then recursive doubling
// (Rabenseifner): log2(n) exchanges each way with a partner r xor d. Other
// sizes exchange directly with every owner (n-1 messages in flight per phase).
#include <algorithm>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

// Sends `sendCount` elements at `sendPtr` to `peer` while receiving `keepCount`
// elements from it into `scratch` and reducing them into `keepPtr`, segment by
// segment as they land.
void exchangeReduce(Comm& comm, int peer, const char* sendPtr, size_t sendCount, char* keepPtr,
                    size_t keepCount, char* scratch, DataType dtype, ReduceOp op) {
  const size_t elementBytes = elementSize(dtype);
  const size_t segElems = std::max<size_t>(1, comm.segmentBytes() / elementBytes);
  const size_t segBytes = segElems * elementBytes;
  std::vector<RequestPtr> recvs;
  std::vector<RequestPtr> sends;
  for (size_t j = 0; j < segmentCount(keepCount, segElems); ++j)
    recvs.push_back(comm.recv(peer, scratch + j * segBytes,
                              std::min(segElems, keepCount - j * segElems) * elementBytes));
  for (size_t j = 0; j < segmentCount(sendCount, segElems); ++j)
    sends.push_back(comm.send(peer, sendPtr + j * segBytes,
                              std::min(segElems, sendCount - j * segElems) * elementBytes));
  for (size_t j = 0; j < recvs.size(); ++j) {
    comm.wait(recvs[j]);
    reduceInto(keepPtr + j * segBytes, scratch + j * segBytes,
               std::min(segElems, keepCount - j * segElems), dtype, op);
  }
  comm.waitAll(sends);
}

void halvingDoubling(Comm& comm, char* data, const std::vector<size_t>& offsets, DataType dtype,
                     ReduceOp op) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t elementBytes = elementSize(dtype);
  auto at = [&](int chunk) { return data + offsets[chunk] * elementBytes; };
  auto elems = [&](int lo, int hi) { return offsets[hi] - offsets[lo]; };
  // The first halving step keeps the largest range (balanced chunks, lower half first).
  char* scratch = comm.scratch(0, elems(0, n / 2) * elementBytes);

  // Recursive halving: keep the half of the current range that holds chunk r.
  int lo = 0;
  int hi = n;
  for (int d = n / 2; d >= 1; d /= 2) {
    const int partner = r ^ d;
    const int mid = lo + d;
    const bool lower = (r & d) == 0;
    const int keepLo = lower ? lo : mid, keepHi = lower ? mid : hi;
    const int giveLo = lower ? mid : lo, giveHi = lower ? hi : mid;
    exchangeReduce(comm, partner, at(giveLo), elems(giveLo, giveHi), at(keepLo),
                   elems(keepLo, keepHi), scratch, dtype, op);
    lo = keepLo;
    hi = keepHi;
  }
  // Recursive doubling: swap the reduced blocks with partners at growing distance.
  for (int d = 1; d < n; d *= 2) {
    const int partner = r ^ d;
    const int myLo = r & ~(d - 1);
    const int theirLo = partner & ~(d - 1);
    std::vector<RequestPtr> requests;
    requests.push_back(comm.recv(partner, at(theirLo), elems(theirLo, theirLo + d) * elementBytes));
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
  for (int k = 1; k < n; ++k) {
    const int peer = (r + k) % n;
    char* slot = scratch + static_cast<size_t>(k - 1) * mine * elementBytes;
    for (size_t j = 0; j < segments; ++j)
      recvs[k].push_back(comm.recv(peer, slot + j * segBytes,
                                   std::min(segElems, mine - j * segElems) * elementBytes));
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
  // All-gather: my reduced shard to everyone, theirs straight into place.
  std::vector<RequestPtr> requests;
  for (int k = 1; k < n; ++k) {
    const int peer = (r + k) % n;
    requests.push_back(comm.recv(peer, data + offsets[peer] * elementBytes,
                                 (offsets[peer + 1] - offsets[peer]) * elementBytes));
  }
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
