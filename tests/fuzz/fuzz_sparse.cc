// Fuzz target for the sparse all-reduce's decoder (csrc/algorithms/sparse_wire.h):
// what a peer could send as one message (header + payload) for a chunk of some
// size, decoded as allreduce_sparse.cc decodes it. ASan/UBSan catch any read past
// the payload or write past the chunk; the harness also checks that every message
// the encoder makes decodes to the values it encoded.
//
// libFuzzer:  clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc \
//               tests/fuzz/fuzz_sparse.cc csrc/algorithms/sparse_wire.cc -o fuzz_sparse
// Without clang: g++ -DPYCOMM_FUZZ_STANDALONE ... (./fuzz_sparse RUNS, "Done N runs").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "algorithms/sparse_wire.h"

using namespace pycomm;

namespace {

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16};

void check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3 + sizeof(SparseHeader)) return 0;
  const DataType type = kTypes[data[0] % 3];
  const size_t chunk = (static_cast<size_t>(data[1]) | static_cast<size_t>(data[2]) << 8) % 2048;
  data += 3;
  size -= 3;
  // 1. Arbitrary bytes as a peer's message. The receiver allocates the payload
  // the header announces, up to maxSparsePayloadBytes, and receives exactly that.
  SparseHeader header;
  std::memcpy(&header, data, sizeof(header));
  data += sizeof(header);
  size -= sizeof(header);
  if (header.payloadBytes <= maxSparsePayloadBytes(chunk, elementSize(type))) {
    std::vector<uint8_t> payload(static_cast<size_t>(header.payloadBytes));
    if (!payload.empty()) std::memcpy(payload.data(), data, std::min(payload.size(), size));
    std::vector<float> acc(chunk);
    accumulateSparse(header, payload.data(), chunk, type, acc.data());
  }
  // 2. The same bytes as pairs to encode: every encoded message decodes back.
  std::vector<uint32_t> rel;
  std::vector<float> values;
  uint32_t position = 0;
  for (size_t i = 0; i + 3 <= size && chunk > 0; i += 3) {
    position += 1 + data[i] % 9;
    if (position > chunk) break;
    rel.push_back(position - 1);
    values.push_back(static_cast<float>(static_cast<int16_t>(data[i + 1] | data[i + 2] << 8)) / 64.0f);
  }
  SparseMessage message = encodeSparse(rel, values.data(), chunk, type);
  check(message.header()->payloadBytes == message.payloadBytes(), "encoded size");
  check(message.payloadBytes() <= maxSparsePayloadBytes(chunk, elementSize(type)), "encoded size bound");
  std::vector<float> decoded(chunk);
  check(accumulateSparse(*message.header(), message.payload(), chunk, type, decoded.data()) == nullptr,
        "an encoded message decodes");
  std::vector<float> expected(chunk);
  for (size_t j = 0; j < rel.size(); ++j) expected[rel[j]] = wireRoundTrip(values[j], type);
  check(decoded == expected, "decoded values equal the encoded ones");
  return 0;
}

#ifdef PYCOMM_FUZZ_STANDALONE
#include "standalone.h"
// A seeded mutation loop for machines without libFuzzer: half the inputs are
// valid messages with a few bytes flipped, so the decoder's inner paths run.
int main(int argc, char** argv) {
  const long runs = pycomm_fuzz::runsFromArgs(argc, argv);
  pycomm_fuzz::Xorshift next(0x2545f4914f6cdd1dull);
  std::vector<uint8_t> buffer(1024);
  for (long run = 0; run < runs; ++run) {
    size_t size = pycomm_fuzz::randomBytes(next, buffer.data(), buffer.size());
    if (size > 64 && (next() & 1)) {
      // A real message: encode pairs, then flip a few bytes of it.
      const DataType type = kTypes[next() % 3];
      const size_t chunk = 1 + next() % 300;
      std::vector<uint32_t> rel;
      std::vector<float> values;
      for (uint32_t p = static_cast<uint32_t>(next() % 5); p < chunk; p += 1 + next() % 40) {
        rel.push_back(p);
        values.push_back(static_cast<float>(next() % 1000) - 500.0f);
      }
      SparseMessage message = encodeSparse(rel, values.data(), chunk, type);
      const size_t bytes = std::min(buffer.size() - 3, message.bytes.size());
      buffer[0] = static_cast<uint8_t>(type == DataType::kFloat32 ? 0 : type == DataType::kFloat16 ? 1 : 2);
      buffer[1] = static_cast<uint8_t>(chunk & 0xff);
      buffer[2] = static_cast<uint8_t>(chunk >> 8);
      std::memcpy(buffer.data() + 3, message.bytes.data(), bytes);
      size = 3 + bytes;
      pycomm_fuzz::flipBits(next, buffer.data() + 3, bytes);
    }
    LLVMFuzzerTestOneInput(buffer.data(), size);
  }
  std::printf("Done %ld runs (standalone random-mutation driver)\n", runs);
  return 0;
}
#endif
