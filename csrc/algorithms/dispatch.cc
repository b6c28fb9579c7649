// Entry points the backend calls for every collective but all-reduce (whose
// algorithms are a table, allreduce_registry.h): the shared-memory path when
// every rank of the group shares a host (the same test as the shm all-reduce's),
// else the algorithm over the transport. Each names the algorithm it runs, for
// error messages; reduce and reduce-scatter finish AVG here, as allreduce() does.
#include "algorithms/collectives.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

bool useShm(Comm& comm) {
  if (comm.size() > 1 && topologyOf(comm).oneHost) {
    comm.setAlgorithm("shm");
    return true;
  }
  return false;
}

}  // namespace

void broadcast(Comm& comm, void* buf, size_t bytes, int root) {
  if (useShm(comm)) return broadcastShm(comm, buf, bytes, root);
  comm.setAlgorithm("tree");
  broadcastTree(comm, buf, bytes, root);
}

void reduce(Comm& comm, void* acc, size_t count, DataType dtype, ReduceOp op, int root) {
  const ReduceOp reduceAs = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  if (useShm(comm)) {
    allreduceShm(comm, acc, count, dtype, reduceAs);
  } else {
    comm.setAlgorithm("tree");
    reduceTree(comm, acc, count, dtype, reduceAs, root);
  }
  if (op == ReduceOp::kAvg && comm.rank() == root) divideBy(acc, count, dtype, comm.size());
}

void allgather(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes) {
  if (useShm(comm)) return allgatherShm(comm, chunks, bytes);
  comm.setAlgorithm("ring");
  ringAllgather(comm, chunks, bytes);
}

void reduceScatter(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& counts,
                   DataType dtype, ReduceOp op) {
  const ReduceOp reduceAs = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  if (useShm(comm)) {
    reduceScatterShm(comm, chunks, counts, dtype, reduceAs);
  } else {
    comm.setAlgorithm("ring");
    ringReduceScatter(comm, chunks, counts, dtype, reduceAs);
  }
  if (op == ReduceOp::kAvg) divideBy(chunks[comm.rank()], counts[comm.rank()], dtype, comm.size());
}

void gather(Comm& comm, const void* input, size_t bytes, const std::vector<char*>& outputs, int root) {
  if (useShm(comm)) return gatherShm(comm, input, bytes, outputs, root);
  comm.setAlgorithm("direct");
  gatherDirect(comm, input, bytes, outputs, root);
}

void scatter(Comm& comm, const std::vector<const char*>& inputs, void* output, size_t bytes, int root) {
  if (useShm(comm)) return scatterShm(comm, inputs, output, bytes, root);
  comm.setAlgorithm("direct");
  scatterDirect(comm, inputs, output, bytes, root);
}

void alltoall(Comm& comm, const std::vector<const char*>& sends, const std::vector<size_t>& sendBytes,
              const std::vector<char*>& recvs, const std::vector<size_t>& recvBytes) {
  if (useShm(comm)) return alltoallShm(comm, sends, sendBytes, recvs, recvBytes);
  comm.setAlgorithm("pairwise");
  alltoallPairwise(comm, sends, sendBytes, recvs, recvBytes);
}

void barrier(Comm& comm) {
  if (useShm(comm)) return barrierShm(comm);
  comm.setAlgorithm("dissemination");
  barrierDissemination(comm);
}

}  // namespace pycomm
