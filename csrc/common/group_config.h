// Everything one process group is configured with: the single options object.
// pycomm/config.py fills it from the PYCOMM_* variables (the only place that
// reads them) and the arguments torch passes; pybind11 binds it field by field
// (bindings.cc). Adding a knob: a field here, its line in config.py, and the
// def_readwrite in bindings.cc.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "common/cost_model.h"

namespace pycomm {

struct GroupConfig {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Address to listen on (PYCOMM_SOCKET_IFNAME, or the one that routes to the store host).
  std::string bindAddress = "127.0.0.1";
  // Pipeline segment size and arena slot size (PYCOMM_SEGMENT_BYTES).
  size_t segmentBytes = 256 * 1024;
  // The all-reduce algorithm (PYCOMM_ALGO): "auto" or a name from allreduce_registry.h.
  std::string algorithm = "auto";
  // Global rank of each group rank, for messages (empty: the group ranks themselves).
  std::vector<int> globalRanks;
  // Ranks compare every call before running it (PYCOMM_CHECK, TORCH_DISTRIBUTED_DEBUG=DETAIL).
  bool checkCalls = false;
  // Prefix of pycomm's keys in torch's store; differs per torchrun restart so a new
  // attempt never reads the addresses the failed one left behind.
  std::string storePrefix = "pycomm/";
  // "auto": shared memory among ranks on one host, TCP between hosts; "shm": the
  // same, but failing to set up shared memory is an error; "tcp": TCP only.
  std::string transport = "auto";
  // Oversubscribed ranks crowded on one CPU move to a freer one (PYCOMM_SHM_SPREAD).
  bool shmSpread = true;
  // Log choices, dropped connections and failures to stderr (PYCOMM_DEBUG; process-wide).
  bool debug = false;
  // The job secret (PYCOMM_SECRET, or the contents of PYCOMM_SECRET_FILE): connections
  // are authenticated with a key derived from it and nothing secret is written to the
  // store. Empty: rank 0 draws a random secret into the store. Never logged.
  std::string secret;
  // TCP streams per pair of ranks (PYCOMM_SOCKETS_PER_PEER, 1..16; rank 0's is
  // used by every rank) and epoll I/O threads (PYCOMM_IO_THREADS, 1..16). config.py
  // resolves `auto` (plan.py's stream model) before it gets here.
  int socketsPerPeer = 1;
  int ioThreads = 1;
  // What protects TCP frames after the handshake (PYCOMM_WIRE): "integrity" (every
  // frame MACed under a per-connection key) or "none". The same on every rank.
  std::string wire = "integrity";
  // The cost model `auto` chooses the all-reduce algorithm with (the host's cached
  // calibration, PYCOMM_COST_MODEL; the built-in defaults otherwise).
  CostModel cost;
};

}  // namespace pycomm
