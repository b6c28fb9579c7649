// Entry points the backend calls for every collective but all-reduce (which
// has its own in allreduce.cc): the shared-memory path when every rank of the
// group shares a host, else the algorithm over the transport. Each names the
// algorithm it runs, for error messages.
#include "algorithms/collectives.h"

namespace pycomm {
namespace {

bool useShm(Comm& comm) {
  if (comm.size() > 1 && onOneHost(comm)) {
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
  if (useShm(comm)) return allreduceShm(comm, acc, count, dtype, op);
  comm.setAlgorithm("tree");
  reduceTree(comm, acc, count, dtype, op, root);
}

void allgather(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& bytes) {
  if (useShm(comm)) return allgatherShm(comm, chunks, bytes);
  comm.setAlgorithm("ring");
  ringAllgather(comm, chunks, bytes);
}

void reduceScatter(Comm& comm, const std::vector<char*>& chunks, const std::vector<size_t>& counts,
                   DataType dtype, ReduceOp op) {
  if (useShm(comm)) return reduceScatterShm(comm, chunks, counts, dtype, op);
  comm.setAlgorithm("ring");
  ringReduceScatter(comm, chunks, counts, dtype, op);
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
