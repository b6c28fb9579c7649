// What the fuzz harnesses share: reading fields off libFuzzer's input, and failing on a
// broken invariant in a way libFuzzer reports as a crash (with the input saved).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace pycomm_fuzz {

inline void check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

// Reads little-endian fields off the input; zeros past its end.
struct Reader {
  const uint8_t* data;
  size_t size;
  bool done() const { return size == 0; }
  uint64_t next(size_t bytes) {
    uint64_t value = 0;
    for (size_t i = 0; i < bytes; ++i) {
      const uint64_t byte = size ? (--size, *data++) : 0;
      value |= byte << (8 * i);
    }
    return value;
  }
  // Up to `bytes` raw bytes (fewer at the input's end).
  std::vector<uint8_t> take(size_t bytes) {
    const size_t n = bytes < size ? bytes : size;
    std::vector<uint8_t> out(data, data + n);
    data += n;
    size -= n;
    return out;
  }
};

}  // namespace pycomm_fuzz
