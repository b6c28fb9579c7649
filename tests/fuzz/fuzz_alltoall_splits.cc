// Fuzz target for the all-to-all split-size check (csrc/algorithms/alltoall_splits.h).
//
// The input is a call's worth of arguments: a group size, a row count, a row
// size and a table of split sizes, all of them hostile (negative, huge, sums that
// wrap). The harness compares the verdict with a reference computed in 128-bit
// arithmetic and checks that an accepted layout lies inside the buffer.
//
// libFuzzer:  clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc
//               tests/fuzz/fuzz_alltoall_splits.cc csrc/algorithms/alltoall_splits.cc -o fuzz_a2a
// Without clang: g++ -DPYCOMM_FUZZ_STANDALONE ... runs the fixed regression cases, then
// a seeded random loop (./fuzz_a2a RUNS) that prints the "Done N runs" summary.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/alltoall_splits.h"
#include "fuzz_input.h"

using namespace pycomm;

using pycomm_fuzz::check;
using pycomm_fuzz::Reader;

namespace {

using u128 = unsigned __int128;
using i128 = __int128;

// The reference verdict, in arithmetic that cannot overflow for these inputs.
bool acceptable(const std::vector<int64_t>& splits, int ranks, int64_t rows, size_t rowBytes) {
  if (ranks < 1 || rows < 0) return false;
  if (splits.empty()) {
    if (rows % ranks != 0) return false;
  } else {
    if (splits.size() != static_cast<size_t>(ranks)) return false;
    i128 total = 0;
    for (int64_t s : splits) {
      if (s < 0) return false;
      total += s;
    }
    if (total != rows) return false;
  }
  return static_cast<u128>(rows) * rowBytes <= SIZE_MAX;
}

void runCase(const std::vector<int64_t>& splits, int ranks, int64_t rows, size_t rowBytes) {
  AlltoallLayout layout;
  layout.offsets.assign(3, 7);  // stale contents must not survive
  const std::string error = checkAlltoallSplits(splits, ranks, rows, rowBytes, "input", &layout);
  const bool expected = acceptable(splits, ranks, rows, rowBytes);
  if (!error.empty()) {
    check(!expected, "rejected a valid split table");
    check(layout.offsets.empty() && layout.bytes.empty(), "layout left filled after a rejection");
    check(error.rfind("input ", 0) == 0 || error.rfind("the group size", 0) == 0, "error names the side");
    return;
  }
  check(expected, "accepted an invalid split table");
  check(layout.offsets.size() == static_cast<size_t>(ranks) && layout.bytes.size() == layout.offsets.size(),
        "one block per rank");
  const u128 size = static_cast<u128>(rows) * rowBytes;
  u128 end = 0;
  for (int i = 0; i < ranks; ++i) {
    const int64_t rowsOf = splits.empty() ? rows / ranks : splits[i];
    check(layout.offsets[i] == end, "blocks are contiguous, in rank order");
    check(layout.bytes[i] == static_cast<u128>(rowsOf) * rowBytes, "block bytes = rows x row size");
    end += layout.bytes[i];
    check(end <= size, "block inside the buffer");
  }
  check(end == size, "blocks cover the buffer");
}

// Values a split may take: small ones, ones near the row count, and the edges of int64.
int64_t interesting(Reader& in, int64_t rows) {
  const uint64_t pick = in.next(1);
  const int64_t small = static_cast<int8_t>(in.next(1));
  switch (pick % 8) {
    case 0: return small;
    case 1: return static_cast<int64_t>(static_cast<uint64_t>(rows) + static_cast<uint64_t>(small));
    case 2: return INT64_MAX - (small & 0x7f);
    case 3: return INT64_MIN + (small & 0x7f);
    case 4: return (int64_t{1} << (62 - (small & 0x3f) % 63)) + small;
    case 5: return rows / 2 + small;
    default: return static_cast<int64_t>(in.next(8));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const int ranks = static_cast<int>(in.next(1) % 12) - 1;  // -1..10
  const uint64_t shape = in.next(1);
  int64_t rows = static_cast<int64_t>(in.next(2));
  if (shape & 1) rows = static_cast<int64_t>(in.next(8));  // anything, negative included
  size_t rowBytes = in.next(1) % 17;
  if (shape & 2) rowBytes = in.next(8);
  if (shape & 4) rowBytes = size_t{1} << (in.next(1) % 64);
  std::vector<int64_t> splits;
  if (!(shape & 8)) {
    const int entries = (shape & 16) ? static_cast<int>(in.next(1) % 12) : (ranks < 0 ? 0 : ranks);
    for (int i = 0; i < entries; ++i) splits.push_back(interesting(in, rows));
    // Often make the table sum to exactly rows (mod 2^64 when it wraps): the
    // old code's blind spot.
    if (!splits.empty() && (shape & 32)) {
      uint64_t sum = 0;
      for (size_t i = 0; i + 1 < splits.size(); ++i) sum += static_cast<uint64_t>(splits[i]);
      splits.back() = static_cast<int64_t>(static_cast<uint64_t>(rows) - sum);
    }
  }
  runCase(splits, ranks, rows, rowBytes);
  return 0;
}

#ifdef PYCOMM_FUZZ_STANDALONE
#include "standalone.h"
namespace {

// Fixed cases: what each verdict must be (issue #13's wrapping sums among them).
void regressions() {
  struct Case {
    std::vector<int64_t> splits;
    int ranks;
    int64_t rows;
    size_t rowBytes;
    bool ok;
  };
  const int64_t kMax = INT64_MAX;
  const Case cases[] = {
      {{}, 3, 6, 4, true},
      {{}, 3, 7, 4, false},                                   // not divisible
      {{}, 1, 0, 0, true},
      {{1, 2, 3}, 3, 6, 4, true},
      {{0, 0, 0}, 3, 0, 0, true},
      {{1, 2}, 3, 3, 4, false},                               // too few entries
      {{-1, 2, 2}, 3, 3, 4, false},                           // negative
      {{kMax, 0, 0}, 3, 3, 4, false},                         // past the rows
      {{kMax, kMax, 6}, 3, 4, 4, false},                      // sum wraps to 4
      {{kMax, 1 + (int64_t{1} << 62), (int64_t{1} << 62) + 4}, 3, 4, 4, false},
      {{1, 1}, 2, 2, SIZE_MAX, false},                        // bytes overflow
      {{1, 1}, 2, 2, SIZE_MAX / 2, true},
      {{0, 1}, 2, 1, SIZE_MAX, true},
      {{1, 2, 3}, 0, 6, 4, false},                            // no group
      {{}, 2, -2, 4, false},                                  // negative rows
  };
  for (const Case& c : cases) {
    AlltoallLayout layout;
    const bool ok = checkAlltoallSplits(c.splits, c.ranks, c.rows, c.rowBytes, "input", &layout).empty();
    check(ok == c.ok, "regression case verdict");
    runCase(c.splits, c.ranks, c.rows, c.rowBytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const long runs = pycomm_fuzz::runsFromArgs(argc, argv);
  regressions();
  pycomm_fuzz::Xorshift next(0x243f6a8885a308d3ull);
  uint8_t buffer[160];
  for (long run = 0; run < runs; ++run) {
    const size_t size = pycomm_fuzz::randomBytes(next, buffer, sizeof(buffer));
    LLVMFuzzerTestOneInput(buffer, size);
  }
  std::printf("Done %ld runs (standalone random-mutation driver, plus the regression cases)\n", runs);
  return 0;
}
#endif
