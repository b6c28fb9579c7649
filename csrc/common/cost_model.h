// What moving and reducing bytes costs a group: the constants of the all-reduce
// cost model (algorithms/allreduce_registry.cc), the one model both `auto` and the
// planner (python -m pycomm.plan) use. The defaults are this project's 2-core VM
// over TCP loopback; `python -m pycomm.plan --calibrate` measures a host's and
// caches them, and pycomm/config.py passes the cache to every group (GroupConfig::cost).
#pragma once

namespace pycomm {

struct CostModel {
  // Between ranks over the network transport: seconds per message (latency plus
  // per-message overhead) and per byte.
  double alpha = 30e-6;
  double beta = 1.0 / 2.0e9;
  // Seconds per byte reduced (the CPU reduction kernel). 0 in the defaults, whose
  // beta was fitted to whole all-reduces and so already holds it.
  double gamma = 0.0;
  // Seconds per extra message in flight at once towards one rank (incast).
  double delta = 8e-6;
  // Among the ranks of one host, through the shared-memory arena: seconds per step
  // (a flag wait) and per byte moved.
  double shmAlpha = 2e-6;
  double shmBeta = 1.0 / 10.0e9;
  // Seconds of CPU per byte a rank sends and receives at once over TCP (its copies
  // through the socket layer: sending and receiving each take about half). Overlaps
  // the link's beta: a transfer takes the larger of the two. 0 in the defaults (the
  // link's beta stands for both).
  double cpuBeta = 0.0;
  // Seconds per byte of a one-way TCP transfer (one rank sends, its peer receives,
  // nothing comes back): what the tree's phases move. 0: half of cpuBeta, the sending or
  // receiving half of a two-way exchange. On this project's VM a one-way stream measured
  // 1.06-1.14x that (docs/planner.md), and its two ends together spend up to twice this.
  double cpuBetaOneWay = 0.0;
  // Bytes a link sends at once after it was idle: a token bucket's burst (tc tbf on
  // the planner's namespace hosts, pycomm/netns.py), beyond which beta applies. The
  // tree's phases each start on an idle link, so each phase's first linkBurst bytes
  // are not charged beta. 0 (a real NIC, and the default): every byte is.
  double linkBurst = 0.0;
};

}  // namespace pycomm
