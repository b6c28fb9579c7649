// The TCP transport's wire format and its validation (torch-free, fuzzed by
// tests/fuzz/fuzz_wire.cc).
//
// Connection setup: a mutual challenge-response under the job's handshake key
// (derived from PYCOMM_SECRET, or from the random secret rank 0 puts in the
// store when it is unset); the key itself never crosses the wire.
//   connector -> acceptor  Hello     {magic, version, rank, size, peer, stream, group id, nonce_c}
//   acceptor  -> connector Challenge {magic, version, nonce_a, MAC("acceptor", ...)}
//   connector -> acceptor  Proof     {magic, MAC("connector", ...)}
// where MAC(role, ...) = HMAC-SHA256(key, "pycomm/<kWireVersion> " role | group id | size |
// connector rank | acceptor rank | nonce_c | nonce_a). The connector checks the
// acceptor's MAC before it proves anything; the acceptor counts a connection as
// rank r's only once its proof checks, so a claimant that cannot prove the key
// blocks nobody. The labels differ, so one side's MAC never serves as the other's.
//
// Each pair of ranks has socketsPerPeer such connections (streams), each with
// its own handshake; `stream` says which one it is (rank 0 publishes the count).
//
// After that, each message is a WireHeader on stream 0 followed by its first
// stripe (with wire integrity, each followed by its frame MAC, below); stripe k (k > 0) follows, without a header, on stream k, in the order
// of the headers on stream 0. A message has stripeCount(bytes, streams) stripes
// (one, the whole payload, for anything under 2 x kMinStripeBytes).
// A header with kFlagAbort carries, as its payload, the reason the sender's
// group failed; the receiver fails that peer with that reason, so every
// survivor can name the rank that was lost first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {

constexpr uint32_t kDataMagic = 0x50434d44;       // "PCMD"
constexpr uint32_t kHelloMagic = 0x50434d48;      // "PCMH"
constexpr uint32_t kChallengeMagic = 0x50434d43;  // "PCMC"
constexpr uint32_t kProofMagic = 0x50434d50;      // "PCMP"
// 4: every frame authenticated under per-connection keys (wire integrity); the
// hello says which wire mode the connector runs. 3: several streams per pair (the
// hello's stream index). 2: challenge-response handshake (1 sent the secret in the hello).
constexpr uint32_t kWireVersion = 4;
// Wire modes (PYCOMM_WIRE), in the hello and in both handshake MACs, so ranks
// that differ (or a relay that rewrote the hello) fail the handshake.
constexpr uint32_t kWireNone = 0;       // frames as they are
constexpr uint32_t kWireIntegrity = 1;  // every frame followed by its MAC
constexpr uint32_t kFlagAbort = 1u << 0;
constexpr uint32_t kKnownFlags = kFlagAbort;
// Larger than any tensor a host can hold; bounds what a corrupt header can ask for.
constexpr uint64_t kMaxMessageBytes = 1ull << 46;
constexpr uint64_t kMaxAbortReasonBytes = 4096;
constexpr size_t kSecretBytes = 16;   // the random secret rank 0 draws without PYCOMM_SECRET
constexpr size_t kMinSecretBytes = 16;  // the shortest PYCOMM_SECRET accepted
// PBKDF2-HMAC-SHA256 rounds that stretch PYCOMM_SECRET into the handshake key (salted
// with the group id), so each offline guess at a weak secret costs this many HMACs.
constexpr uint32_t kSecretStretchRounds = 20000;
constexpr size_t kGroupIdBytes = 16;  // random per group (rank 0 draws it; not secret)
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;      // HMAC-SHA256
constexpr size_t kKeyBytes = 32;
constexpr int kMaxStreams = 16;                // sockets per pair of ranks, at most
constexpr uint64_t kMinStripeBytes = 64 << 10; // a message is striped only in parts at least this large

// How many stripes a message of `bytes` has over `streams` streams.
inline int stripeCount(uint64_t bytes, int streams) {
  const uint64_t parts = bytes / kMinStripeBytes;
  return parts < 2 || streams < 2 ? 1 : static_cast<int>(parts < uint64_t(streams) ? parts : uint64_t(streams));
}
// Where stripe `i` of `count` starts (stripe i ends where i + 1 starts; stripe
// `count` starts at `bytes`). Equal parts rounded up to 4 KiB, the last one
// shorter; never empty, since each part is at least kMinStripeBytes.
inline uint64_t stripeOffset(uint64_t bytes, int count, int i) {
  if (i >= count) return bytes;
  const uint64_t part = ((bytes + count - 1) / count + 4095) & ~uint64_t(4095);
  const uint64_t offset = part * static_cast<uint64_t>(i);
  return offset < bytes ? offset : bytes;
}

