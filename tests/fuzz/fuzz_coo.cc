// Fuzz target for the COO all-reduce's decoder (csrc/algorithms/sparse_wire.h, used by
// allreduce_coo.cc): what a peer could send as its 48-byte header and payload, checked
// and decoded as the receiver does (checkCooHeader, then decodeCooRows into nnz rows).
// ASan/UBSan catch any read past the payload or write past the rows; the harness also
// checks that every payload the encoder makes decodes to the rows it encoded.
//
// libFuzzer:  clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc \
//               tests/fuzz/fuzz_coo.cc csrc/algorithms/sparse_wire.cc csrc/kernels/cpu/*.cc -o fuzz_coo
// Without clang: g++ -DPYCOMM_FUZZ_STANDALONE ... (./fuzz_coo RUNS, "Done N runs").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "algorithms/sparse_wire.h"

using namespace pycomm;

namespace {

// The receiver allocates what a checked header announces; the harness caps it so
// huge (valid) announcements do not exhaust memory.
constexpr uint64_t kMaxPayload = 1 << 20;

void check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(CooHeader)) return 0;
  // 1. Arbitrary bytes as a peer's header and payload.
  CooHeader header;
  std::memcpy(&header, data, sizeof(header));
  data += sizeof(header);
  size -= sizeof(header);
  if (checkCooHeader(header) == nullptr && header.payloadBytes <= kMaxPayload) {
    check(header.nnz <= header.payloadBytes, "a checked header's rows fit its payload");
    std::vector<uint8_t> payload(static_cast<size_t>(header.payloadBytes));
    if (!payload.empty()) std::memcpy(payload.data(), data, std::min(payload.size(), size));
    std::vector<int64_t> rows(static_cast<size_t>(header.nnz));
    if (decodeCooRows(header, payload.data(), rows.data()) == nullptr)
      for (size_t j = 0; j < rows.size(); ++j)
        check(rows[j] >= 0 && static_cast<uint64_t>(rows[j]) < header.rowCount &&
                  (j == 0 || rows[j] > rows[j - 1]),
              "decoded rows are ascending and inside the index space");
  }
  // 2. The same bytes as ascending rows to encode: every payload decodes back.
  std::vector<int64_t> rows;
  int64_t row = -1;
  for (size_t i = 0; i + 2 <= size; i += 2) {
    const uint64_t gap = 1 + (static_cast<uint64_t>(data[i]) << (data[i + 1] % 40));
    row += static_cast<int64_t>(gap);
    if (row < 0 || row >= (int64_t{1} << 50)) break;
    rows.push_back(row);
  }
  const uint64_t rowCount = rows.empty() ? 1 : static_cast<uint64_t>(rows.back()) + 1 + size % 7;
  const size_t rowElems = size % 3;
  std::vector<float> values(rows.size() * rowElems, 1.5f);
  CooHeader h = cooHeader(rows.data(), rows.size(), rowCount, rowElems, DataType::kFloat32);
  check(checkCooHeader(h) == nullptr, "an encoded header passes the check");
  std::vector<uint8_t> payload(static_cast<size_t>(h.payloadBytes));
  uint8_t* at = encodeCooRows(h, rows.data(), payload.data());
  check(at == payload.data() + cooValuesOffset(h.indexBytes), "values offset");
  if (!values.empty()) std::memcpy(at, values.data(), values.size() * sizeof(float));
  std::vector<int64_t> decoded(rows.size());
  check(decodeCooRows(h, payload.data(), decoded.data()) == nullptr, "an encoded payload decodes");
  check(decoded == rows, "decoded rows equal the encoded ones");
  return 0;
}

#ifdef PYCOMM_FUZZ_STANDALONE
#include "standalone.h"
// A seeded mutation loop for machines without libFuzzer: half the inputs are valid
// header + payload pairs with a few bytes flipped, so the decoder's inner paths run.
int main(int argc, char** argv) {
  const long runs = pycomm_fuzz::runsFromArgs(argc, argv);
  pycomm_fuzz::Xorshift next(0x9e3779b97f4a7c15ull);
  std::vector<uint8_t> buffer(2048);
  for (long run = 0; run < runs; ++run) {
    size_t size = pycomm_fuzz::randomBytes(next, buffer.data(), buffer.size());
    if (next() & 1) {
      std::vector<int64_t> rows;
      const uint64_t rowCount = 1 + next() % 100000;
      for (uint64_t r = next() % 50; r < rowCount && rows.size() < 150; r += 1 + next() % 3000) rows.push_back(r);
      const size_t rowElems = next() % 3;
      CooHeader h = cooHeader(rows.data(), rows.size(), rowCount, rowElems, DataType::kFloat32);
      std::vector<uint8_t> payload(static_cast<size_t>(h.payloadBytes));
      encodeCooRows(h, rows.data(), payload.data());
      size = std::min(buffer.size(), sizeof(h) + payload.size());
      std::memcpy(buffer.data(), &h, sizeof(h));
      if (size > sizeof(h)) std::memcpy(buffer.data() + sizeof(h), payload.data(), size - sizeof(h));
      pycomm_fuzz::flipBits(next, buffer.data(), size);
    }
    LLVMFuzzerTestOneInput(buffer.data(), size);
  }
  std::printf("Done %ld runs (standalone random-mutation driver)\n", runs);
  return 0;
}
#endif
