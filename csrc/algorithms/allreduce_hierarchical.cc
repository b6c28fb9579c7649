// Hierarchical all-reduce for groups over several hosts: (1) all-reduce among
// the ranks of each host through the shared-memory arena, (2) all-reduce among
// one leader per host (the lowest rank) over the transport with the algorithm
// the cost model picks for that many leaders, (3) broadcast from the leader to
// the other ranks of its host through the arena. Only one copy of the data per
// host crosses the network.
#include "algorithms/collectives.h"

namespace pycomm {

void allreduceHierarchical(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  const std::vector<int>& leaders = comm.hostLeaders();
  // (1) Inside the host (nothing to do for a rank alone on its host).
  comm.setAlgorithm("hierarchical/shm");
  allreduceShm(comm, buf, count, dtype, op);
  // (2) Among the leaders.
  const ShmArena* arena = comm.arena();
  const bool leader = arena == nullptr || arena->localRank() == 0;
  if (leader) {
    Comm& leaderComm = comm.leaderComm();
    // Among the leaders only the network algorithms fit (each leader is a host of its own).
    Topology leaderTopology;
    leaderTopology.ranks = leaderTopology.hosts = static_cast<int>(leaders.size());
    leaderTopology.cost = comm.costModel();
    const AllreduceAlgorithm& algorithm =
        chooseAllreduceAlgorithm(count * elementSize(dtype), leaderTopology);
    leaderComm.beginWithin(comm, std::string("hierarchical/") + algorithm.name);
    algorithm.run(leaderComm, buf, count, dtype, op);
  }
  // (3) Back inside the host.
  comm.setAlgorithm("hierarchical/shm");
  if (arena != nullptr) broadcastShm(comm, buf, count * elementSize(dtype), 0);
  comm.setAlgorithm("hierarchical");
}

}  // namespace pycomm
