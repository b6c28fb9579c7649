// The TCP transport's cryptography, one seam over OpenSSL's libcrypto:
// SHA-256 and HMAC-SHA256 (EVP_MD / EVP_MAC), HKDF and PBKDF2 (EVP_KDF), a
// constant-time comparison (CRYPTO_memcmp) and random bytes (RAND_bytes).
// Nothing here is hand-written cryptography; tests/cpp/hmac_test.cc checks the
// seam against the NIST, RFC 4231 (HMAC), RFC 5869 (HKDF) and RFC 7914 /
// RFC 6070-style (PBKDF2-HMAC-SHA256) vectors. Torch-free; link with -lcrypto.
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
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t bytes);
  void final(uint8_t digest[kSha256Bytes]);

 private:
  void* ctx_;  // EVP_MD_CTX
};

void sha256(const void* data, size_t bytes, uint8_t digest[kSha256Bytes]);

// Incremental HMAC-SHA256 under `key` (any length).
class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t keyBytes);
  ~HmacSha256();
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;
  void update(const void* data, size_t bytes);
  void final(uint8_t mac[kSha256Bytes]);
  // Starts a new MAC under the same key (cheaper than constructing another).
  void reset();

 private:
  void* ctx_;  // EVP_MAC_CTX
};

void hmacSha256(const void* key, size_t keyBytes, const void* data, size_t bytes, uint8_t mac[kSha256Bytes]);

// HKDF-SHA256 (RFC 5869): `outBytes` bytes of key from input key material
// `ikm`, `salt` and `info`.
void hkdfSha256(const void* ikm, size_t ikmBytes, const void* salt, size_t saltBytes, const void* info,
                size_t infoBytes, uint8_t* out, size_t outBytes);

// PBKDF2-HMAC-SHA256 (RFC 8018) with `iterations` rounds.
void pbkdf2Sha256(const void* password, size_t passwordBytes, const void* salt, size_t saltBytes,
                  uint32_t iterations, uint8_t* out, size_t outBytes);

// True when the `bytes` bytes at a and b are equal; the time taken does not
// depend on where they differ.
bool constantTimeEqual(const void* a, const void* b, size_t bytes);

// `bytes` unpredictable bytes from the library's CSPRNG; throws on failure.
void randomBytes(uint8_t* data, size_t bytes);

}  // namespace pycomm
