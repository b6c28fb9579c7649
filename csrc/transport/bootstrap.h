// Bootstrap of one process group, apart from the torch Backend (which only
// calls it, as ProcessGroupGloo only calls connectFullMesh): the TCP mesh, the
// host-key exchange, the shared-memory vote and the node-local arena. Torch-free;
// tests drive it with memory_store.h and threads as ranks.
#pragma once

#include <memory>
#include <vector>

#include "common/group_config.h"
#include "transport/shm_arena.h"
#include "transport/transport.h"

namespace pycomm {

// What a group needs to run collectives.
struct GroupTransport {
  std::shared_ptr<Transport> transport;  // TCP between every pair of ranks
  std::shared_ptr<ShmArena> arena;       // ranks sharing this host; null when unused
  std::vector<int> hostLeaders;          // the lowest rank of each host, ascending (empty: no shm)
};

// The arena's slots per rank; each holds one pipeline segment
// (PYCOMM_SEGMENT_BYTES, 256 KiB by default: 4 of them stay in L2/L3).
constexpr int kArenaDepth = 4;

// Collective over the group's `size` ranks through `store` (keys under
// config.storePrefix). Every rank uses shared memory or none does: if any rank
// cannot set up its arena, all run over TCP (config.transport "shm" makes that
// an error instead, naming the rank). Throws Error: kUsage for a bad config,
// kConnection for a rank that never joins or a failed setup.
GroupTransport bootstrapGroup(KeyValueStore& store, int rank, int size, const GroupConfig& config);

}  // namespace pycomm
