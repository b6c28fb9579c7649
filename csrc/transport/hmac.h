// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the TCP transport's
// connection handshake (wire.h), plus a constant-time comparison. Torch-free,
// no OpenSSL; checked against the NIST and RFC 4231 vectors
// (tests/cpp/hmac_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {

constexpr size_t kSha256Bytes = 32;

// Incremental SHA-256: update() any number of times, then final() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  void final(uint8_t digest[kSha256Bytes]);

 private:
  void block(const uint8_t* data);
  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t totalBytes_ = 0;
};

void sha256(const void* data, size_t bytes, uint8_t digest[kSha256Bytes]);

// Incremental HMAC-SHA256 under `key` (any length; keys over 64 bytes are hashed first).
class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t keyBytes);
  void update(const void* data, size_t bytes) { inner_.update(data, bytes); }
  void final(uint8_t mac[kSha256Bytes]);

 private:
  Sha256 inner_;
  uint8_t outerPad_[64];
};

void hmacSha256(const void* key, size_t keyBytes, const void* data, size_t bytes, uint8_t mac[kSha256Bytes]);

// True when the `bytes` bytes at a and b are equal; the time taken does not
// depend on where they differ.
bool constantTimeEqual(const void* a, const void* b, size_t bytes);

}  // namespace pycomm
