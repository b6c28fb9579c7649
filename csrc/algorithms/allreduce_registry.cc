// The all-reduce table, its cost model and `auto`.
//
// Cost model (alpha-beta-gamma, the constants in common/cost_model.h): a message
// costs alpha, a byte costs beta on the link and cpuBeta of CPU at the ranks that
// send and receive it (each about half), reducing costs gamma per byte of CPU. The
// link and the CPU work at once (segments are pipelined), so a phase takes the larger
// of the two; with o ranks per core (Topology::oversubscription > 1) the ranks' CPU
// work adds up and takes o times one rank's share. For n ranks, S bytes per rank,
// P = (n-1)/n S, k = ceil(log2 n), cpu(x) = max(1, o) x:
//   ring:    2(n-1) alpha + max(2P beta, cpu(2P cpuBeta + P gamma))
//   sharded: 2k alpha + the same byte terms   (power-of-two n: halving/doubling)
//            2 alpha + (n-1) delta + the same byte terms   (other n: n-1 messages in flight)
//            L > 1 ranks on each of H hosts: the link term is 2 L S (H-1)/H beta (all
//            L ranks of a host exchange across hosts at once; the ring's layout puts one
//            edge per host on the link); halving/doubling's link term is charged 5% more
//            where the model tells the link from the CPU (cpuBeta > 0; kShardedLinkShare)
//   tree:    2k alpha + max(reduce + broadcast, o (n-1)/n S (4 w + gamma)),
//            reduce = max(k S beta, k S (w + gamma)) (the root takes k children's S, each
//            over its own link when only egress is limited: S beta), broadcast =
//            max(k S beta, k S w) (the root sends S to k children), w = cpuBetaOneWay (a
//            one-way transfer's time per byte; cpuBeta/2 where not measured); the two run
//            one after the other (tree.cc), each pipelined by segment; with L ranks per
//            host only the k - log2 L children off rank 0's host load its link;
//            each phase starts on idle links, so a link with a burst (linkBurst, a
//            token bucket's) sends its first linkBurst bytes of the phase uncharged;
//            oversubscribed, every edge's two transfers keep both ends busy (2 w each)
//   shm:     2 shmAlpha + cpu(2P shmBeta + P gamma)   (one host: through the arena)
//   hierarchical: shm inside each host (L ranks), the cheapest network algorithm
//            among the H host leaders, then a broadcast inside each host
//            (shmAlpha + S shmBeta)
// Where the shared-memory family fits, `auto` takes it (preferredWhereFits: measured
// faster than the TCP algorithms at every size here, and the model does not capture
// what makes it so, such as per-host NIC sharing); the model ranks the network
// algorithms, also among the host leaders inside hierarchical, and its figures for
// the shared-memory family serve the planner. python -m pycomm.plan measures a
// host's constants and prints what they predict.
#include "algorithms/allreduce_registry.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "algorithms/collectives.h"
#include "common/logging.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();
// Two ranks: ring and tree both take two messages, and the model's byte terms
// would always favour the ring; measured, the tree's single round trip wins up
// to 4 KiB. The ring's second phase is charged that many bytes.
constexpr double kTwoRankRingPhaseBytes = 4097;

double log2Steps(int n) { return std::ceil(std::log2(static_cast<double>(n))); }
double bytesOf(size_t bytes) { return static_cast<double>(bytes); }
// CPU-bound seconds scaled by the ranks per core.
double cpu(double seconds, const Topology& t) { return std::max(1.0, t.oversubscription) * seconds; }
// What a reduce-scatter plus all-gather moves and reduces per rank: 2P bytes each
// way on every rank's link, and their CPU.
double shareTerms(size_t bytes, const Topology& t) {
  const CostModel& m = t.cost;
  const double part = static_cast<double>(t.ranks - 1) / t.ranks * bytesOf(bytes);
  return std::max(2.0 * part * m.beta, cpu(2.0 * part * m.cpuBeta + part * m.gamma, t));
}

bool always(const Topology&) { return true; }

struct Choice {
  const AllreduceAlgorithm* entry;
  double cost;
};
Choice cheapest(size_t bytes, const Topology& topology);  // below the table

double ringCost(size_t bytes, const Topology& t) {
  const CostModel& m = t.cost;
  const int n = t.ranks;
  if (n <= 2)
    return 2.0 * m.alpha + std::max((bytesOf(bytes) + kTwoRankRingPhaseBytes) * m.beta,
                                    cpu(bytesOf(bytes) * m.cpuBeta + 0.5 * bytesOf(bytes) * m.gamma, t));
  return 2.0 * (n - 1) * m.alpha + shareTerms(bytes, t);
}

