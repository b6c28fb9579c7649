// The all-reduce table, its cost model and `auto`.
//
// Cost model (alpha-beta): a message costs alpha (latency, the per-message
// overhead) plus bytes * beta. For n ranks and S bytes per rank:
//   ring:    2(n-1) alpha + 2(n-1)/n S beta
//   sharded: 2 log2(n) alpha + 2(n-1)/n S beta    (power-of-two n; halving/doubling)
//            2 alpha + (n-1) gamma + 2(n-1)/n S beta   (other n; n-1 messages in flight)
//   tree:    2 log2(n) alpha + 2 log2(n) S beta    (the root link carries every child)
// The constants are per-message and per-byte costs of the TCP transport on one
// host. The shared-memory family (shm on one host, hierarchical across hosts
// with shared ones) is preferred wherever it fits: its cost is 0, since the model
// does not yet rank it against the network algorithms.
#include "algorithms/allreduce_registry.h"

#include <cmath>
#include <limits>

#include "algorithms/collectives.h"
#include "common/logging.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {

namespace {

constexpr double kAlpha = 30e-6;       // seconds per message hop
constexpr double kGamma = 8e-6;        // extra seconds per concurrent message
constexpr double kBeta = 1.0 / 2.0e9;  // seconds per byte
constexpr double kNever = std::numeric_limits<double>::infinity();
// Two ranks: ring and tree both take two messages, and the model's byte terms
// would always favour the ring; measured, the tree's single round trip wins up
// to 4 KiB. The ring's second phase is charged that much.
constexpr double kTwoRankRingPhase = 4097 * kBeta;

double log2Steps(int n) { return std::ceil(std::log2(static_cast<double>(n))); }
double share(size_t bytes, int n) { return 2.0 * (n - 1) / n * static_cast<double>(bytes) * kBeta; }

bool always(const Topology&) { return true; }

double ringCost(size_t bytes, const Topology& t) {
  const int n = t.ranks;
  if (n <= 2) return 2.0 * kAlpha + static_cast<double>(bytes) * kBeta + kTwoRankRingPhase;
  return 2.0 * (n - 1) * kAlpha + share(bytes, n);
}

double shardedCost(size_t bytes, const Topology& t) {
  const int n = t.ranks;
  if (n <= 2) return kNever;  // on two ranks: the ring without its pipeline
  const bool powerOfTwo = (n & (n - 1)) == 0;
  return (powerOfTwo ? 2.0 * log2Steps(n) * kAlpha : 2.0 * kAlpha + (n - 1) * kGamma) + share(bytes, n);
}

double treeCost(size_t bytes, const Topology& t) {
  const int n = std::max(t.ranks, 2);
  const double steps = log2Steps(n);
  return 2.0 * steps * kAlpha + 2.0 * steps * static_cast<double>(bytes) * kBeta;
}

bool shmFits(const Topology& t) { return t.oneHost; }
double shmCost(size_t, const Topology& t) { return t.ranks > 1 ? 0.0 : kNever; }

bool hierarchicalFits(const Topology& t) { return t.hosts > 1 && t.hosts < t.ranks; }
double hierarchicalCost(size_t, const Topology&) { return 0.0; }

std::string joinedNames() {
  std::string text;
  const auto names = allreduceAlgorithmNames();
  for (size_t i = 0; i < names.size(); ++i)
    text += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return text;
}

}  // namespace

Topology topologyOf(const Comm& comm) {
  Topology t;
  t.ranks = comm.size();
  t.hosts = static_cast<int>(comm.hostLeaders().size());
  t.oneHost = comm.size() == 1 || (comm.arena() != nullptr && comm.arena()->localSize() == comm.size());
  return t;
}

const std::vector<AllreduceAlgorithm>& allreduceAlgorithms() {
  static const std::vector<AllreduceAlgorithm> table = {
      {"ring", always, "", ringCost, allreduceRing},
      {"sharded", always, "", shardedCost, allreduceSharded},
      {"tree", always, "", treeCost, allreduceTree},
      {"shm", shmFits,
       "every rank of the group on one host (and PYCOMM_TRANSPORT other than tcp)", shmCost,
       allreduceShm},
      {"hierarchical", hierarchicalFits,
       "a group over several hosts, some with several ranks (and PYCOMM_TRANSPORT other than tcp)",
       hierarchicalCost, allreduceHierarchical},
  };
  return table;
}

std::vector<std::string> allreduceAlgorithmNames() {
  std::vector<std::string> names{"auto"};
  for (const auto& entry : allreduceAlgorithms()) names.push_back(entry.name);
  return names;
}

const AllreduceAlgorithm* findAllreduceAlgorithm(const std::string& name) {
  if (name == "auto" || name.empty()) return nullptr;
  for (const auto& entry : allreduceAlgorithms())
    if (name == entry.name) return &entry;
  throwError(ErrorKind::kUsage, "pycomm: unknown all-reduce algorithm '", name, "' (expected ",
             joinedNames(), ")");
}

void checkFits(const AllreduceAlgorithm& algorithm, const Topology& topology) {
  PYCOMM_CHECK_USAGE(algorithm.fits(topology), "pycomm: the ", algorithm.name, " algorithm needs ",
                     algorithm.needs);
}

const AllreduceAlgorithm& chooseAllreduceAlgorithm(size_t bytes, const Topology& topology) {
  // The cheapest that fits; strict comparison keeps the first of equal costs.
  const AllreduceAlgorithm* best = nullptr;
  double bestCost = kNever;
  for (const auto& entry : allreduceAlgorithms()) {
    if (!entry.fits(topology)) continue;
    const double cost = entry.cost(bytes, topology);
    if (best == nullptr || cost < bestCost) best = &entry, bestCost = cost;
  }
  return *best;  // ring always fits
}

const AllreduceAlgorithm& resolveAllreduceAlgorithm(const AllreduceAlgorithm* setting, size_t bytes,
                                                    const Topology& topology) {
  if (setting == nullptr) return chooseAllreduceAlgorithm(bytes, topology);
  checkFits(*setting, topology);
  return *setting;
}

const AllreduceAlgorithm& allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
                                    const AllreduceAlgorithm* setting) {
  const size_t bytes = count * elementSize(dtype);
  const AllreduceAlgorithm& algorithm = resolveAllreduceAlgorithm(setting, bytes, topologyOf(comm));
  if (debugEnabled())
    debugLog(strCat(comm.opName(), " ", bytes, " B on ", comm.size(), " ranks: ", algorithm.name));
  comm.setAlgorithm(algorithm.name);
  algorithm.run(comm, buf, count, dtype, op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  if (op == ReduceOp::kAvg && comm.size() > 1) divideBy(buf, count, dtype, comm.size());
  return algorithm;
}

}  // namespace pycomm
