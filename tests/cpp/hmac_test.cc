// SHA-256 and HMAC-SHA256 (csrc/transport/hmac.h) against the published test
// vectors: NIST's SHA-256 examples (FIPS 180-4 / CSRC "SHA_All" and the
// one-million-'a' message) and RFC 4231's HMAC-SHA256 cases 1-7. Built and run
// by tests/test_hmac_cpp.py; prints one line per check, exits non-zero on failure.
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
  const uint8_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
  expect(constantTimeEqual(a, a, 4) && !constantTimeEqual(a, b, 4) && constantTimeEqual(a, b, 3),
         "constantTimeEqual compares every byte");
  std::cout << (failures == 0 ? "all passed" : "FAILURES: " + std::to_string(failures)) << std::endl;
  return failures == 0 ? 0 : 1;
}
