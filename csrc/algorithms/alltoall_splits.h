// The split sizes of an all-to-all over one buffer (torch's all_to_all_single):
// rows per rank, checked against the buffer and turned into byte offsets.
// Torch-free, so the arithmetic is unit-tested and fuzzed without torch
// (tests/fuzz/fuzz_alltoall_splits.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {

// Where each rank's block lies in the buffer: bytes [offsets[i], offsets[i] + bytes[i]).
struct AlltoallLayout {
  std::vector<size_t> offsets;
  std::vector<size_t> bytes;
};

// Checks `splits` (rows per rank; empty: the rows split evenly over `ranks`)
// against a buffer of `rows` rows of `rowBytes` bytes each and fills `layout`.
// Returns "" when they fit, else why not, without the "pycomm <op>: " prefix,
// naming the side with `what` ("input", "output"). Accepted splits have one
// non-negative entry per rank, sum to exactly `rows`, and every block ends
// within rows * rowBytes bytes, which fits in size_t; nothing overflows on the way.
std::string checkAlltoallSplits(const std::vector<int64_t>& splits, int ranks, int64_t rows,
                                size_t rowBytes, const char* what, AlltoallLayout* layout);

}  // namespace pycomm
