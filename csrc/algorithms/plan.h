// Which algorithm runs a collective: the one decision, read by dispatch.cc and
// allreduce() (allreduce_registry.h) when the collective runs, and by the backend
// when the call is made (its profiler event names the algorithm before it runs). It
// reads only the group's fixed topology (Comm::topology()), the all-reduce setting
// and the bytes, so the two readers agree.
#pragma once

#include <cstddef>

#include "algorithms/allreduce_registry.h"
#include "algorithms/topology.h"
#include "common/call.h"

namespace pycomm {

// The name the shared-memory path runs under ("shm"); planAlgorithm returns this
// pointer for it.
extern const char* const kArenaAlgorithm;

// The algorithm that runs `collective` of `bytes` per rank on a group of shape
// `topology`: for all-reduce planAllreduce's (the setting, or auto's choice); for the
// other collectives the arena when every rank shares one host, else the collective's
// algorithm over the transport (tree, ring, direct, pairwise, dissemination); the
// compressed, sparse and monitored collectives have one algorithm each.
const char* planAlgorithm(Collective collective, size_t bytes, const Topology& topology,
                          const AllreduceAlgorithm* setting = nullptr);

}  // namespace pycomm
