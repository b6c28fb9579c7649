// The shape of a group and what its links cost: what every planning decision reads
// (algorithms/plan.h, the all-reduce table's fits and costs). A group's is computed
// once, when its Comm is set up (Comm::topology()); the planner's (pycomm.plan) are
// built from arguments.
#pragma once

#include "common/cost_model.h"

namespace pycomm {

// The shape of a group as the algorithms see it, and what its links cost.
struct Topology {
  int ranks = 1;
  // Hosts the group spans, one entry per host leader (0: unknown, e.g. with
  // PYCOMM_TRANSPORT=tcp, where every rank counts as a host of its own).
  int hosts = 0;
  // Every rank shares the node-local shared-memory arena (true for one rank).
  bool oneHost = false;
  // The constants of the cost model (the group's; the built-in defaults otherwise).
  CostModel cost;
  // Ranks per CPU core on the most loaded machine: above 1, the CPU-bound terms of
  // every rank add up and scale by it (e.g. 8 namespace "hosts" on 2 cores: 4).
  double oversubscription = 1.0;
  // Whether a host's link limits what it receives as well as what it sends (a real
  // NIC); false for tc tbf on each host's egress only (pycomm/netns.py).
  bool ingressLimited = true;
};

}  // namespace pycomm
