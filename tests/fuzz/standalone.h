// What the fuzz targets' standalone drivers share (PYCOMM_FUZZ_STANDALONE: machines
// without libFuzzer, where tests/backend/test_fuzz.py builds each target with its own main).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace pycomm_fuzz {

// xorshift64 (Marsaglia 2003): a fixed sequence per seed, so a failing run repeats.
class Xorshift {
 public:
  explicit Xorshift(uint64_t seed) : state_(seed) {}
  uint64_t operator()() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return state_;
  }

 private:
  uint64_t state_;
};

// Fills `buffer` (capacity bytes) with a random number of random bytes; returns how many.
inline size_t randomBytes(Xorshift& next, uint8_t* buffer, size_t capacity) {
  const size_t size = next() % capacity;
  for (size_t i = 0; i < size; ++i) buffer[i] = static_cast<uint8_t>(next());
  return size;
}

// Flips up to three random bits among the `size` bytes at `data`.
inline void flipBits(Xorshift& next, uint8_t* data, size_t size) {
  for (int flips = static_cast<int>(next() % 4); flips > 0; --flips) data[next() % size] ^= 1 << (next() % 8);
}

// The number of runs: the first argument, else `fallback`.
inline long runsFromArgs(int argc, char** argv, long fallback = 100000) {
  return argc > 1 ? std::atol(argv[1]) : fallback;
}

}  // namespace pycomm_fuzz
