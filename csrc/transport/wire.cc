#include "transport/wire.h"

#include <cstring>

#include "common/error.h"

namespace pycomm {

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

std::string checkHello(const Hello& hello, int localRank, int size, const uint8_t* secret) {
  if (hello.magic != kHelloMagic) return "not a pycomm peer (bad hello)";
  if (hello.version != kWireVersion)
    return strCat("peer speaks wire version ", hello.version, ", this rank ", kWireVersion);
  if (hello.size != size) return strCat("peer belongs to a group of ", hello.size, " ranks");
  if (hello.rank <= localRank || hello.rank >= size)
    return strCat("peer claims rank ", hello.rank, ", expected one in (", localRank, ", ", size, ")");
  unsigned char difference = 0;  // compare every byte: no early exit
  for (size_t i = 0; i < kSecretBytes; ++i) difference |= hello.secret[i] ^ secret[i];
  if (difference != 0) return "peer does not know this job's secret";
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
