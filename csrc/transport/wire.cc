#include "transport/wire.h"

#include <cstring>

#include "common/error.h"
#include "transport/hmac.h"

namespace pycomm {
namespace {

void appendInt(HmacSha256& mac, int32_t value) {
  const uint32_t v = static_cast<uint32_t>(value);
  const uint8_t bytes[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v >> 16),
                            static_cast<uint8_t>(v >> 24)};
  mac.update(bytes, sizeof(bytes));
}

}  // namespace

HandshakeKey handshakeKey(const void* secret, size_t bytes) {
  static const char kLabel[] = "pycomm handshake key";
  HandshakeKey key;
  hmacSha256(secret, bytes, kLabel, sizeof(kLabel) - 1, key.bytes);
  return key;
}

void handshakeMac(const HandshakeKey& key, HandshakeRole role, const uint8_t* group, int size, int connectorRank,
                  int acceptorRank, const uint8_t* nonceC, const uint8_t* nonceA, uint8_t* mac) {
  // The label's length differs by role, so neither transcript is a prefix of the other.
  const char* label = role == HandshakeRole::kAcceptor ? "pycomm/2 acceptor" : "pycomm/2 connector";
  HmacSha256 hmac(key.bytes, sizeof(key.bytes));
  hmac.update(label, std::strlen(label) + 1);  // with its NUL
  hmac.update(group, kGroupIdBytes);
  appendInt(hmac, size);
  appendInt(hmac, connectorRank);
  appendInt(hmac, acceptorRank);
  hmac.update(nonceC, kNonceBytes);
  hmac.update(nonceA, kNonceBytes);
  hmac.final(mac);
}

std::string checkHeader(const WireHeader& header) {
  if (header.magic != kDataMagic) return "received a corrupt message header";
  if ((header.flags & ~kKnownFlags) != 0)
    return strCat("received a message with unknown flags 0x", std::hex, header.flags);
  if (header.bytes > kMaxMessageBytes)
    return strCat("received a header announcing ", header.bytes, " bytes (corrupt stream?)");
  if ((header.flags & kFlagAbort) && header.bytes > kMaxAbortReasonBytes)
    return "received an oversized abort notice";
  return "";
}

std::string checkHello(const Hello& hello, int localRank, int size, const uint8_t* group) {
  if (hello.magic != kHelloMagic) return "not a pycomm peer (bad hello)";
  if (hello.version != kWireVersion)
    return strCat("peer speaks wire version ", hello.version, ", this rank ", kWireVersion);
  if (hello.size != size) return strCat("peer belongs to a group of ", hello.size, " ranks");
  if (hello.rank <= localRank || hello.rank >= size)
    return strCat("peer claims rank ", hello.rank, ", expected one in (", localRank, ", ", size, ")");
  if (hello.peer != localRank) return strCat("peer meant to reach rank ", hello.peer);
  if (hello.stream >= static_cast<uint32_t>(kMaxStreams)) return "malformed hello";
  if (std::memcmp(hello.group, group, kGroupIdBytes) != 0) return "peer belongs to another group";
  return "";
}

std::string checkChallenge(const Challenge& challenge, const Hello& hello, const HandshakeKey& key) {
  if (challenge.magic != kChallengeMagic) return "it answered with something that is not a pycomm handshake";
  if (challenge.version != kWireVersion)
    return strCat("it speaks wire version ", challenge.version, ", this rank ", kWireVersion);
  uint8_t expected[kMacBytes];
  handshakeMac(key, HandshakeRole::kAcceptor, hello.group, hello.size, hello.rank, hello.peer, hello.nonce,
               challenge.nonce, expected);
  if (!constantTimeEqual(expected, challenge.mac, kMacBytes))
    return "it does not prove this job's secret (is PYCOMM_SECRET the same on every rank?)";
  return "";
}

std::string checkProof(const Proof& proof, const Hello& hello, const Challenge& challenge, int localRank,
                       const HandshakeKey& key) {
  if (proof.magic != kProofMagic || proof.reserved != 0) return "malformed handshake proof";
  uint8_t expected[kMacBytes];
  handshakeMac(key, HandshakeRole::kConnector, hello.group, hello.size, hello.rank, localRank, hello.nonce,
               challenge.nonce, expected);
  if (!constantTimeEqual(expected, proof.mac, kMacBytes))
    return strCat("peer claiming rank ", hello.rank, " does not prove this job's secret");
  return "";
}

std::string abortReasonText(const char* data, size_t bytes) {
  std::string text;
  const size_t n = bytes < kMaxAbortReasonBytes ? bytes : kMaxAbortReasonBytes;
  text.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(data[i]);
    text.push_back(c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?');
  }
  return text;
}

}  // namespace pycomm
