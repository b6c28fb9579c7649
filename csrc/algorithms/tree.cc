// Binomial trees rooted at any rank: broadcast, reduce, and the tree all-reduce
// (reduce to rank 0, then broadcast). Ranks are renumbered relative to the root
// (v = r - root mod n); v's parent is v without its lowest set bit, its
// children are v + 2^k for 2^k below that bit. Data moves in segments so a
// node forwards segment j while segment j+1 is still arriving.
//
// The reduce is flow-controlled: a parent posts each child's receives a window
// of kReduceWindow segments ahead of what it has reduced, and each time it posts
// one beyond the first window it sends that child a 0-byte credit; a child sends
// segment j >= kReduceWindow only once credit j has arrived. Without credits a
// child sends as fast as it reduces, and a parent that falls behind (the root,
// reducing k children's segments) gets most of them before their receives: the
// TCP transport then buffers them (a 64 MiB call on 4 ranks over loopback
// buffered 100-111 MiB per call at the root). Messages of at most kReduceWindow
// segments need no credit, so the small ones the tree is chosen for cost the same.
#include <algorithm>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

struct TreeNode {
  int parent = -1;            // real rank, -1 at the root
  std::vector<int> children;  // real ranks, smallest subtree first
};

TreeNode binomialNode(int rank, int size, int root) {
  TreeNode node;
  const int v = (rank - root + size) % size;
  int mask = 1;
  while (mask < size) {
    if (v & mask) {
      node.parent = ((v - mask) + root) % size;
      break;
    }
    if (v + mask < size) node.children.push_back(((v + mask) + root) % size);
    mask <<= 1;
  }
  return node;
}

constexpr size_t kReduceWindow = 8;  // segments in flight per child (2 MiB at 256 KiB)

}  // namespace

void broadcastTree(Comm& comm, void* buf, size_t bytes, int root) {
  if (comm.size() == 1) return;
  const TreeNode node = binomialNode(comm.rank(), comm.size(), root);
  const size_t seg = std::max<size_t>(1, comm.segmentBytes());
  const size_t segments = segmentCount(bytes, seg);
  char* data = static_cast<char*>(buf);
  std::vector<RequestPtr> recvs;
  if (node.parent >= 0) {
    for (size_t j = 0; j < segments; ++j)
      recvs.push_back(comm.recv(node.parent, data + j * seg, std::min(seg, bytes - j * seg)));
    if (segments == 0) recvs.push_back(comm.recv(node.parent, data, 0));
  }
  std::vector<RequestPtr> sends;
  const size_t rounds = std::max<size_t>(segments, 1);
  for (size_t j = 0; j < rounds; ++j) {
    if (node.parent >= 0) comm.wait(recvs[j]);
    const size_t length = segments == 0 ? 0 : std::min(seg, bytes - j * seg);
    // Largest subtree first: it has the longest way to go.
    for (auto it = node.children.rbegin(); it != node.children.rend(); ++it)
      sends.push_back(comm.send(*it, data + j * seg, length));
  }
  comm.waitAll(sends);
}

void reduceTree(Comm& comm, void* acc, size_t count, DataType dtype, ReduceOp op, int root) {
  if (comm.size() == 1) return;
  const TreeNode node = binomialNode(comm.rank(), comm.size(), root);
  const size_t elementBytes = elementSize(dtype);
  const size_t segElems = std::max<size_t>(1, comm.segmentBytes() / elementBytes);
  const size_t segBytes = segElems * elementBytes;
  const size_t segments = segmentCount(count, segElems);
  const size_t rounds = std::max<size_t>(segments, 1);  // an empty message still synchronises
  char* data = static_cast<char*>(acc);
  auto length = [&](size_t j) { return segments == 0 ? 0 : std::min(segElems, count - j * segElems); };

  const size_t children = node.children.size();
  char* scratch = comm.scratch(0, children * kReduceWindow * segBytes);
  std::vector<std::vector<RequestPtr>> recvs(children, std::vector<RequestPtr>(kReduceWindow));
  auto slot = [&](size_t child, size_t j) { return scratch + (child * kReduceWindow + j % kReduceWindow) * segBytes; };
  std::vector<RequestPtr> sends;  // segments to the parent and credits to the children
  auto post = [&](size_t child, size_t j) {
    recvs[child][j % kReduceWindow] = comm.recv(node.children[child], slot(child, j), length(j) * elementBytes);
    // Posted first: the segment this credit releases can only land in place.
    if (j >= kReduceWindow) sends.push_back(comm.sendCredit(node.children[child]));
  };
  for (size_t c = 0; c < children; ++c)
    for (size_t j = 0; j < std::min(rounds, kReduceWindow); ++j) post(c, j);
  std::vector<RequestPtr> credits;  // from the parent, for segments kReduceWindow and on
  if (node.parent >= 0)
    for (size_t j = kReduceWindow; j < rounds; ++j) credits.push_back(comm.recvCredit(node.parent));

  for (size_t j = 0; j < rounds; ++j) {
    for (size_t c = 0; c < children; ++c) {
      comm.wait(recvs[c][j % kReduceWindow]);
      reduceInto(data + j * segBytes, slot(c, j), length(j), dtype, op);
      if (j + kReduceWindow < rounds) post(c, j + kReduceWindow);
    }
    if (node.parent >= 0) {
      if (j >= kReduceWindow) comm.wait(credits[j - kReduceWindow]);
      sends.push_back(comm.send(node.parent, data + j * segBytes, length(j) * elementBytes));
    }
  }
  comm.waitAll(sends);
}

void allreduceTree(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  reduceTree(comm, buf, count, dtype, op, 0);
  broadcastTree(comm, buf, count * elementSize(dtype), 0);
}

}  // namespace pycomm
