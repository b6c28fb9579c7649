// Fuzz target for the TCP transport's authenticated frame decoder: a real
// TcpTransport (rank 0 of 2, csrc/transport/tcp*.cc) reads what the harness,
// playing rank 1 over a loopback socket, writes to it. The harness takes the
// store's group id and secret (as any member could), first opens a junk
// connection to rank 0's listener that sends hostile handshake bytes, then
// connects for real (Hello, Challenge checked, Proof), derives the session keys
// and writes frames: WireHeader + its frame MAC, payload + its frame MAC (wire
// version 4), with fields, payloads and corruptions chosen by the input, while
// rank 0 posts receives the input chooses. Then it closes the connection and
// waits for every receive to settle.
//
// Checks beyond ASan/UBSan: every receive settles (no hang); a receive that
// completes holds exactly the payload of a frame rank 1 sent with that tag and
// a fitting size; and, with wire integrity, that frame and every frame before it
// on the stream had correct MACs and sequence numbers (a frame altered,
// replayed or preceded by raw bytes never delivers anything, nor does any frame
// after it). A failed receive names rank 1.
//
// Input: byte 0 = options (bit 0: PYCOMM_WIRE=none; bits 1-2: the unexpected-
// message budgets), byte 1 = junk handshake length, that many junk bytes, then
// operations until the input ends (see the switch below).
//
// Build: make fuzz (libFuzzer, -fsanitize=fuzzer,address,undefined).
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/hmac.h"
#include "transport/memory_store.h"
#include "transport/tcp.h"
#include "transport/wire.h"
#include "fuzz_input.h"

using namespace pycomm;

using pycomm_fuzz::check;
using pycomm_fuzz::Reader;

