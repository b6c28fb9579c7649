// What the fuzz targets' standalone drivers share (PYCOMM_FUZZ_STANDALONE: machines
// without libFuzzer, where tests/test_fuzz.py builds each target with its own main).
#pragma once

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

// The number of runs: the first argument, else `fallback`.
inline long runsFromArgs(int argc, char** argv, long fallback = 100000) {
  return argc > 1 ? std::atol(argv[1]) : fallback;
}

}  // namespace pycomm_fuzz
