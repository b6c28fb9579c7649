// Entry points the backend calls for every collective but all-reduce (whose
// algorithms are a table, allreduce_registry.h): each runs what planAlgorithm
// (plan.h) names, the shared-memory path or the algorithm over the transport, and
// names it in the Comm for error messages; reduce and reduce-scatter finish AVG
// here, as allreduce() does.
#include "algorithms/collectives.h"
#include "algorithms/plan.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

// Plans `collective` on comm's group, names the algorithm in comm, and says whether
// it is the shared-memory path (the other choice of each collective is one algorithm).
bool useShm(Comm& comm, Collective collective) {
  const char* algorithm = planAlgorithm(collective, 0, comm.topology());
  comm.setAlgorithm(algorithm);
  return algorithm == kArenaAlgorithm;
}

}  // namespace

void broadcast(Comm& comm, void* buf, size_t bytes, int root) {
  if (useShm(comm, Collective::kBroadcast)) return broadcastShm(comm, buf, bytes, root);
  broadcastTree(comm, buf, bytes, root);
}

void reduce(Comm& comm, void* acc, size_t count, DataType dtype, ReduceOp op, int root) {
  const ReduceOp reduceAs = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  if (useShm(comm, Collective::kReduce)) {
    allreduceShm(comm, acc, count, dtype, reduceAs);
  } else {
    reduceTree(comm, acc, count, dtype, reduceAs, root);
  }
  if (op == ReduceOp::kAvg && comm.rank() == root) divideBy(acc, count, dtype, comm.size());
}

void allgather(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes) {
  if (useShm(comm, Collective::kAllgather)) return allgatherShm(comm, chunks, bytes);
  ringAllgather(comm, chunks, bytes);
}

void reduceScatter(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& counts,
                   DataType dtype, ReduceOp op) {
  const ReduceOp reduceAs = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  if (useShm(comm, Collective::kReduceScatter)) {
    reduceScatterShm(comm, chunks, counts, dtype, reduceAs);
  } else {
    ringReduceScatter(comm, chunks, counts, dtype, reduceAs);
  }
  if (op == ReduceOp::kAvg) divideBy(chunks[comm.rank()], counts[comm.rank()], dtype, comm.size());
}

void gather(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs, int root) {
  if (useShm(comm, Collective::kGather)) return gatherShm(comm, input, bytes, outputs, root);
  gatherDirect(comm, input, bytes, outputs, root);
}

void scatter(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes, int root) {
  if (useShm(comm, Collective::kScatter)) return scatterShm(comm, inputs, output, bytes, root);
  scatterDirect(comm, inputs, output, bytes, root);
}

void alltoall(Comm& comm, const std::vector<const char*>& sends, const std::vector<size_t>& sendBytes,
              const std::vector<char*>& recvs, const std::vector<size_t>& recvBytes) {
  if (useShm(comm, Collective::kAlltoall)) return alltoallShm(comm, sends, sendBytes, recvs, recvBytes);
  alltoallPairwise(comm, sends, sendBytes, recvs, recvBytes);
}

void barrier(Comm& comm) {
  if (useShm(comm, Collective::kBarrier)) return barrierShm(comm);
  barrierDissemination(comm);
}

}  // namespace pycomm
