// Algorithm names and automatic selection.
//
// Selection uses an alpha-beta cost model: a message costs alpha (latency, the
// per-message overhead) plus bytes * beta. For n ranks and S bytes:
//   ring:    2(n-1) alpha + 2(n-1)/n S beta
//   sharded: 2 log2(n) alpha + 2(n-1)/n S beta    (power-of-two n; halving/doubling)
//            2 alpha + (n-1) gamma + 2(n-1)/n S beta   (other n; n-1 messages in flight)
//   tree:    2 log2(n) alpha + 2 log2(n) S beta    (the root link carries every child)
// The constants are per-message and per-byte costs of the TCP transport on one
// host; PYCOMM_ALGO or pycomm.set_algorithm() override the choice. Groups whose
// ranks all share a host use the shared-memory arena (allreduce_shm.cc) instead.
#include <cmath>

#include "algorithms/collectives.h"
#include "common/logging.h"

namespace pycomm {

namespace {
constexpr double kAlpha = 30e-6;        // seconds per message hop
constexpr double kGamma = 8e-6;         // extra seconds per concurrent message
constexpr double kBeta = 1.0 / 2.0e9;   // seconds per byte
}  // namespace

const char* allreduceAlgorithmName(AllreduceAlgorithm algorithm) {
  switch (algorithm) {
    case AllreduceAlgorithm::kAuto: return "auto";
    case AllreduceAlgorithm::kRing: return "ring";
    case AllreduceAlgorithm::kTree: return "tree";
    case AllreduceAlgorithm::kSharded: return "sharded";
    case AllreduceAlgorithm::kShm: return "shm";
    case AllreduceAlgorithm::kHierarchical: return "hierarchical";
  }
  return "unknown";
}

AllreduceAlgorithm parseAllreduceAlgorithm(const std::string& name) {
  if (name == "auto" || name.empty()) return AllreduceAlgorithm::kAuto;
  if (name == "ring") return AllreduceAlgorithm::kRing;
  if (name == "tree") return AllreduceAlgorithm::kTree;
  if (name == "sharded") return AllreduceAlgorithm::kSharded;
  if (name == "shm") return AllreduceAlgorithm::kShm;
  if (name == "hierarchical") return AllreduceAlgorithm::kHierarchical;
  throwError(ErrorKind::kUsage, "pycomm: unknown all-reduce algorithm '", name,
             "' (expected auto, ring, tree, sharded, shm or hierarchical)");
}

void checkAlgorithmFits(const Comm& comm, AllreduceAlgorithm algorithm) {
  PYCOMM_CHECK_USAGE(algorithm != AllreduceAlgorithm::kShm || onOneHost(comm),
                     "pycomm: the shm algorithm needs every rank of the group on one host "
                     "(and PYCOMM_TRANSPORT other than tcp)");
  PYCOMM_CHECK_USAGE(algorithm != AllreduceAlgorithm::kHierarchical || hierarchical(comm),
                     "pycomm: the hierarchical algorithm needs a group over several hosts, some "
                     "with several ranks (and PYCOMM_TRANSPORT other than tcp)");
}

AllreduceAlgorithm selectAllreduceAlgorithm(const Comm& comm, size_t bytes) {
  return selectAllreduceAlgorithm(bytes, comm.size(), onOneHost(comm),
                                  static_cast<int>(comm.hostLeaders().size()));
}

AllreduceAlgorithm selectAllreduceAlgorithm(size_t bytes, int n, bool oneHost, int hosts) {
  if (oneHost && n > 1) return AllreduceAlgorithm::kShm;
  if (hosts > 1 && hosts < n) return AllreduceAlgorithm::kHierarchical;
  if (n <= 2) return bytes <= 4096 ? AllreduceAlgorithm::kTree : AllreduceAlgorithm::kRing;
  const double s = static_cast<double>(bytes);
  const double steps = std::ceil(std::log2(static_cast<double>(n)));
  const double share = 2.0 * (n - 1) / n * s * kBeta;
  const double ring = 2.0 * (n - 1) * kAlpha + share;
  const bool powerOfTwo = (n & (n - 1)) == 0;
  const double sharded = powerOfTwo ? 2.0 * steps * kAlpha + share
                                    : 2.0 * kAlpha + (n - 1) * kGamma + share;
  const double tree = 2.0 * steps * kAlpha + 2.0 * steps * s * kBeta;
  AllreduceAlgorithm best = AllreduceAlgorithm::kRing;
  double cost = ring;
  if (sharded < cost) best = AllreduceAlgorithm::kSharded, cost = sharded;
  if (tree < cost) best = AllreduceAlgorithm::kTree, cost = tree;
  return best;
}

}  // namespace pycomm
