// All-reduce entry point: resolves the algorithm and finishes AVG.
#include "algorithms/collectives.h"
#include "common/logging.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {

void allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
               AllreduceAlgorithm algorithm) {
  if (algorithm == AllreduceAlgorithm::kAuto)
    algorithm = selectAllreduceAlgorithm(comm, count * elementSize(dtype));
  checkAlgorithmFits(comm, algorithm);
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
    case AllreduceAlgorithm::kHierarchical:
      allreduceHierarchical(comm, buf, count, dtype, reduceAs);
      break;
    case AllreduceAlgorithm::kSharded:
    case AllreduceAlgorithm::kAuto:
      allreduceSharded(comm, buf, count, dtype, reduceAs);
      break;
  }
  if (op == ReduceOp::kAvg && comm.size() > 1) divideBy(buf, count, dtype, comm.size());
}

}  // namespace pycomm
