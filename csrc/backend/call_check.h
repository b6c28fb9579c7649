// "Did every rank make the same call?" One concept, checked at three levels, each
// where the information it needs exists:
//
// * the call check (checkSameCall, opt-in: PYCOMM_CHECK=1 or
//   TORCH_DISTRIBUTED_DEBUG=DETAIL): before a collective, every rank all-gathers the
//   wire form of its CallDescriptor (common/call.h: op, dtype, element count, reduce
//   op, root) and a mismatch fails on every rank, naming each rank's call. It costs a
//   round trip, so it is off by default.
// * the call hash (callHash, always on): a digest of the same descriptor without the
//   count goes into the collective's tags (Comm::setCall), so a TCP message from a
//   peer in another call fails the receive that meets it. Sizes are caught by the
//   message sizes instead (and all-to-all's legitimately differ).
// * the arena step (arenaCall, algorithms/comm.h, always on): on one host no tag
//   travels, so each shared-memory step posts what the algorithm is doing (collective,
//   bytes, dtype, reduce op, root) and a rank that waits for a peer's step compares it
//   (Comm::waitArena). It is built by the algorithm from its own arguments, because
//   what a step moves (a hierarchical all-reduce's share, an all-gather's total) is
//   known only there.
//
// Torch-free: the backend describes the call from its tensors (callOf in
// process_group_collectives.cc), these compare it.
#pragma once

#include <cstdint>

#include "algorithms/comm.h"
#include "common/call.h"

namespace pycomm {

// What one rank called, as checkSameCall exchanges it: the compared fields of its
// CallDescriptor, 56 bytes on the wire; every field takes part in the comparison (-1:
// not compared for this collective).
struct CallSignature {
  char op[40] = {};
  int32_t dtype = -1;     // DataType
  int32_t reduceOp = -1;  // ReduceOp
  int64_t count = -1;     // elements this rank contributes
  int32_t root = -1;
  int32_t reserved = 0;
};
CallSignature wireSignature(const CallDescriptor& call);

// What Comm::setCall puts in a collective's tags: FNV-1a over the compared name,
// dtype, reduce op and root (not the count).
uint64_t callHash(const CallDescriptor& call);

// All-gathers `mine`'s signature under the current collective's tag (before setCall)
// and throws a usage error naming every rank's call when they differ.
void checkSameCall(Comm& comm, const CallDescriptor& mine);

}  // namespace pycomm
