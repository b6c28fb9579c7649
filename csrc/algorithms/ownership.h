// Which rank owns which elements in the compressed collectives: a buffer is a run
// of segments (one per parameter, say); each segment is split into n chunks and
// rank c owns chunk c of every segment. Ownership thus depends on each segment alone,
// not on how segments are grouped into buffers (DDP buckets), so neither do results.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "algorithms/comm.h"
#include "common/error.h"

namespace pycomm {

// A run of elements rank c owns: at `global` in the buffer, at `local` in the
// owner's concatenation of its pieces (its "owned space"); from segment `segment`.
struct Piece {
  size_t global;
  size_t length;
  size_t local;
  size_t segment;
};

struct Ownership {
  std::vector<std::vector<Piece>> pieces;  // per owner, ascending `global` (and `local`)
  std::vector<size_t> owned;               // per owner, elements owned
};

// segments: lengths summing to count (empty: one segment of count). align > 1 cuts
// chunks at multiples of align from each segment's start (whole quantization blocks).
inline Ownership segmentOwnership(const std::vector<size_t>& segments, size_t count, int n,
                                  size_t align) {
  std::vector<size_t> lengths = segments.empty() ? std::vector<size_t>{count} : segments;
  size_t total = 0;
  for (size_t l : lengths) total += l;
  PYCOMM_CHECK_USAGE(total == count, "pycomm compressed all-reduce: segments sum to ", total,
                     " elements but the buffer has ", count);
  Ownership o;
  o.pieces.resize(n);
  o.owned.assign(n, 0);
  size_t global = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    const size_t units = align > 1 ? (lengths[s] + align - 1) / align : lengths[s];
    std::vector<size_t> offsets = balancedOffsets(units, n);
    for (auto& offset : offsets) offset = align > 1 ? std::min(lengths[s], offset * align) : offset;
    for (int c = 0; c < n; ++c) {
      const size_t length = offsets[c + 1] - offsets[c];
      if (length == 0) continue;
      o.pieces[c].push_back({global + offsets[c], length, o.owned[c], s});
      o.owned[c] += length;
    }
    global += lengths[s];
  }
  return o;
}

}  // namespace pycomm
