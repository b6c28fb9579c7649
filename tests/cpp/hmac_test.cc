// The crypto seam (csrc/transport/hmac.h, libcrypto underneath) against the
// published test vectors: NIST's SHA-256 examples (FIPS 180-4 / CSRC "SHA_All"
// and the one-million-'a' message), RFC 4231's HMAC-SHA256 cases 1-7, RFC 5869's
// HKDF-SHA256 case 1, and PBKDF2-HMAC-SHA256 (RFC 7914 section 11's case 1 and the
// widely published password/salt cases). Built and run by tests/transport/test_hmac_cpp.py;
// prints one line per check, exits non-zero on failure.
#include <iostream>
#include <string>

#include "transport/hmac.h"

using namespace pycomm;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

std::string hex(const uint8_t* data, size_t bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string text;
  for (size_t i = 0; i < bytes; ++i) {
    text += digits[data[i] >> 4];
    text += digits[data[i] & 15];
  }
  return text;
}

std::string sha256Hex(const std::string& message) {
  uint8_t digest[kSha256Bytes];
  sha256(message.data(), message.size(), digest);
  return hex(digest, sizeof(digest));
}

std::string hmacHex(const std::string& key, const std::string& message) {
  uint8_t mac[kSha256Bytes];
  hmacSha256(key.data(), key.size(), message.data(), message.size(), mac);
  return hex(mac, sizeof(mac));
}

std::string bytesOf(int value, size_t count) { return std::string(count, static_cast<char>(value)); }

}  // namespace

int main() {
  struct { std::string message, digest; } nist[] = {
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
       "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
      {std::string(1000000, 'a'), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
  };
  for (const auto& v : nist) {
    const std::string got = sha256Hex(v.message);
    expect(got == v.digest, "SHA-256 of a " + std::to_string(v.message.size()) + "-byte NIST message: " + got);
  }
  // Updates split anywhere give the one-shot digest (block boundaries, padding edge cases).
  bool splits = true;
  for (size_t length : {55, 56, 63, 64, 65, 119, 120, 128, 200}) {
    std::string message;
    for (size_t i = 0; i < length; ++i) message += static_cast<char>(i * 7 + 1);
    const std::string whole = sha256Hex(message);
    for (size_t cut = 0; cut <= length; ++cut) {
      Sha256 hash;
      hash.update(message.data(), cut);
      hash.update(message.data() + cut, length - cut);
      uint8_t digest[kSha256Bytes];
      hash.final(digest);
      splits = splits && hex(digest, sizeof(digest)) == whole;
    }
  }
  expect(splits, "SHA-256 updates split at every point match the one-shot digest");

  std::string key4;
  for (int i = 1; i <= 25; ++i) key4 += static_cast<char>(i);
  struct { std::string key, data, mac; } rfc4231[] = {
      {bytesOf(0x0b, 20), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {bytesOf(0xaa, 20), bytesOf(0xdd, 50), "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {key4, bytesOf(0xcd, 50), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {bytesOf(0x0c, 20), "Test With Truncation", "a3b6167473100ee06e0c796c2955552b"},  // truncated to 128 bits
      {bytesOf(0xaa, 131), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {bytesOf(0xaa, 131),
       "This is a test using a larger than block-size key and a larger than block-size data. The key needs to be "
       "hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  int number = 0;
  for (const auto& v : rfc4231) {
    const std::string got = hmacHex(v.key, v.data).substr(0, v.mac.size());
    expect(got == v.mac, "RFC 4231 test case " + std::to_string(++number) + ": " + got);
  }
  // HMAC reset() starts a new MAC under the same key.
  {
    HmacSha256 mac("Jefe", 4);
    mac.update("garbage", 7);
    mac.reset();
    const std::string data = "what do ya want for nothing?";
    mac.update(data.data(), data.size());
    uint8_t out[kSha256Bytes];
    mac.final(out);
    expect(hex(out, sizeof(out)) == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
           "HMAC reset() gives RFC 4231 case 2 after discarded input");
  }
  {
    uint8_t ikm[22], salt[13], info[10], okm[42];
    for (int i = 0; i < 22; ++i) ikm[i] = 0x0b;
    for (int i = 0; i < 13; ++i) salt[i] = static_cast<uint8_t>(i);
    for (int i = 0; i < 10; ++i) info[i] = static_cast<uint8_t>(0xf0 + i);
    hkdfSha256(ikm, sizeof(ikm), salt, sizeof(salt), info, sizeof(info), okm, sizeof(okm));
    const std::string got = hex(okm, sizeof(okm));
    expect(got == "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865",
           "RFC 5869 HKDF-SHA256 test case 1: " + got);
  }
  struct { std::string password, salt; uint32_t rounds; size_t length; std::string key; } pbkdf2[] = {
      {"password", "salt", 1, 32, "120fb6cffcf8b32c43e7225256c4f837a86548c92ccc35480805987cb70be17b"},
      {"password", "salt", 4096, 32, "c5e478d59288c841aa530db6845c4c8d962893a001ce4e11a4963873aa98134a"},
      {"passwd", "salt", 1, 64,
       "55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc49ca9cccf179b645991664b39d77ef317c71b845b1e30bd50"
       "9112041d3a19783"},
  };
  for (const auto& v : pbkdf2) {
    uint8_t out[64];
    pbkdf2Sha256(v.password.data(), v.password.size(), v.salt.data(), v.salt.size(), v.rounds, out, v.length);
    const std::string got = hex(out, v.length);
    expect(got == v.key, "PBKDF2-HMAC-SHA256 " + v.password + "/" + v.salt + " x" + std::to_string(v.rounds) + ": " + got);
  }
  {
    uint8_t x[32] = {}, y[32] = {};
    randomBytes(x, sizeof(x));
    randomBytes(y, sizeof(y));
    expect(!constantTimeEqual(x, y, sizeof(x)), "randomBytes draws differ");
  }
  const uint8_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
  expect(constantTimeEqual(a, a, 4) && !constantTimeEqual(a, b, 4) && constantTimeEqual(a, b, 3),
         "constantTimeEqual compares every byte");
  std::cout << (failures == 0 ? "all passed" : "FAILURES: " + std::to_string(failures)) << std::endl;
  return failures == 0 ? 0 : 1;
}
