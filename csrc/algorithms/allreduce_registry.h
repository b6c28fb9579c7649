// The all-reduce algorithms in one table (allreduce_registry.cc), as NCCL keeps
// its tuning in one place. Each entry says what it is called, whether it can run
// on a group of a given shape, what the alpha-beta cost model predicts for it,
// and the function that runs it. `auto` is the cheapest entry that fits;
// PYCOMM_ALGO and pycomm.set_algorithm name an entry; Python reads the names
// from here (pycomm._C.allreduce_algorithms()).
//
// Adding an algorithm: its file (allreduce_<name>.cc, declared in collectives.h)
// and one entry in the table. Nothing else lists algorithm names; plan.h decides
// which one a call runs.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "algorithms/comm.h"
#include "algorithms/topology.h"
#include "common/cost_model.h"
#include "common/dtype.h"
#include "common/reduce_op.h"

namespace pycomm {


struct AllreduceAlgorithm {
  const char* name;
  // Whether it can run on a group of this shape, and what it needs when it cannot.
  bool (*fits)(const Topology& topology);
  const char* needs;
  // Predicted seconds for an all-reduce of `bytes` per rank; infinity where
  // `auto` must never pick it.
  double (*cost)(size_t bytes, const Topology& topology);
  // In place, with SUM/PRODUCT/MIN/MAX/BAND/BOR/BXOR (allreduce() turns AVG into SUM).
  void (*run)(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
  // `auto` takes it wherever it fits, whatever the costs (the shared-memory family:
  // measured faster than the TCP algorithms at every size wherever it runs; its
  // modelled cost serves the planner).
  bool preferredWhereFits = false;
};

// The table, in tie-breaking order.
const std::vector<AllreduceAlgorithm>& allreduceAlgorithms();
// "auto" then every entry's name.
std::vector<std::string> allreduceAlgorithmNames();
// The entry called `name`, or nullptr for "auto" (and ""); a usage error listing
// the names otherwise.
const AllreduceAlgorithm* findAllreduceAlgorithm(const std::string& name);
// The name of a setting (nullptr: "auto").
inline const char* settingName(const AllreduceAlgorithm* setting) {
  return setting == nullptr ? "auto" : setting->name;
}
// A usage error naming what `algorithm` needs when it cannot run on `topology`.
void checkFits(const AllreduceAlgorithm& algorithm, const Topology& topology);
// What `auto` runs: the first preferred entry that fits, else the entry with the
// lowest cost among those that fit (the first one on ties), under topology.cost.
const AllreduceAlgorithm& chooseAllreduceAlgorithm(size_t bytes, const Topology& topology);
// Every entry that fits `topology`, with its predicted seconds for `bytes` (the
// planner's view of what `auto` compares), in table order.
std::vector<std::pair<std::string, double>> allreduceCosts(size_t bytes, const Topology& topology);
// What a setting runs for `bytes` on `topology`: the fixed entry, or auto's choice
// (nullptr). A fixed entry was checked to fit when it was set (checkFits: the
// process group's PYCOMM_ALGO and set_algorithm), since a group's topology is fixed.
const AllreduceAlgorithm& planAllreduce(const AllreduceAlgorithm* setting, size_t bytes,
                                        const Topology& topology);

// All-reduce in place with the algorithm planAllreduce names for it (nullptr: auto);
// finishes AVG (SUM, then one division). Returns the entry that ran.
const AllreduceAlgorithm& allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
                                    const AllreduceAlgorithm* setting);

}  // namespace pycomm