struct WireHeader {
  uint32_t magic;
  uint32_t flags;
  uint64_t tag;
  uint64_t bytes;
};
static_assert(sizeof(WireHeader) == 24, "wire header layout");

struct Hello {
  uint32_t magic;     // kHelloMagic
  uint32_t version;   // kWireVersion
  int32_t rank;       // the connector's (claimed) rank
  int32_t size;       // of the group
  int32_t peer;       // the rank the connector means to reach
  uint32_t stream;    // which of the pair's streams (< kMaxStreams)
  uint8_t group[kGroupIdBytes];
  uint8_t nonce[kNonceBytes];  // nonce_c
  uint32_t wire;      // the connector's wire mode (kWireNone, kWireIntegrity)
  uint32_t reserved;  // 0
};
static_assert(sizeof(Hello) == 64, "hello layout");

struct Challenge {
  uint32_t magic;    // kChallengeMagic
  uint32_t version;  // kWireVersion
  uint8_t nonce[kNonceBytes];  // nonce_a
  uint8_t mac[kMacBytes];      // the acceptor's MAC
};
static_assert(sizeof(Challenge) == 56, "challenge layout");

struct Proof {
  uint32_t magic;     // kProofMagic
  uint32_t reserved;  // 0
  uint8_t mac[kMacBytes];  // the connector's MAC
};
static_assert(sizeof(Proof) == 40, "proof layout");

// The key both ends of a connection prove they hold, derived from a secret
// (PYCOMM_SECRET's text, stretched with PBKDF2 salted by the group id; or the
// store secret's random bytes, not stretched).
struct HandshakeKey {
  uint8_t bytes[kKeyBytes];
};
HandshakeKey handshakeKey(const void* secret, size_t bytes, const uint8_t* group, bool stretch);

enum class HandshakeRole { kAcceptor, kConnector };

// What each side sends as its MAC (see the top of this file); `wire` is the
// sender's own wire mode.
void handshakeMac(const HandshakeKey& key, HandshakeRole role, const uint8_t* group, int size, int connectorRank,
                  int acceptorRank, const uint8_t* nonceC, const uint8_t* nonceA, uint32_t wire, uint8_t* mac);

// Per-connection keys of wire integrity, one per direction: HKDF-SHA256 of the
// handshake key, salted with both nonces, bound to the group, both ranks and the
// stream. A relay that forwarded the handshake knows the nonces but not the key.
struct SessionKeys {
  uint8_t send[kKeyBytes];
  uint8_t recv[kKeyBytes];
};
SessionKeys sessionKeys(const HandshakeKey& key, HandshakeRole role, const Hello& hello, const uint8_t* nonceA);

// Frame MACs (wire integrity): each frame (a header, or one stripe's payload) is
// followed by HMAC-SHA256(session key, sequence number | kind | bytes), the
// sequence number counting the frames of that direction of that stream, so a
// frame altered, dropped, replayed or reordered fails its check.
constexpr size_t kFrameTagBytes = kMacBytes;
enum class FrameKind : uint8_t { kHeader = 1, kPayload = 2 };
// Starts a frame's MAC on `mac` (a context keyed with the session key).
class HmacSha256;
void beginFrame(HmacSha256& mac, uint64_t sequence, FrameKind kind);

// "" when the header may be acted on; otherwise what is wrong with it.
std::string checkHeader(const WireHeader& header);

// Acceptor `localRank` of a group of `size` with id `group`: "" when `hello` is
// a well-formed greeting for it from a rank above it; otherwise why the
// connection is dropped. Proves nothing: the claimed rank is proven by the Proof.
std::string checkHello(const Hello& hello, int localRank, int size, const uint8_t* group);

// Connector `localRank`, which sent `hello` to rank hello.peer: "" when
// `challenge` is well formed and its MAC proves the acceptor holds `key`.
std::string checkChallenge(const Challenge& challenge, const Hello& hello, const HandshakeKey& key);

// Acceptor `localRank`, which answered `hello` with `challenge`: "" when `proof`
// shows the connector holds `key` (and so is rank hello.rank).
std::string checkProof(const Proof& proof, const Hello& hello, const Challenge& challenge, int localRank,
                       const HandshakeKey& key);

// The text an abort notice's payload carries, made printable and bounded.
std::string abortReasonText(const char* data, size_t bytes);

}  // namespace pycomm
