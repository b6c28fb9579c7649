// Fuzz target for the TCP transport's wire parsing (csrc/transport/wire.h).
//
// The input is what a peer could put on a connection: a Hello, then a stream of
// frames. The harness walks it as the transport does: a header is acted on only
// if checkHeader accepts it, an abort notice's payload goes through
// abortReasonText. It checks the invariants the transport relies on.
//
// libFuzzer:  clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc \
//               tests/fuzz/fuzz_wire.cc csrc/transport/wire.cc -o fuzz_wire && ./fuzz_wire -runs=1000000
// Without clang: g++ -DPYCOMM_FUZZ_STANDALONE ... runs a seeded random-mutation loop
// (./fuzz_wire RUNS) that prints the same "Done N runs" summary.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/wire.h"

using namespace pycomm;

namespace {

const uint8_t kSecret[kSecretBytes] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

void check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= sizeof(Hello)) {
    Hello hello;
    std::memcpy(&hello, data, sizeof(hello));
    const int localRank = data[0] % 4;
    const std::string verdict = checkHello(hello, localRank, 8, kSecret);
    if (verdict.empty()) {
      check(hello.magic == kHelloMagic && hello.version == kWireVersion, "hello fields");
      check(hello.rank > localRank && hello.rank < 8 && hello.size == 8, "hello rank range");
      check(std::memcmp(hello.secret, kSecret, kSecretBytes) == 0, "hello secret");
    }
    data += sizeof(Hello);
    size -= sizeof(Hello);
  }
  while (size >= sizeof(WireHeader)) {
    WireHeader header;
    std::memcpy(&header, data, sizeof(header));
    data += sizeof(header);
    size -= sizeof(header);
    if (!checkHeader(header).empty()) break;  // the transport drops the peer here
    check(header.magic == kDataMagic, "accepted magic");
    check(header.bytes <= kMaxMessageBytes, "accepted size bound");
    check((header.flags & ~kKnownFlags) == 0, "accepted flags");
    const size_t payload = header.bytes < size ? static_cast<size_t>(header.bytes) : size;
    if (header.flags & kFlagAbort) {
      check(header.bytes <= kMaxAbortReasonBytes, "abort notice bound");
      const std::string text = abortReasonText(reinterpret_cast<const char*>(data), payload);
      check(text.size() == payload, "abort text length");
      for (char c : text) check(c >= 0x20 && c < 0x7f, "abort text printable");
    }
    data += payload;
    size -= payload;
  }
  return 0;
}

#ifdef PYCOMM_FUZZ_STANDALONE
// A seeded mutation loop for machines without libFuzzer: random frames built
// around valid ones, so both the accept and the reject paths run.
int main(int argc, char** argv) {
  const long runs = argc > 1 ? std::atol(argv[1]) : 100000;
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  uint8_t buffer[512];
  for (long run = 0; run < runs; ++run) {
    const size_t size = next() % sizeof(buffer);
    for (size_t i = 0; i < size; ++i) buffer[i] = static_cast<uint8_t>(next());
    if (size >= sizeof(Hello) + sizeof(WireHeader) && (next() & 1)) {
      Hello hello{kHelloMagic, kWireVersion, static_cast<int32_t>(next() % 10), 8, {}};
      if (next() & 1) std::memcpy(hello.secret, kSecret, kSecretBytes);
      std::memcpy(buffer, &hello, sizeof(hello));
      WireHeader header{kDataMagic, static_cast<uint32_t>(next() % 3), next(), next() % 600};
      std::memcpy(buffer + sizeof(Hello), &header, sizeof(header));
    }
    LLVMFuzzerTestOneInput(buffer, size);
  }
  std::printf("Done %ld runs (standalone random-mutation driver)\n", runs);
  return 0;
}
#endif