// Ranks per host when the group spans several hosts with several ranks each (ranks laid
// out host by host), else 1: the ranks of a host then share its link.
int ranksPerHost(const Topology& t) { return t.hosts > 1 && t.hosts < t.ranks ? (t.ranks + t.hosts - 1) / t.hosts : 1; }

// Halving/doubling moves the ring's bytes, but where the link is the limit it measured
// slower than the ring: 4-6% at 4 and 16 MiB on 4 hosts at 1 Gbit/s with a core per
// rank (benchmarks/results/h200_hosts4_1gbit.txt), from 1% faster to 24% slower at
// 1-64 MiB on 4 and 8 hosts sharing 2 cores (plan_validation_burst.txt). Each step waits for its partner's last
// segment before the next step's first is sent, where the ring's segments keep its link
// busy across steps (the likely cause; not measured apart). Charged as this share of
// sharded's link term, so a link-bound sharded loses to the ring it only beat by
// 2 (n - 1 - log2 n) alpha, while a CPU-bound one (no rate, or the CPU term larger) keeps
// its fewer steps. Only where the model tells the link from the CPU (cpuBeta > 0, a
// calibrated model): the built-in constants' beta was fitted to whole all-reduces over
// loopback and stands for both.
constexpr double kShardedLinkShare = 0.05;

double shardedCost(size_t bytes, const Topology& t) {
  const CostModel& m = t.cost;
  const int n = t.ranks;
  if (n <= 2) return kNever;  // on two ranks: the ring without its pipeline
  const bool powerOfTwo = (n & (n - 1)) == 0;
  const double messages = powerOfTwo ? 2.0 * log2Steps(n) * m.alpha : 2.0 * m.alpha + (n - 1) * m.delta;
  const double linkFactor = powerOfTwo && m.cpuBeta > 0.0 ? 1.0 + kShardedLinkShare : 1.0;
  const double part = static_cast<double>(n - 1) / n * bytesOf(bytes);
  const double cpuTerm = cpu(2.0 * part * m.cpuBeta + part * m.gamma, t);
  // L ranks per host: the exchanges between hosts (halving's first steps, or every
  // owner off the host) put all L ranks on the host's link at once, 2 L S (H-1)/H bytes
  // each way where the ring's one edge per host carries 2P.
  const int local = ranksPerHost(t);
  double link = 2.0 * part * m.beta;
  if (local > 1) {
    const double hosts = static_cast<double>(t.hosts);
    link = std::max(link, 2.0 * local * (hosts - 1.0) / hosts * bytesOf(bytes) * m.beta);
  }
  return messages + std::max(link * linkFactor, cpuTerm);
}

// tree.cc: a binomial reduce to rank 0, then a binomial broadcast from it. Rank 0 has
// k children: it takes S from each (reducing each into its buffer) and sends S to each.
double treeCost(size_t bytes, const Topology& t) {
  const CostModel& m = t.cost;
  const int n = std::max(t.ranks, 2);
  const double k = log2Steps(n);
  const double s = bytesOf(bytes);
  // Rank 0's children off its host (ranks laid out host by host, L per host: the
  // children at distance L and beyond) are the ones its link carries.
  const double remote = std::max(1.0, k - std::floor(std::log2(static_cast<double>(ranksPerHost(t)))));
  // A one-way transfer's time per byte: measured (the 2-rank tree, pycomm/plan.py), or
  // the sending or receiving half of the two-way exchange cpuBeta stands for.
  const double oneWay = m.cpuBetaOneWay > 0.0 ? m.cpuBetaOneWay : 0.5 * m.cpuBeta;
  // Each phase starts on idle links: the first linkBurst bytes of each sender's go at
  // once (a token bucket's burst; 0 on a real NIC). Egress-limited, every child of the
  // reduce sends on its own link; the broadcast's children all on rank 0's.
  const double burst = m.linkBurst;
  const double reduceLink =
      t.ingressLimited ? remote * s * m.beta : std::max(0.0, s - burst) * m.beta;
  const double reduce = std::max(reduceLink, k * s * (oneWay + m.gamma));
  const double broadcast = std::max(std::max(0.0, remote * s - burst) * m.beta, k * s * oneWay);
  // Oversubscribed, every edge's two transfers (each keeping both ends busy) and every
  // reduction share the cores.
  const double shared = t.oversubscription * (n - 1) / n * s * (4.0 * oneWay + m.gamma);
  return 2.0 * k * m.alpha + std::max(reduce + broadcast, shared);
}

