// FNV-1a, 64 bits: the hashes ranks compare to tell their calls apart (a collective's
// tag, a sparse tensor's shape). Not for anything an attacker chooses.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pycomm {

constexpr uint64_t kFnvOffset = 14695981039346656037ull;

// `h` with the bytes data[0, bytes) mixed in.
inline uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = kFnvOffset) {
  for (size_t i = 0; i < bytes; ++i) {
    h ^= static_cast<const unsigned char*>(data)[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace pycomm
