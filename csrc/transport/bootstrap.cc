#include "transport/bootstrap.h"

#include <algorithm>

#include "common/error.h"
#include "common/logging.h"
#include "transport/shm_segment.h"
#include "transport/tcp.h"

namespace pycomm {

GroupTransport bootstrapGroup(KeyValueStore& store, int rank, int size, const GroupConfig& config) {
  PYCOMM_CHECK_USAGE(config.transport == "auto" || config.transport == "shm" || config.transport == "tcp",
                     "pycomm: unknown transport '", config.transport, "' (expected auto, shm or tcp)");
  const bool tcpOnly = config.transport == "tcp";
  TcpOptions options;
  options.bindAddress = config.bindAddress;
  options.connectTimeout = config.timeout;
  options.storePrefix = config.storePrefix;
  options.secret = config.secret;
  options.socketsPerPeer = config.socketsPerPeer;
  options.ioThreads = config.ioThreads;
  PYCOMM_CHECK_USAGE(config.wire == "integrity" || config.wire == "none", "pycomm: unknown PYCOMM_WIRE '",
                     config.wire, "' (expected integrity or none)");
  options.wire = config.wire == "none" ? kWireNone : kWireIntegrity;
  GroupTransport group;
  // TCP first: it names a rank that never joins; once it is up every rank is
  // here, so the host-key exchange below does not wait on a missing one.
  group.transport = std::make_shared<TcpTransport>(rank, size, store, options, config.globalRanks);
  // Every rank (PYCOMM_TRANSPORT=tcp too) takes part in the host-key exchange
  // and the vote below, so ranks configured differently never wait on each other.
  std::vector<int> local;
  if (size > 1) {
    // A rank without shared memory is a host of its own for the others.
    int ranksOnMachine = 1;
    const std::vector<int> leaderOf =
        hostLeaders(store, config.storePrefix, rank, size, tcpOnly ? "tcp" : "", &ranksOnMachine);
    for (int r = 0; r < size && !tcpOnly; ++r) {
      if (leaderOf[r] == leaderOf[rank]) local.push_back(r);
      if (leaderOf[r] == r) group.hostLeaders.push_back(r);
    }
    // More ranks on this machine (network namespaces included) than CPUs to run
    // them: a long wait that polls takes the core from a rank with work (request.cc).
    const cpu_set_t allowed = allowedCpuSet();
    const int cpus = CPU_COUNT(&allowed);
    if (ranksOnMachine > std::max(1, cpus) && !Request::pollingLimited()) {
      Request::limitPolling();
      debugLog(strCat("rank ", rank, ": ", ranksOnMachine, " ranks on this machine, ", cpus,
                      " CPUs: only waits for small messages poll"));
    }
  }
  std::string shmFailure = tcpOnly ? "PYCOMM_TRANSPORT=tcp" : "";
  if (local.size() > 1) {
    try {
      group.arena = std::make_shared<ShmArena>(store, config.storePrefix, local, rank, config.segmentBytes,
                                               kArenaDepth, config.shmSpread);
    } catch (const std::exception& e) {  // store errors are not pycomm::Error
      shmFailure = e.what();
    }
  }
  // Everyone uses shared memory, or nobody does (algorithm choices must agree);
  // every rank says how it went before anyone gives up, so nobody waits.
  if (size > 1) {
    store.set(strCat(config.storePrefix, "shm-ok/", rank), shmFailure.empty() ? "1" : "0" + shmFailure);
    std::string why;
    for (int r = 0; r < size; ++r) {
      const std::string vote = store.get(strCat(config.storePrefix, "shm-ok/", r));
      if (vote != "1" && why.empty()) why = strCat(group.transport->rankName(r), ": ", vote.substr(1));
    }
    if (!why.empty() && !tcpOnly) {
      if (config.transport == "shm")
        throwError(ErrorKind::kConnection, "pycomm: shared memory cannot be used (", why,
                   ") but PYCOMM_TRANSPORT=shm; PYCOMM_TRANSPORT=tcp avoids shared memory");
      debugLog("shared memory not used (" + why + "); every rank uses TCP only");
      group.arena.reset();
      group.hostLeaders.clear();
    }
  }
  if (group.arena) {
    std::weak_ptr<Transport> named = group.transport;
    group.arena->setRankNamer([named](int r) {
      auto t = named.lock();
      return t ? t->rankName(r) : "rank " + std::to_string(r);
    });
  }
  return group;
}

}  // namespace pycomm