bool shmFits(const Topology& t) { return t.oneHost; }
double shmCostOf(size_t bytes, int n, const Topology& t) {
  const CostModel& m = t.cost;
  const double part = static_cast<double>(n - 1) / n * bytesOf(bytes);
  return 2.0 * m.shmAlpha + cpu(2.0 * part * m.shmBeta + part * m.gamma, t);
}
double shmCost(size_t bytes, const Topology& t) {
  return t.ranks > 1 ? shmCostOf(bytes, t.ranks, t) : kNever;
}

bool hierarchicalFits(const Topology& t) { return t.hosts > 1 && t.hosts < t.ranks; }
double hierarchicalCost(size_t bytes, const Topology& t) {
  const CostModel& m = t.cost;
  const int local = (t.ranks + t.hosts - 1) / t.hosts;  // the most ranks on one host
  Topology leaders;
  leaders.ranks = leaders.hosts = t.hosts;
  leaders.cost = m;
  leaders.oversubscription = t.oversubscription;
  leaders.ingressLimited = t.ingressLimited;
  const double inside = local > 1 ? shmCostOf(bytes, local, t) + m.shmAlpha + bytesOf(bytes) * m.shmBeta : 0.0;
  return inside + cheapest(bytes, leaders).cost;
}

std::string joinedNames() {
  std::string text;
  const auto names = allreduceAlgorithmNames();
  for (size_t i = 0; i < names.size(); ++i)
    text += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return text;
}

}  // namespace

const std::vector<AllreduceAlgorithm>& allreduceAlgorithms() {
  static const std::vector<AllreduceAlgorithm> table = {
      {"ring", always, "", ringCost, allreduceRing},
      {"sharded", always, "", shardedCost, allreduceSharded},
      {"tree", always, "", treeCost, allreduceTree},
      {"shm", shmFits,
       "every rank of the group on one host (and PYCOMM_TRANSPORT other than tcp)", shmCost,
       allreduceShm, true},
      {"hierarchical", hierarchicalFits,
       "a group over several hosts, some with several ranks (and PYCOMM_TRANSPORT other than tcp)",
       hierarchicalCost, allreduceHierarchical, true},
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

namespace {

Choice cheapest(size_t bytes, const Topology& topology) {
  // The first preferred entry that fits at a finite cost, else the cheapest that fits; strict
  // comparison keeps the first of equal costs.
  for (const auto& entry : allreduceAlgorithms()) {
    if (!entry.preferredWhereFits || !entry.fits(topology)) continue;
    const double cost = entry.cost(bytes, topology);
    if (cost < kNever) return {&entry, cost};  // (shm on one rank: nothing to share)
  }
  Choice best{nullptr, kNever};
  for (const auto& entry : allreduceAlgorithms()) {
    if (!entry.fits(topology)) continue;
    const double cost = entry.cost(bytes, topology);
    if (best.entry == nullptr || cost < best.cost) best = {&entry, cost};
  }
  return best;  // ring always fits
}

}  // namespace

const AllreduceAlgorithm& chooseAllreduceAlgorithm(size_t bytes, const Topology& topology) {
  return *cheapest(bytes, topology).entry;
}

std::vector<std::pair<std::string, double>> allreduceCosts(size_t bytes, const Topology& topology) {
  std::vector<std::pair<std::string, double>> costs;
  for (const auto& entry : allreduceAlgorithms())
    if (entry.fits(topology)) costs.emplace_back(entry.name, entry.cost(bytes, topology));
  return costs;
}

const AllreduceAlgorithm& planAllreduce(const AllreduceAlgorithm* setting, size_t bytes,
                                        const Topology& topology) {
  return setting != nullptr ? *setting : chooseAllreduceAlgorithm(bytes, topology);
}

const AllreduceAlgorithm& allreduce(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op,
                                    const AllreduceAlgorithm* setting) {
  const size_t bytes = count * elementSize(dtype);
  const AllreduceAlgorithm& algorithm = planAllreduce(setting, bytes, comm.topology());
  if (debugEnabled())
    debugLog(strCat(comm.opName(), " ", bytes, " B on ", comm.size(), " ranks: ", algorithm.name));
  comm.setAlgorithm(algorithm.name);
  algorithm.run(comm, buf, count, dtype, op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  if (op == ReduceOp::kAvg && comm.size() > 1) divideBy(buf, count, dtype, comm.size());
  return algorithm;
}

}  // namespace pycomm
