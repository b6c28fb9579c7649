#include "algorithms/plan.h"

namespace pycomm {

const char* const kArenaAlgorithm = "shm";

const char* planAlgorithm(Collective collective, size_t bytes, const Topology& topology,
                          const AllreduceAlgorithm* setting) {
  switch (collective) {
    case Collective::kAllreduce: return planAllreduce(setting, bytes, topology).name;
    case Collective::kAllreduceQuantized: return "quantized";
    case Collective::kAllreduceSparse: return "sparse";
    case Collective::kAllreduceCoo: return "coo";
    case Collective::kMonitoredBarrier: return "monitored";  // point to point, on one host too
    default: break;
  }
  if (topology.ranks > 1 && topology.oneHost) return kArenaAlgorithm;
  switch (collective) {
    case Collective::kBroadcast:
    case Collective::kReduce: return "tree";
    case Collective::kAllgather:
    case Collective::kReduceScatter: return "ring";
    case Collective::kGather:
    case Collective::kScatter: return "direct";
    case Collective::kAlltoall: return "pairwise";
    case Collective::kBarrier: return "dissemination";
    default: return "";
  }
}

}  // namespace pycomm
