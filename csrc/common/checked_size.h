// Sizes that peers announce, added up without wrapping. Every place that adds
// sizes a peer chose (the COO all-reduce's scratch, all-to-all offsets) goes
// through here, so a sum that would exceed size_t is an error, never a small
// buffer that the announced bytes then overrun.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pycomm {

// a + b into *sum; false (and *sum untouched) when it does not fit in size_t.
inline bool checkedAdd(size_t a, size_t b, size_t* sum) {
  size_t s;
  if (__builtin_add_overflow(a, b, &s)) return false;
  *sum = s;
  return true;
}

// a * b into *product; false (and *product untouched) when it does not fit.
inline bool checkedMul(size_t a, size_t b, size_t* product) {
  size_t p;
  if (__builtin_mul_overflow(a, b, &p)) return false;
  *product = p;
  return true;
}

// Consecutive blocks of sizes[i] bytes, each start aligned to `align` (a power of
// two; 1: packed): offsets[i] is where block i starts, offsets[n] the total.
// Returns false, leaving *offsets empty, when the total (alignment padding
// included) would exceed `limit` or wrap.
inline bool blockOffsets(const std::vector<uint64_t>& sizes, size_t align, size_t limit,
                         std::vector<size_t>* offsets) {
  offsets->assign(sizes.size() + 1, 0);
  size_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    (*offsets)[i] = at;
    size_t padded = 0, end = 0;
    if (sizes[i] > SIZE_MAX || !checkedAdd(static_cast<size_t>(sizes[i]), align - 1, &padded) ||
        !checkedAdd(at, padded & ~(align - 1), &end) || end > limit) {
      offsets->clear();
      return false;
    }
    at = end;
  }
  (*offsets)[sizes.size()] = at;
  return true;
}

}  // namespace pycomm
