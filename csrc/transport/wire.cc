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

HandshakeKey handshakeKey(const void* secret, size_t bytes, const uint8_t* group, bool stretch) {
  static const char kLabel[] = "pycomm handshake key";
  HandshakeKey key;
  if (!stretch) {
    hmacSha256(secret, bytes, kLabel, sizeof(kLabel) - 1, key.bytes);
    return key;
  }
  uint8_t salt[sizeof(kLabel) - 1 + kGroupIdBytes];
  std::memcpy(salt, kLabel, sizeof(kLabel) - 1);
  std::memcpy(salt + sizeof(kLabel) - 1, group, kGroupIdBytes);
  pbkdf2Sha256(secret, bytes, salt, sizeof(salt), kSecretStretchRounds, key.bytes, sizeof(key.bytes));
  return key;
}

void handshakeMac(const HandshakeKey& key, HandshakeRole role, const uint8_t* group, int size, int connectorRank,
                  int acceptorRank, const uint8_t* nonceC, const uint8_t* nonceA, uint32_t wire, uint8_t* mac) {
  // The label's length differs by role, so neither transcript is a prefix of the other.
  // The label names the wire version, so a MAC never serves another version's handshake.
  const std::string label =
      strCat("pycomm/", kWireVersion, role == HandshakeRole::kAcceptor ? " acceptor" : " connector");
  HmacSha256 hmac(key.bytes, sizeof(key.bytes));
  hmac.update(label.c_str(), label.size() + 1);  // with its NUL
  hmac.update(group, kGroupIdBytes);
  appendInt(hmac, size);
  appendInt(hmac, connectorRank);
  appendInt(hmac, acceptorRank);
  hmac.update(nonceC, kNonceBytes);
  hmac.update(nonceA, kNonceBytes);
  appendInt(hmac, static_cast<int32_t>(wire));
  hmac.final(mac);
}

SessionKeys sessionKeys(const HandshakeKey& key, HandshakeRole role, const Hello& hello, const uint8_t* nonceA) {
  uint8_t salt[2 * kNonceBytes];
  std::memcpy(salt, hello.nonce, kNonceBytes);
  std::memcpy(salt + kNonceBytes, nonceA, kNonceBytes);
  auto derive = [&](const char* direction, uint8_t* out) {
    std::string info = strCat("pycomm/", kWireVersion, " frames ", direction);
    info.push_back('\0');
    info.append(reinterpret_cast<const char*>(hello.group), kGroupIdBytes);
    for (int32_t v : {hello.size, hello.rank, hello.peer, static_cast<int32_t>(hello.stream)})
      for (int b = 0; b < 4; ++b) info.push_back(static_cast<char>(static_cast<uint32_t>(v) >> (8 * b)));
    hkdfSha256(key.bytes, sizeof(key.bytes), salt, sizeof(salt), info.data(), info.size(), out, kKeyBytes);
  };
  SessionKeys keys;
  const bool connector = role == HandshakeRole::kConnector;
  derive("connector->acceptor", connector ? keys.send : keys.recv);
  derive("acceptor->connector", connector ? keys.recv : keys.send);
  return keys;
}

void beginFrame(HmacSha256& mac, uint64_t sequence, FrameKind kind) {
  mac.reset();
  uint8_t prefix[9];
  for (int b = 0; b < 8; ++b) prefix[b] = static_cast<uint8_t>(sequence >> (8 * b));
  prefix[8] = static_cast<uint8_t>(kind);
  mac.update(prefix, sizeof(prefix));
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
  if (hello.stream >= static_cast<uint32_t>(kMaxStreams) || hello.reserved != 0 || hello.wire > kWireIntegrity)
    return "malformed hello";
  if (std::memcmp(hello.group, group, kGroupIdBytes) != 0) return "peer belongs to another group";
  return "";
}

std::string checkChallenge(const Challenge& challenge, const Hello& hello, const HandshakeKey& key) {
  if (challenge.magic != kChallengeMagic) return "it answered with something that is not a pycomm handshake";
  if (challenge.version != kWireVersion)
    return strCat("it speaks wire version ", challenge.version, ", this rank ", kWireVersion);
  uint8_t expected[kMacBytes];
  // The acceptor's MAC names its own wire mode: one that differs from this rank's fails here.
  handshakeMac(key, HandshakeRole::kAcceptor, hello.group, hello.size, hello.rank, hello.peer, hello.nonce,
               challenge.nonce, hello.wire, expected);
  if (!constantTimeEqual(expected, challenge.mac, kMacBytes))
    return "it does not prove this job's secret (are PYCOMM_SECRET and PYCOMM_WIRE the same on every rank?)";
  return "";
}

std::string checkProof(const Proof& proof, const Hello& hello, const Challenge& challenge, int localRank,
                       const HandshakeKey& key) {
  if (proof.magic != kProofMagic || proof.reserved != 0) return "malformed handshake proof";
  uint8_t expected[kMacBytes];
  handshakeMac(key, HandshakeRole::kConnector, hello.group, hello.size, hello.rank, localRank, hello.nonce,
               challenge.nonce, hello.wire, expected);
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
