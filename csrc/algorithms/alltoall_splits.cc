#include "algorithms/alltoall_splits.h"

#include "common/checked_size.h"
#include "common/error.h"

namespace pycomm {

std::string checkAlltoallSplits(const std::vector<int64_t>& splits, int ranks, int64_t rows,
                                size_t rowBytes, const char* what, AlltoallLayout* layout) {
  layout->offsets.clear();
  layout->bytes.clear();
  if (ranks < 1) return strCat("the group size ", ranks, " is not positive");
  if (rows < 0) return strCat(what, " has a negative number of rows (", rows, ")");
  std::vector<int64_t> even;
  const std::vector<int64_t>* table = &splits;
  if (splits.empty()) {
    if (rows % ranks != 0)
      return strCat(what, " has ", rows, " rows, not divisible by the group size ", ranks);
    even.assign(ranks, rows / ranks);
    table = &even;
  }
  if (table->size() != static_cast<size_t>(ranks))
    return strCat(what, " splits have ", table->size(), " entries, need ", ranks, " (one per rank)");
  // The running sum never exceeds rows, so it cannot overflow int64.
  int64_t total = 0;
  for (int i = 0; i < ranks; ++i) {
    const int64_t s = (*table)[i];
    if (s < 0) return strCat(what, " split ", i, " is negative (", s, ")");
    if (s > rows - total)
      return strCat(what, " splits exceed the tensor's ", rows, " rows (split ", i, " is ", s, " after ",
                    total, " rows)");
    total += s;
  }
  if (total != rows)
    return strCat(what, " splits sum to ", total, " but the tensor has ", rows, " rows");
  std::vector<size_t> offsets(ranks), bytes(ranks);
  size_t offset = 0;
  for (int i = 0; i < ranks; ++i) {
    size_t end = 0;
    if (!checkedMul(static_cast<size_t>((*table)[i]), rowBytes, &bytes[i]) || !checkedAdd(offset, bytes[i], &end))
      return strCat(what, " splits overflow the byte count (", rows, " rows of ", rowBytes, " bytes)");
    offsets[i] = offset;
    offset = end;
  }
  layout->offsets = std::move(offsets);
  layout->bytes = std::move(bytes);
  return "";
}

}  // namespace pycomm
