// All-reduce entry point: resolves the algorithm and finishes AVG.
#include "algorithms/collectives.h"
#include "common/logging.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {

void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
               AllreduceAlgorithm algorithm) {
  if (algorithm == AllreduceAlgorithm::kAuto)
    algorithm = selectAllreduceAlgorithm(count * elementSize(dtype), comm.size(), onOneHost(comm));
  PYCOMM_CHECK_USAGE(algorithm != AllreduceAlgorithm::kShm || onOneHost(comm), comm.prefix(),
                     ": the shm algorithm needs every rank of the group on one host "
                     "(and PYCOMM_TRANSPORT other than tcp)");
  comm.setAlgorithm(allreduceAlgorithmName(algorithm));
  const ReduceOp reduceAs = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  switch (algorithm) {
    case AllreduceAlgorithm::kRing:
      allreduceRing(comm, buf, count, dtype, reduceAs);
      break;
    case AllreduceAlgorithm::kTree:
      allreduceTree(comm, buf, count, dtype, reduceAs);
      break;
    case AllreduceAlgorithm::kShm:
      allreduceShm(comm, buf, count, dtype, reduceAs);
      break;
    case AllreduceAlgorithm::kSharded:
    case AllreduceAlgorithm::kAuto:
      allreduceSharded(comm, buf, count, dtype, reduceAs);
      break;
  }
  if (op == ReduceOp::kAvg && comm.size() > 1) divideBy(buf, count, dtype, comm.size());
}

}  // namespace pycomm