namespace {

bool fromHex(const std::string& text, uint8_t* out, size_t bytes) {
  if (text.size() < 2 * bytes) return false;
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(std::stoi(text.substr(2 * i, 2), nullptr, 16));
  return true;
}

int connectTo(const std::string& entry) {
  const auto space = entry.rfind(' ');
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(std::atoi(entry.c_str() + space + 1)));
  inet_pton(AF_INET, entry.substr(0, space).c_str(), &address.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  check(fd >= 0, "socket");
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    // libFuzzer's timeout alarm (SIGALRM) may interrupt it: the connect goes on; wait for it.
    check(errno == EINTR, "connect to rank 0");
    pollfd p{fd, POLLOUT, 0};
    while (::poll(&p, 1, -1) < 0) check(errno == EINTR, "poll");
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    check(error == 0, "connect to rank 0");
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void writeAll(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's timeout alarm
    if (n <= 0) return;  // rank 0 dropped the connection: what is left is not read anyway
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

bool readAll(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's timeout alarm
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// Closes with a reset, not a FIN, so no TIME_WAIT piles up over many runs.
void closeNow(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  ::close(fd);
}

// A frame rank 1 sent, and whether rank 0 may act on it.
struct Sent {
  uint64_t tag;
  std::vector<uint8_t> payload;
  bool deliverable;
};

struct Posted {
  RequestPtr request;
  uint64_t tag;
  size_t bytes;
  bool upTo;
  std::vector<uint8_t> buffer;
};

// Tags from a small set, so that receives and frames meet; the collective bit
// and the call bits (transport.h) now and then.
uint64_t pickTag(uint8_t v) {
  constexpr uint64_t kCollective = 1ull << 63;
  static const uint64_t kTags[] = {0, 1, 2, 7, kCollective, kCollective | 1, kCollective | (uint64_t{5} << kCallTagShift),
                                   kCollective | kCreditTagBit};
  return kTags[v % 8];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const uint8_t options = static_cast<uint8_t>(in.next(1));
  MemoryStore store(std::chrono::seconds(10));
  TcpOptions tcp;
  tcp.connectTimeout = std::chrono::seconds(10);
  // An authentic header may announce up to the budget before its payload's MAC is
  // checked; 1 MiB keeps that inside the fuzzer's memory limit.
  tcp.maxUnexpectedBytes = 1 << 20;
  tcp.wire = (options & 1) ? kWireNone : kWireIntegrity;
  const bool integrity = tcp.wire == kWireIntegrity;
  if (options & 2) tcp.maxUnexpectedBytes = 64;    // small budgets: the parking paths
  if (options & 4) tcp.maxUnexpectedMessages = 2;
  std::unique_ptr<TcpTransport> victim;
  std::string constructError;
  std::thread building([&] {
    try {
      victim = std::make_unique<TcpTransport>(0, 2, store, tcp);
    } catch (const std::exception& e) {
      constructError = e.what();
    }
  });

  // What any member reads from the store: the group id and the store secret.
  uint8_t group[kGroupIdBytes], secret[kSecretBytes];
  check(fromHex(store.get("group"), group, sizeof(group)), "group id");
  check(fromHex(store.get("secret"), secret, sizeof(secret)), "store secret");
  const HandshakeKey key = handshakeKey(secret, sizeof(secret), group, false);
  const std::string address = store.get("addr/0");

  // A junk connection first: hostile handshake bytes, left open while the real one runs.
  const size_t junkBytes = static_cast<size_t>(in.next(1)) % 160;
  int junk = -1;
  if (junkBytes > 0) {
    std::vector<uint8_t> bytes = in.take(junkBytes);
    if (bytes.size() >= sizeof(Hello) && (bytes[0] & 1)) {  // often a plausible hello, so the proof is read
      Hello hello{kHelloMagic, kWireVersion, 1, 2, 0, 0, {}, {}, tcp.wire, 0};
      std::memcpy(hello.group, group, sizeof(group));
      std::memcpy(hello.nonce, bytes.data() + 8, kNonceBytes);
      std::memcpy(bytes.data(), &hello, sizeof(hello));
    }
    junk = connectTo(address);
    writeAll(junk, bytes.data(), bytes.size());
  }

  // The real handshake, as rank 1.
  int fd = connectTo(address);
  Hello hello{kHelloMagic, kWireVersion, 1, 2, 0, 0, {}, {}, tcp.wire, 0};
  std::memcpy(hello.group, group, sizeof(group));
  randomBytes(hello.nonce, sizeof(hello.nonce));
  writeAll(fd, &hello, sizeof(hello));
  Challenge challenge;
  check(readAll(fd, &challenge, sizeof(challenge)), "rank 0 answers the hello");
  check(checkChallenge(challenge, hello, key).empty(), "rank 0 proves the key");
  Proof proof{kProofMagic, 0, {}};
  handshakeMac(key, HandshakeRole::kConnector, group, 2, 1, 0, hello.nonce, challenge.nonce, tcp.wire, proof.mac);
  writeAll(fd, &proof, sizeof(proof));
  building.join();
  check(victim != nullptr, constructError.c_str());
  if (junk >= 0) closeNow(junk);

  const SessionKeys keys = sessionKeys(key, HandshakeRole::kConnector, hello, challenge.nonce);
  HmacSha256 mac(keys.send, sizeof(keys.send));
  uint64_t sequence = 0;
  auto frameTag = [&](FrameKind kind, const void* bytes, size_t n, uint8_t* tag) {
    beginFrame(mac, sequence++, kind);
    mac.update(bytes, n);
    mac.final(tag);
  };

  std::vector<Sent> sent;
  std::vector<Posted> posted;
  bool intact = true;  // every byte written so far is a well-formed, correctly tagged frame
  uint16_t frameNumber = 0;
  while (!in.done()) {
    const uint8_t op = static_cast<uint8_t>(in.next(1));
    switch (op % 5) {
      case 0: {  // rank 0 posts a receive
        Posted p;
        p.tag = pickTag(static_cast<uint8_t>(in.next(1)));
        const uint8_t shape = static_cast<uint8_t>(in.next(1));
        p.bytes = static_cast<size_t>(in.next(1)) * ((shape & 1) ? 4 : 1);
        p.upTo = shape & 2;
        p.buffer.assign(p.bytes, 0xee);
        const int peer = (shape & 4) ? kAnySource : 1;
        p.request = victim->irecv(peer, p.tag, p.buffer.data(), p.bytes, p.upTo);
        posted.push_back(std::move(p));
        break;
      }
      case 1:
      case 2: {  // a message (header + payload), each frame with its MAC unless the input corrupts it
        const uint8_t shape = static_cast<uint8_t>(in.next(1));
        WireHeader header{kDataMagic, 0, pickTag(static_cast<uint8_t>(in.next(1))), 0};
        std::vector<uint8_t> payload = in.take(static_cast<size_t>(in.next(1)) * ((shape & 1) ? 4 : 1));
        if (payload.size() >= 2) std::memcpy(payload.data(), &frameNumber, 2);  // tells frames apart
        ++frameNumber;
        header.bytes = payload.size();
        if (shape & 2) header.bytes = in.next(8);  // a length that lies
        if (shape & 4) header.flags = static_cast<uint32_t>(in.next(1));
        if (shape & 8) header.magic ^= 1u << (in.next(1) % 32);
        uint8_t headerTag[kFrameTagBytes], payloadTag[kFrameTagBytes];
        frameTag(FrameKind::kHeader, &header, sizeof(header), headerTag);
        frameTag(FrameKind::kPayload, payload.data(), payload.size(), payloadTag);
        const uint8_t corrupt = static_cast<uint8_t>(in.next(1));
        bool tampered = false;
        if (corrupt & 0x10) {  // one bit of the header, its tag, the payload or its tag flipped
          const uint8_t where = static_cast<uint8_t>(in.next(1));
          const uint8_t bit = static_cast<uint8_t>(1u << (where % 8));
          switch ((corrupt >> 5) % 4) {
            case 0: reinterpret_cast<uint8_t*>(&header)[where % sizeof(header)] ^= bit; break;
            case 1: headerTag[where % kFrameTagBytes] ^= bit; break;
            case 2:
              if (!payload.empty()) payload[where % payload.size()] ^= bit;
              else payloadTag[0] ^= bit;
              break;
            default: payloadTag[where % kFrameTagBytes] ^= bit; break;
          }
          tampered = true;
        }
        if (corrupt & 0x80) --sequence;  // the next frame reuses a sequence number: a replay
        const bool wellFormed = checkHeader(header).empty() && header.bytes == payload.size();
        const bool abortNotice = header.flags & kFlagAbort;
        if (wellFormed && !abortNotice)
          sent.push_back({header.tag, payload, intact && !tampered});
        writeAll(fd, &header, sizeof(header));
        if (integrity) writeAll(fd, headerTag, sizeof(headerTag));
        writeAll(fd, payload.data(), payload.size());
        if (integrity) writeAll(fd, payloadTag, sizeof(payloadTag));
        if (tampered || !wellFormed) intact = false;
        if (corrupt & 0x80) intact = false;
        break;
      }
      case 3: {  // raw bytes: the stream out of step
        std::vector<uint8_t> raw = in.take(static_cast<size_t>(in.next(1)) % 64);
        writeAll(fd, raw.data(), raw.size());
        if (!raw.empty()) intact = false;
        break;
      }
      default: {  // a pause, so that receives and arrivals interleave both ways
        std::this_thread::sleep_for(std::chrono::microseconds(50 * (in.next(1) % 4)));
        break;
      }
    }
  }
  // Rank 1 leaves: rank 0 reads what is left, then fails the peer. A rank 0 that
  // parked the stream (no receive for what came, no budget) does not read the end:
  // after a short wait the connection is reset, which it sees parked or not.
  ::shutdown(fd, SHUT_WR);
  auto settled = [&](Clock::time_point deadline) {
    for (Posted& p : posted)
      if (!p.request->waitUntil(deadline)) return false;
    return true;
  };
  if (!settled(Clock::now() + std::chrono::milliseconds(100))) {
    closeNow(fd);
    fd = -1;
    check(settled(Clock::now() + std::chrono::seconds(20)), "every receive completes or fails once the peer left");
  }
  // With wire integrity every completed receive holds a frame that was sent intact
  // (and all before it intact); without, only a stream that was intact throughout is checked.
  const bool checkContents = integrity || intact;
  for (Posted& p : posted) {
    if (p.request->failed()) {
      check(p.request->error().find("rank 1") != std::string::npos, "a failed receive names rank 1");
      continue;
    }
    if (!checkContents) continue;
    bool deliverable = false, any = false;
    for (const Sent& s : sent) {
      if (s.tag != p.tag || (p.upTo ? s.payload.size() > p.bytes : s.payload.size() != p.bytes)) continue;
      if (!s.payload.empty() && std::memcmp(s.payload.data(), p.buffer.data(), s.payload.size()) != 0) continue;
      any = true;
      deliverable = deliverable || s.deliverable;
    }
    check(any, "a completed receive holds a payload rank 1 sent with its tag and size");
    check(deliverable, "a tampered frame, or one after it, was delivered");
  }
  victim.reset();
  if (fd >= 0) closeNow(fd);
  return 0;
}
