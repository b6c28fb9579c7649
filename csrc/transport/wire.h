// The TCP transport's wire format and its validation (torch-free, fuzzed by
// tests/fuzz/fuzz_wire.cc).
//
// Connection setup: the connecting (higher) rank sends a Hello carrying the
// job secret every rank read from the store; the accepting rank drops any
// connection whose hello is malformed, from an unexpected rank, or without the
// secret. After that, each message is a WireHeader followed by `bytes` payload
// bytes. A header with kFlagAbort carries, as its payload, the reason the
// sender's group failed; the receiver fails that peer with that reason, so
// every survivor can name the rank that was lost first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {

constexpr uint32_t kDataMagic = 0x50434d44;   // "PCMD"
constexpr uint32_t kHelloMagic = 0x50434d48;  // "PCMH"
constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kFlagAbort = 1u << 0;
constexpr uint32_t kKnownFlags = kFlagAbort;
// Larger than any tensor a host can hold; bounds what a corrupt header can ask for.
constexpr uint64_t kMaxMessageBytes = 1ull << 46;
constexpr uint64_t kMaxAbortReasonBytes = 4096;
constexpr size_t kSecretBytes = 16;

struct WireHeader {
  uint32_t magic;
  uint32_t flags;
  uint64_t tag;
  uint64_t bytes;
};
static_assert(sizeof(WireHeader) == 24, "wire header layout");

struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t size;
  uint8_t secret[kSecretBytes];
};
static_assert(sizeof(Hello) == 32, "hello layout");

// "" when the header may be acted on; otherwise what is wrong with it.
std::string checkHeader(const WireHeader& header);

// "" when `hello` is a valid greeting from a rank above `localRank` in a group of
// `size` that knows `secret`; otherwise why the connection is dropped.
std::string checkHello(const Hello& hello, int localRank, int size, const uint8_t* secret);

// The text an abort notice's payload carries, made printable and bounded.
std::string abortReasonText(const char* data, size_t bytes);

}  // namespace pycomm
