// Sizes that peers announce, added without wrapping (csrc/common/checked_size.h) and
// the COO all-reduce's scratch layout built on it (sparse_wire.h: cooScratchLayout):
// headers that each pass checkCooHeader but whose sum wraps 2^64 (the ring relays
// other ranks' headers, so one rank can send any of them) give an error naming the
// rank that announced the most, never a small buffer. Built and run by
// tests/transport/test_bounds_cpp.py; prints one line per check, exits non-zero on failure.
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "algorithms/sparse_wire.h"
#include "common/checked_size.h"

using namespace pycomm;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

// A header as a peer could send it: `nnz` rows of `rowElems` float64 values out of
// `rowCount`, one index byte per row; consistent, so checkCooHeader accepts it.
CooHeader bigHeader(uint64_t nnz, uint64_t rowCount, uint64_t rowElems) {
  CooHeader h{};
  h.format = kCooFormat;
  h.dtype = static_cast<uint32_t>(DataType::kFloat64);
  h.rowCount = rowCount;
  h.rowElems = rowElems;
  h.nnz = nnz;
  h.indexBytes = nnz;
  h.payloadBytes = cooValuesOffset(h.indexBytes) + nnz * rowElems * 8;
  return h;
}

}  // namespace

int main() {
  size_t out = 7;
  expect(checkedAdd(1, 2, &out) && out == 3, "checkedAdd adds");
  expect(!checkedAdd(SIZE_MAX, 1, &out) && out == 3, "checkedAdd refuses a sum that wraps, leaving the result");
  expect(!checkedMul(size_t(1) << 33, size_t(1) << 31, &out) && out == 3, "checkedMul refuses a product that wraps");
  std::vector<size_t> offsets;
  expect(blockOffsets({1, 64, 0, 65}, 64, SIZE_MAX, &offsets) &&
             offsets == std::vector<size_t>({0, 64, 128, 128, 256}),
         "blockOffsets aligns every block to 64 bytes");
  expect(!blockOffsets({SIZE_MAX - 10, 1}, 64, SIZE_MAX, &offsets) && offsets.empty(),
         "blockOffsets refuses a block whose alignment wraps");
  expect(!blockOffsets({1ull << 63, 1ull << 63, 64}, 64, SIZE_MAX, &offsets) && offsets.empty(),
         "blockOffsets refuses a total that wraps");
  expect(!blockOffsets({100, 100}, 1, 199, &offsets), "blockOffsets refuses a total over the limit");

  // Each header under 2^63 bytes and accepted alone; three of them wrap 2^64.
  const uint64_t rowCount = 1ull << 48, rowElems = 1ull << 13;
  const CooHeader big = bigHeader((1ull << 47) - (1ull << 33), rowCount, rowElems);
  expect(checkCooHeader(big) == nullptr && big.payloadBytes < (1ull << 63),
         "a header announcing " + std::to_string(big.payloadBytes) + " bytes passes checkCooHeader alone");
  expect(big.payloadBytes <= maxCooPayloadBytes(rowCount, rowElems, DataType::kFloat64),
         "and is within what a tensor of its shape can have");
  CooHeader small = bigHeader(1, rowCount, rowElems);
  std::vector<CooHeader> headers = {small, big, big, big};
  int culprit = -1;
  const char* problem = cooScratchLayout(headers, SIZE_MAX, &offsets, &culprit);
  expect(problem != nullptr && culprit == 1 && offsets.empty(),
         std::string("headers whose sum wraps 2^64 are refused, naming rank 1: ") + (problem ? problem : "accepted"));
  headers = {small, big};
  problem = cooScratchLayout(headers, size_t(1) << 40, &offsets, &culprit);
  expect(problem != nullptr && culprit == 1, std::string("a sum past the limit is refused: ") +
                                                 (problem ? problem : "accepted"));
  headers = {small, small};
  problem = cooScratchLayout(headers, size_t(1) << 40, &offsets, &culprit);
  expect(problem == nullptr && offsets.size() == 3 && offsets[1] % 64 == 0 && offsets[2] >= 2 * small.payloadBytes,
         "small headers are laid out at 64-byte offsets");
  expect(maxCooPayloadBytes(UINT64_MAX, 2, DataType::kFloat32) == UINT64_MAX,
         "maxCooPayloadBytes saturates instead of wrapping");
  expect(maxCooPayloadBytes(100, 3, DataType::kFloat32) == 1008 + 1200, "maxCooPayloadBytes of 100 rows of 3 floats");

  std::cout << (failures == 0 ? "all passed" : "FAILURES: " + std::to_string(failures)) << std::endl;
  return failures == 0 ? 0 : 1;
}
