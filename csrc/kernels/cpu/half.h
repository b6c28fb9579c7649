// float16 / bfloat16 <-> float32 conversions (round to nearest even), portable C++.
#pragma once

#include <cstdint>
#include <cstring>

namespace pycomm {

inline float bitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t floatToBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return bitsToFloat(sign);
    // Subnormal half: normalise into a float32 normal.
    exponent = 127 - 15 + 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
    return bitsToFloat(sign | (exponent << 23) | (mantissa << 13));
  }
  if (exponent == 31) return bitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return bitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t floatToHalf(float value) {
  uint32_t x = floatToBits(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;    // NaN stays (quiet) NaN
  if (x >= 0x47800000u) return sign | 0x7c00u;   // >= 65536 (and inf) -> inf
  if (x < 0x38800000u) {                         // below 2^-14: half subnormal or zero
    if (x < 0x33000000u) return sign;            // below 2^-25 rounds to zero
    const uint32_t e = x >> 23;
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t h = (((x >> 23) - 112) << 10) | ((x & 0x7fffffu) >> 13);
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may reach inf: correct
  return static_cast<uint16_t>(sign | h);
}

inline float bfloat16ToFloat(uint16_t b) { return bitsToFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t floatToBfloat16(float value) {
  uint32_t x = floatToBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace pycomm
