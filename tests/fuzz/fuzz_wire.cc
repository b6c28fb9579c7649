// Fuzz target for the TCP transport's wire parsing (csrc/transport/wire.h).
//
// The input is what peers could put on a connection: the three handshake
// messages (Hello, Challenge, Proof) as the acceptor and the connector each
// check them, then a stream of frames. The harness walks it as the transport
// does: a header is acted on only if checkHeader accepts it, an abort notice's
// payload goes through abortReasonText. It checks the invariants the
// transport relies on, among them that a challenge or proof is accepted
// exactly when it is well formed and carries the MAC only the key's holder can
// compute.
//
// libFuzzer:  clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc \
//               tests/fuzz/fuzz_wire.cc csrc/transport/wire.cc csrc/transport/hmac.cc -o fuzz_wire \
//               && ./fuzz_wire -runs=1000000
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

const char kSecretText[] = "fuzzing secret";
const uint8_t kGroup[kGroupIdBytes] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr int kSize = 8;

const HandshakeKey& fuzzKey() {
  static const HandshakeKey key = handshakeKey(kSecretText, sizeof(kSecretText) - 1, kGroup, false);
  return key;
}

void check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

// The handshake as the acceptor (rank localRank) and the connector see it.
void checkHandshake(const Hello& hello, const Challenge& challenge, const Proof& proof, int localRank) {
  const HandshakeKey& key = fuzzKey();
  const bool helloOk = checkHello(hello, localRank, kSize, kGroup).empty();
  if (helloOk) {
    check(hello.magic == kHelloMagic && hello.version == kWireVersion, "hello fields");
    check(hello.rank > localRank && hello.rank < kSize && hello.size == kSize, "hello rank range");
    check(hello.peer == localRank && hello.stream < static_cast<uint32_t>(kMaxStreams), "hello peer");
    check(std::memcmp(hello.group, kGroup, kGroupIdBytes) == 0, "hello group");
  }
  // The connector's view: it sent `hello`, got `challenge`.
  uint8_t acceptorMac[kMacBytes], connectorMac[kMacBytes];
  handshakeMac(key, HandshakeRole::kAcceptor, hello.group, hello.size, hello.rank, hello.peer, hello.nonce,
               challenge.nonce, hello.wire, acceptorMac);
  handshakeMac(key, HandshakeRole::kConnector, hello.group, hello.size, hello.rank, hello.peer, hello.nonce,
               challenge.nonce, hello.wire, connectorMac);
  check(std::memcmp(acceptorMac, connectorMac, kMacBytes) != 0, "the two roles' MACs differ");
  const bool challengeOk = checkChallenge(challenge, hello, key).empty();
  check(challengeOk == (challenge.magic == kChallengeMagic && challenge.version == kWireVersion &&
                        std::memcmp(challenge.mac, acceptorMac, kMacBytes) == 0),
        "a challenge is accepted exactly when well formed with the acceptor's MAC");
  // The acceptor's view (only reached after an accepted hello): it answered with `challenge`, got `proof`.
  if (helloOk) {
    const bool proofOk = checkProof(proof, hello, challenge, localRank, key).empty();
    check(proofOk == (proof.magic == kProofMagic && proof.reserved == 0 &&
                      std::memcmp(proof.mac, connectorMac, kMacBytes) == 0),
          "a proof is accepted exactly when well formed with the connector's MAC");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr size_t kHandshakeBytes = sizeof(Hello) + sizeof(Challenge) + sizeof(Proof);
  if (size >= kHandshakeBytes) {
    Hello hello;
    Challenge challenge;
    Proof proof;
    std::memcpy(&hello, data, sizeof(hello));
    std::memcpy(&challenge, data + sizeof(Hello), sizeof(challenge));
    std::memcpy(&proof, data + sizeof(Hello) + sizeof(Challenge), sizeof(proof));
    checkHandshake(hello, challenge, proof, hello.nonce[0] % 4);  // the acceptor's rank
    data += kHandshakeBytes;
    size -= kHandshakeBytes;
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
#include "standalone.h"
// A seeded mutation loop for machines without libFuzzer: random bytes, often
// shaped into a valid handshake (right fields, right MACs) and frames, then
// sometimes one byte flipped, so the accept and the reject paths both run.
int main(int argc, char** argv) {
  const long runs = pycomm_fuzz::runsFromArgs(argc, argv);
  pycomm_fuzz::Xorshift next(0x9e3779b97f4a7c15ull);
  constexpr size_t kHandshakeBytes = sizeof(Hello) + sizeof(Challenge) + sizeof(Proof);
  uint8_t buffer[768];
  long validHandshakes = 0;
  for (long run = 0; run < runs; ++run) {
    const size_t size = pycomm_fuzz::randomBytes(next, buffer, sizeof(buffer));
    if (size >= kHandshakeBytes + sizeof(WireHeader) && (next() % 4 != 0)) {
      Hello hello{kHelloMagic, kWireVersion, static_cast<int32_t>(next() % 10), kSize, 0, 0, {}, {}};
      for (auto& b : hello.nonce) b = static_cast<uint8_t>(next());
      const int localRank = hello.nonce[0] % 4;  // as the target picks it
      hello.peer = next() % 8 == 0 ? static_cast<int32_t>(next() % 10) : localRank;
      std::memcpy(hello.group, kGroup, kGroupIdBytes);
      if (next() % 8 == 0) hello.group[next() % kGroupIdBytes] ^= 1;
      Challenge challenge{kChallengeMagic, kWireVersion, {}, {}};
      for (auto& b : challenge.nonce) b = static_cast<uint8_t>(next());
      handshakeMac(fuzzKey(), HandshakeRole::kAcceptor, hello.group, hello.size, hello.rank, hello.peer,
                   hello.nonce, challenge.nonce, hello.wire, challenge.mac);
      Proof proof{kProofMagic, 0, {}};
      handshakeMac(fuzzKey(), HandshakeRole::kConnector, hello.group, hello.size, hello.rank, localRank,
                   hello.nonce, challenge.nonce, hello.wire, proof.mac);
      std::memcpy(buffer, &hello, sizeof(hello));
      std::memcpy(buffer + sizeof(Hello), &challenge, sizeof(challenge));
      std::memcpy(buffer + sizeof(Hello) + sizeof(Challenge), &proof, sizeof(proof));
      if (next() & 1) buffer[1 + next() % (kHandshakeBytes - 1)] ^= static_cast<uint8_t>(1u << (next() % 8));
      else ++validHandshakes;
      WireHeader header{kDataMagic, static_cast<uint32_t>(next() % 3), next(), next() % 600};
      std::memcpy(buffer + kHandshakeBytes, &header, sizeof(header));
    }
    LLVMFuzzerTestOneInput(buffer, size);
  }
  std::printf("Done %ld runs (standalone random-mutation driver; %ld with an unmutated handshake)\n", runs,
              validHandshakes);
  return 0;
}
#endif
