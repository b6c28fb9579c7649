// All-reduce among the ranks of the node-local shared-memory arena (the whole
// group when it is on one host; one host's ranks in the hierarchical form). Per segment of `slotBytes`: each rank copies its segment
// into its slot (kPosted); then either
//  - every rank reduces the whole segment out of all slots into its buffer
//    (small segments, or two ranks: one synchronisation per segment), or
//  - rank r reduces sub-chunk r of the segment in place in its own slot
//    (kReduced), and every rank copies all reduced sub-chunks out (kConsumed).
// A slot is refilled only after every rank consumed what it held `depth`
// segments ago, so fast ranks run ahead by up to depth - 1 segments.
// pycomm.stats() counts the bytes peers read from this rank's slot (once per
// reader) as sent, those it reads from peers' slots as received.
// Every step is posted with the call (allreduce, bytes, dtype, op) and every
// rank waits for every peer's post of every step, so ranks whose calls differ
// (tensor sizes that differ between ranks) all fail at the first step, before
// anyone reads a peer's slot. An empty call still takes one step, so it too
// meets the others' calls.
// Results are bit-identical on every rank: in the split form each element is
// reduced once, by one rank; in the whole form every rank reduces in rank order
// (for SUM/PRODUCT of two ranks, commutativity makes the order irrelevant). Both
// forms combine all n copies of an element in rank order in one pass
// (reduceMany): float16 / bfloat16 are summed in float32 and rounded once, so a
// 16-bit result does not depend on the form, the segment size or the number of
// ranks' roundings.
#include <algorithm>
#include <cstring>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/cpu/reduce.h"

namespace pycomm {
namespace {

// Segments up to a quarter of a slot (64 KiB with the default slots) are
// reduced whole by every rank: one synchronisation instead of two.
constexpr size_t kReduceAllDivisor = 4;

bool commutativeBitwise(ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kProduct; }

}  // namespace

void allreduceShm(Comm& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  if (comm.arena() == nullptr) return;  // alone on its host
  ShmArena& arena = *comm.arena();
  const int n = arena.localSize();
  const int me = arena.localRank();
  const size_t elem = elementSize(dtype);
  const size_t segmentElems = arena.slotBytes() / elem;
  const int depth = arena.depth();
  char* data = static_cast<char*>(buf);
  uint64_t bytesIn = 0, bytesOut = 0;
  const ShmArena::Call call = arenaCall(Collective::kAllreduce, count * elem, dtype, op);
  // The slots a step reduces, in rank order (grows once per thread, then reused).
  thread_local std::vector<const void*> sources;
  if (sources.size() < static_cast<size_t>(n)) sources.resize(n);
  if (count == 0) {  // one step without data, to meet the others' calls
    const uint64_t g = arena.nextSegment();
    if (g >= static_cast<uint64_t>(depth)) comm.waitArenaAll(ShmArena::kConsumed, g - depth + 1);
    arena.post(g, call);
    comm.waitArenaAll(ShmArena::kPosted, g + 1);
    arena.publish(ShmArena::kConsumed, g + 1);
    return;
  }
  for (size_t offset = 0; offset < count; offset += segmentElems) {
    const size_t elems = std::min(segmentElems, count - offset);
    const size_t bytes = elems * elem;
    char* mine = data + offset * elem;
    const uint64_t g = arena.nextSegment();
    if (g >= static_cast<uint64_t>(depth)) comm.waitArenaAll(ShmArena::kConsumed, g - depth + 1);
    std::memcpy(arena.slot(me, g), mine, bytes);
    arena.post(g, call);
    comm.waitArenaAll(ShmArena::kPosted, g + 1);
    if (n == 2 && commutativeBitwise(op)) {
      reduceInto(mine, arena.slot(1 - me, g), elems, dtype, op);
      bytesIn += bytes;
      bytesOut += bytes;
    } else if (bytes <= arena.slotBytes() / kReduceAllDivisor) {
      // One pass over all slots in rank order (16-bit floats summed in float32 and
      // rounded once): the one-shot all-reduce of small messages.
      for (int j = 0; j < n; ++j) sources[j] = arena.slot(j, g);
      reduceMany(mine, sources.data(), n, elems, dtype, op);
      bytesIn += (n - 1) * bytes;
      bytesOut += (n - 1) * bytes;
    } else {
      const std::vector<size_t> sub = balancedOffsets(elems, n);
      const size_t at = sub[me] * elem;
      // Rank me reduces its sub-chunk in place in its own slot; nobody else
      // reads that part of the slot before kReduced.
      char* own = arena.slot(me, g) + at;
      for (int j = 0; j < n; ++j) sources[j] = arena.slot(j, g) + at;
      reduceMany(own, sources.data(), n, sub[me + 1] - sub[me], dtype, op);
      arena.publish(ShmArena::kReduced, g + 1);
      comm.waitArenaAll(ShmArena::kReduced, g + 1);
      for (int j = 0; j < n; ++j)
        std::memcpy(mine + sub[j] * elem, arena.slot(j, g) + sub[j] * elem, (sub[j + 1] - sub[j]) * elem);
      // As a reduce-scatter + all-gather would move: 2 (n-1)/n of the segment.
      const size_t ownBytes = (sub[me + 1] - sub[me]) * elem;
      bytesIn += (bytes - ownBytes) + (n - 1) * ownBytes;
      bytesOut += (n - 1) * ownBytes + (bytes - ownBytes);
    }
    arena.publish(ShmArena::kConsumed, g + 1);
  }
  arena.countBytes(bytesIn, bytesOut);
}

}  // namespace pycomm
