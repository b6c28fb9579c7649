#include "transport/hmac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "common/error.h"

namespace pycomm {
namespace {

[[noreturn]] void fail(const char* what) {
  const unsigned long code = ERR_get_error();
  char text[256] = "no detail";
  if (code != 0) ERR_error_string_n(code, text, sizeof(text));
  throwError(ErrorKind::kInternal, "pycomm: libcrypto ", what, " failed (", text, ")");
}

void check(int ok, const char* what) {
  if (ok != 1) fail(what);
}

// Fetched once: the default provider's SHA-256, HMAC and KDF implementations.
const EVP_MD* sha256Md() {
  static EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  if (md == nullptr) fail("EVP_MD_fetch(SHA256)");
  return md;
}

EVP_MAC* hmacAlgorithm() {
  static EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (mac == nullptr) fail("EVP_MAC_fetch(HMAC)");
  return mac;
}

void deriveKey(const char* algorithm, OSSL_PARAM* params, uint8_t* out, size_t outBytes) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, algorithm, nullptr);
  if (kdf == nullptr) fail("EVP_KDF_fetch");
  EVP_KDF_CTX* ctx = EVP_KDF_CTX_new(kdf);
  EVP_KDF_free(kdf);
  if (ctx == nullptr) fail("EVP_KDF_CTX_new");
  const int ok = EVP_KDF_derive(ctx, out, outBytes, params);
  EVP_KDF_CTX_free(ctx);
  check(ok, algorithm);
}

}  // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (ctx_ == nullptr) fail("EVP_MD_CTX_new");
  if (EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), sha256Md(), nullptr) != 1) {
    EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
    fail("EVP_DigestInit_ex");
  }
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::update(const void* data, size_t bytes) {
  check(EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, bytes), "EVP_DigestUpdate");
}

void Sha256::final(uint8_t digest[kSha256Bytes]) {
  unsigned int length = 0;
  check(EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), digest, &length), "EVP_DigestFinal_ex");
}

void sha256(const void* data, size_t bytes, uint8_t digest[kSha256Bytes]) {
  Sha256 hash;
  hash.update(data, bytes);
  hash.final(digest);
}

HmacSha256::HmacSha256(const void* key, size_t keyBytes) : ctx_(EVP_MAC_CTX_new(hmacAlgorithm())) {
  if (ctx_ == nullptr) fail("EVP_MAC_CTX_new");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_END};
  // EVP_MAC_init refuses a null key pointer even for an empty key.
  static const uint8_t kEmpty = 0;
  if (EVP_MAC_init(static_cast<EVP_MAC_CTX*>(ctx_), keyBytes > 0 ? static_cast<const uint8_t*>(key) : &kEmpty,
                   keyBytes, params) != 1) {
    EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_));
    fail("EVP_MAC_init");
  }
}

HmacSha256::~HmacSha256() { EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_)); }

void HmacSha256::update(const void* data, size_t bytes) {
  check(EVP_MAC_update(static_cast<EVP_MAC_CTX*>(ctx_), static_cast<const uint8_t*>(data), bytes),
        "EVP_MAC_update");
}

void HmacSha256::final(uint8_t mac[kSha256Bytes]) {
  size_t length = 0;
  check(EVP_MAC_final(static_cast<EVP_MAC_CTX*>(ctx_), mac, &length, kSha256Bytes), "EVP_MAC_final");
}

void HmacSha256::reset() {
  // A null key re-initialises with the key already set.
  check(EVP_MAC_init(static_cast<EVP_MAC_CTX*>(ctx_), nullptr, 0, nullptr), "EVP_MAC_init");
}

void hmacSha256(const void* key, size_t keyBytes, const void* data, size_t bytes, uint8_t mac[kSha256Bytes]) {
  HmacSha256 hmac(key, keyBytes);
  hmac.update(data, bytes);
  hmac.final(mac);
}

void hkdfSha256(const void* ikm, size_t ikmBytes, const void* salt, size_t saltBytes, const void* info,
                size_t infoBytes, uint8_t* out, size_t outBytes) {
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<void*>(ikm), ikmBytes),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT, const_cast<void*>(salt), saltBytes),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, const_cast<void*>(info), infoBytes),
      OSSL_PARAM_END};
  deriveKey("HKDF", params, out, outBytes);
}

void pbkdf2Sha256(const void* password, size_t passwordBytes, const void* salt, size_t saltBytes,
                  uint32_t iterations, uint8_t* out, size_t outBytes) {
  char digest[] = "SHA256";
  uint64_t rounds = iterations;
  // SP 800-132's lower limits (16-byte salt, 1000 rounds) are enforced only in FIPS mode;
  // pkcs5 = 1 lifts them so the RFC vectors (short salts, 1 round) can be checked.
  int pkcs5 = 1;
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_PASSWORD, const_cast<void*>(password), passwordBytes),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT, const_cast<void*>(salt), saltBytes),
      OSSL_PARAM_construct_uint64(OSSL_KDF_PARAM_ITER, &rounds),
      OSSL_PARAM_construct_int(OSSL_KDF_PARAM_PKCS5, &pkcs5),
      OSSL_PARAM_END};
  deriveKey("PBKDF2", params, out, outBytes);
}

bool constantTimeEqual(const void* a, const void* b, size_t bytes) { return CRYPTO_memcmp(a, b, bytes) == 0; }

void randomBytes(uint8_t* data, size_t bytes) {
  // RAND_bytes takes an int count.
  while (bytes > 0) {
    const int n = bytes > (1u << 30) ? (1 << 30) : static_cast<int>(bytes);
    check(RAND_bytes(data, n), "RAND_bytes");
    data += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace pycomm
