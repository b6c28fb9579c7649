// Internal to the element-wise reductions (reduce.cc, reduce_avx2.cc, reduce_avx512.cc):
// the loops, written once as templates over the instruction set. Each of the three files
// compiles one copy (the portable baseline, AVX2 + F16C, AVX-512) with its target
// attributes; three files rather than one so that a build compiles them side by side.
// Everything here has internal linkage but the per-ISA functions of namespace reduce_isa.
#pragma once

#include "kernels/cpu/reduce.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef PYCOMM_X86_DISPATCH
#include <immintrin.h>
#endif

#include "common/error.h"

namespace pycomm {

#ifdef PYCOMM_X86_DISPATCH
namespace reduce_isa {
// float16 with the CPU's conversion instructions (exact; round to nearest even), for
// widen() / narrow() below: defined in the file of their instruction set.
PYCOMM_TARGET_AVX2 void widenFp16F16c(const uint16_t* in, float* out, size_t n);
PYCOMM_TARGET_AVX2 void narrowFp16F16c(const float* in, uint16_t* out, size_t n);
PYCOMM_TARGET_AVX512 void widenFp16Avx512(const uint16_t* in, float* out, size_t n);
PYCOMM_TARGET_AVX512 void narrowFp16Avx512(const float* in, uint16_t* out, size_t n);
}  // namespace reduce_isa
#endif

namespace {


// ---- element ops -------------------------------------------------------------

// Integer sums and products wrap (two's complement) like torch's, without
// signed-overflow UB: do the arithmetic in the unsigned type.
struct Add {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};

struct Mul {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      using W = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, U>;
      return static_cast<T>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

// MIN/MAX propagate NaN like torch.minimum/maximum (a NaN in a wins, then one in b).
struct Min {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) return a != a ? a : (b != b ? b : (b < a ? b : a));
    return b < a ? b : a;
  }
};

struct Max {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) return a != a ? a : (b != b ? b : (a < b ? b : a));
    return a < b ? b : a;
  }
};

struct And {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const { return T(a & b); }
};
struct Or {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const { return T(a | b); }
};
struct Xor {
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const { return T(a ^ b); }
};

// bool is one byte holding 0 or 1: SUM is OR and PRODUCT is AND (as NCCL maps them).
struct BoolOr {
  PYCOMM_ALWAYS_INLINE uint8_t operator()(uint8_t a, uint8_t b) const { return (a | b) != 0; }
};
struct BoolAnd {
  PYCOMM_ALWAYS_INLINE uint8_t operator()(uint8_t a, uint8_t b) const { return (a & b) != 0; }
};
struct BoolXor {
  PYCOMM_ALWAYS_INLINE uint8_t operator()(uint8_t a, uint8_t b) const { return (a ^ b) != 0; }
};

// op(b, a): lets dst == b reuse the in-place loop while keeping the operand order.
template <typename F>
struct Swapped {
  F f;
  template <typename T>
  PYCOMM_ALWAYS_INLINE T operator()(T a, T b) const { return f(b, a); }
};

// ---- loops -------------------------------------------------------------------

template <typename T, typename F>
PYCOMM_ALWAYS_INLINE void mapInPlace(T* __restrict d, const T* __restrict s, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) d[i] = f(d[i], s[i]);
}

template <typename T, typename F>
PYCOMM_ALWAYS_INLINE void mapOutOfPlace(T* __restrict d, const T* __restrict a,
                                        const T* __restrict b, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) d[i] = f(a[i], b[i]);
}

// d = f(a, b) where d is a, b or neither (never a partial overlap).
template <typename T, typename F>
PYCOMM_ALWAYS_INLINE void map(T* d, const T* a, const T* b, size_t n, F f) {
  if (d == a) return mapInPlace(d, b, n, f);
  if (d == b) return mapInPlace(d, a, n, Swapped<F>{f});
  mapOutOfPlace(d, a, b, n, f);
}

template <typename T>
PYCOMM_ALWAYS_INLINE void reduceTyped(T* d, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return map(d, a, b, n, Add{});
    case ReduceOp::kProduct:
      return map(d, a, b, n, Mul{});
    case ReduceOp::kMin:
      return map(d, a, b, n, Min{});
    case ReduceOp::kMax:
      return map(d, a, b, n, Max{});
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::kBand) return map(d, a, b, n, And{});
        if (op == ReduceOp::kBor) return map(d, a, b, n, Or{});
        return map(d, a, b, n, Xor{});
      }
      break;
  }
  PYCOMM_CHECK_INTERNAL(false, "reduce op ", reduceOpName(op), " reached a type that cannot do it");
}

PYCOMM_ALWAYS_INLINE void reduceBool(uint8_t* d, const uint8_t* a, const uint8_t* b, size_t n,
                                     ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return map(d, a, b, n, BoolOr{});
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return map(d, a, b, n, BoolAnd{});
    case ReduceOp::kBxor:
      return map(d, a, b, n, BoolXor{});
    case ReduceOp::kAvg:
      break;
  }
  PYCOMM_CHECK_INTERNAL(false, "AVG on bool");
}

// ---- 16-bit float conversions (branch-free, so they vectorize) ----------------

PYCOMM_ALWAYS_INLINE uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

PYCOMM_ALWAYS_INLINE float floatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// All ones where cond holds: selects as integer masks, so the compiler keeps the
// conversions branch-free (it will not speculate a float operation behind a branch).
PYCOMM_ALWAYS_INLINE uint32_t maskOf(bool cond) { return 0u - static_cast<uint32_t>(cond); }
PYCOMM_ALWAYS_INLINE uint32_t pick(uint32_t mask, uint32_t yes, uint32_t no) {
  return (yes & mask) | (no & ~mask);
}

// float16 -> float32, exact. The exponent is rebiased with one add; a zero or
// subnormal half is renormalised by one exact float subtraction (F. Giesen's
// "half to float" trick); inf and NaN move to exponent 255 keeping the payload.
PYCOMM_ALWAYS_INLINE float fp16ToFloat(uint16_t h) {
  constexpr uint32_t kShiftedExp = 0x7c00u << 13;
  const uint32_t o = (uint32_t(h) & 0x7fffu) << 13;
  const uint32_t exp = o & kShiftedExp;
  const uint32_t normal = o + ((127u - 15u) << 23);
  const uint32_t infNan = normal + ((128u - 16u) << 23);
  const uint32_t small = bitsOf(floatOf(normal + (1u << 23)) - floatOf(113u << 23));
  const uint32_t r =
      pick(maskOf(exp == kShiftedExp), infNan, pick(maskOf(exp == 0), small, normal));
  return floatOf(r | ((uint32_t(h) & 0x8000u) << 16));
}

// float32 -> float16, round to nearest even (as half.h's floatToHalf). Below
// 2^-14 one float addition of 0.5 rounds onto the half subnormal grid (its ulp is
// 2^-24); above, the 13 dropped bits round with the usual add-and-carry; 2^16 and
// up is inf, NaN a quiet NaN.
PYCOMM_ALWAYS_INLINE uint16_t floatToFp16(float f) {
  const uint32_t bits = bitsOf(f);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t x = bits ^ sign;
  constexpr uint32_t kHalfOne = 126u << 23;  // 0.5f
  const uint32_t big = pick(maskOf(x > 0x7f800000u), 0x7e00u, 0x7c00u);
  const uint32_t small = bitsOf(floatOf(x) + floatOf(kHalfOne)) - kHalfOne;
  const uint32_t normal = (x + ((15u - 127u) << 23) + 0xfffu + ((x >> 13) & 1u)) >> 13;
  const uint32_t h =
      pick(maskOf(x >= 0x47800000u), big, pick(maskOf(x < 0x38800000u), small, normal));
  return static_cast<uint16_t>(h | (sign >> 16));
}

PYCOMM_ALWAYS_INLINE float bf16ToFloat(uint16_t b) { return floatOf(uint32_t(b) << 16); }

PYCOMM_ALWAYS_INLINE uint16_t floatToBf16(float f) {
  const uint32_t x = bitsOf(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quietNan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quietNan : rounded);
}

enum class Half16 { kFloat16, kBFloat16 };

template <Half16 kFormat>
PYCOMM_ALWAYS_INLINE void widenLoop(const uint16_t* __restrict in, float* __restrict out,
                                    size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = kFormat == Half16::kFloat16 ? fp16ToFloat(in[i]) : bf16ToFloat(in[i]);
}

template <Half16 kFormat>
PYCOMM_ALWAYS_INLINE void narrowLoop(const float* __restrict in, uint16_t* __restrict out,
                                     size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = kFormat == Half16::kFloat16 ? floatToFp16(in[i]) : floatToBf16(in[i]);
}


template <CpuIsa kIsa, Half16 kFormat>
PYCOMM_ALWAYS_INLINE void widen(const uint16_t* in, float* out, size_t n) {
#ifdef PYCOMM_X86_DISPATCH
  if constexpr (kFormat == Half16::kFloat16 && kIsa == CpuIsa::kAvx2)
    return reduce_isa::widenFp16F16c(in, out, n);
  if constexpr (kFormat == Half16::kFloat16 && kIsa == CpuIsa::kAvx512)
    return reduce_isa::widenFp16Avx512(in, out, n);
#endif
  widenLoop<kFormat>(in, out, n);
}

template <CpuIsa kIsa, Half16 kFormat>
PYCOMM_ALWAYS_INLINE void narrow(const float* in, uint16_t* out, size_t n) {
#ifdef PYCOMM_X86_DISPATCH
  if constexpr (kFormat == Half16::kFloat16 && kIsa == CpuIsa::kAvx2)
    return reduce_isa::narrowFp16F16c(in, out, n);
  if constexpr (kFormat == Half16::kFloat16 && kIsa == CpuIsa::kAvx512)
    return reduce_isa::narrowFp16Avx512(in, out, n);
#endif
  narrowLoop<kFormat>(in, out, n);
}

// 16-bit floats: widen a block of each operand to float32 (L1-resident), combine,
// round back once per element. d may be a or b: each block is read before written.
constexpr size_t kHalfBlock = 512;

template <CpuIsa kIsa, Half16 kFormat>
PYCOMM_ALWAYS_INLINE void reduceHalf(uint16_t* d, const uint16_t* a, const uint16_t* b, size_t n,
                                     ReduceOp op) {
  alignas(64) float x[kHalfBlock];
  alignas(64) float y[kHalfBlock];
  for (size_t base = 0; base < n; base += kHalfBlock) {
    const size_t m = std::min(kHalfBlock, n - base);
    widen<kIsa, kFormat>(a + base, x, m);
    widen<kIsa, kFormat>(b + base, y, m);
    reduceTyped(x, x, y, m, op);
    narrow<kIsa, kFormat>(x, d + base, m);
  }
}

// n 16-bit sources: each block widened once per source and combined in float32,
// rounded back once. Every source block is read before dst's block is written.
template <CpuIsa kIsa, Half16 kFormat>
PYCOMM_ALWAYS_INLINE void reduceHalfMany(uint16_t* d, const void* const* s, int n, size_t count,
                                         ReduceOp op) {
  alignas(64) float x[kHalfBlock];
  alignas(64) float y[kHalfBlock];
  for (size_t base = 0; base < count; base += kHalfBlock) {
    const size_t m = std::min(kHalfBlock, count - base);
    widen<kIsa, kFormat>(static_cast<const uint16_t*>(s[0]) + base, x, m);
    for (int j = 1; j < n; ++j) {
      widen<kIsa, kFormat>(static_cast<const uint16_t*>(s[j]) + base, y, m);
      reduceTyped(x, x, y, m, op);
    }
    narrow<kIsa, kFormat>(x, d + base, m);
  }
}

template <CpuIsa kIsa, Half16 kFormat>
PYCOMM_ALWAYS_INLINE void divideHalf(uint16_t* p, size_t n, float divisor) {
  alignas(64) float x[kHalfBlock];
  for (size_t base = 0; base < n; base += kHalfBlock) {
    const size_t m = std::min(kHalfBlock, n - base);
    widen<kIsa, kFormat>(p + base, x, m);
    for (size_t i = 0; i < m; ++i) x[i] /= divisor;
    narrow<kIsa, kFormat>(x, p + base, m);
  }
}

// ---- one body, compiled once per instruction set -----------------------------

template <CpuIsa kIsa>
PYCOMM_ALWAYS_INLINE void reduceBody(void* dst, const void* a, const void* b, size_t n,
                                     DataType dtype, ReduceOp op) {
#define PYCOMM_REDUCE_AS(T) \
  reduceTyped(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, op)
  switch (dtype) {
    case DataType::kFloat32: return PYCOMM_REDUCE_AS(float);
    case DataType::kFloat64: return PYCOMM_REDUCE_AS(double);
    case DataType::kInt8: return PYCOMM_REDUCE_AS(int8_t);
    case DataType::kInt16: return PYCOMM_REDUCE_AS(int16_t);
    case DataType::kInt32: return PYCOMM_REDUCE_AS(int32_t);
    case DataType::kInt64: return PYCOMM_REDUCE_AS(int64_t);
    case DataType::kUInt8: return PYCOMM_REDUCE_AS(uint8_t);
    case DataType::kFloat16:
      return reduceHalf<kIsa, Half16::kFloat16>(static_cast<uint16_t*>(dst),
                                               static_cast<const uint16_t*>(a),
                                               static_cast<const uint16_t*>(b), n, op);
    case DataType::kBFloat16:
      return reduceHalf<kIsa, Half16::kBFloat16>(static_cast<uint16_t*>(dst),
                                                static_cast<const uint16_t*>(a),
                                                static_cast<const uint16_t*>(b), n, op);
    case DataType::kBool:
      return reduceBool(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(a),
                        static_cast<const uint8_t*>(b), n, op);
  }
#undef PYCOMM_REDUCE_AS
}

// The other dtypes combine a block of sources 0 and 1 into an L1-resident buffer,
// then each further source into it, and copy the block out: dst may be any source.
constexpr size_t kManyBlockBytes = 4096;

template <CpuIsa kIsa>
PYCOMM_ALWAYS_INLINE void reduceManyBody(void* dst, const void* const* s, int n, size_t count,
                                         DataType dtype, ReduceOp op) {
  if (dtype == DataType::kFloat16)
    return reduceHalfMany<kIsa, Half16::kFloat16>(static_cast<uint16_t*>(dst), s, n, count, op);
  if (dtype == DataType::kBFloat16)
    return reduceHalfMany<kIsa, Half16::kBFloat16>(static_cast<uint16_t*>(dst), s, n, count, op);
  const size_t elem = elementSize(dtype);
  if (n == 1) {
    if (dst != s[0]) std::memmove(dst, s[0], count * elem);
    return;
  }
  if (n == 2) return reduceBody<kIsa>(dst, s[0], s[1], count, dtype, op);
  alignas(64) char block[kManyBlockBytes];
  const size_t per = kManyBlockBytes / elem;
  for (size_t base = 0; base < count; base += per) {
    const size_t m = std::min(per, count - base);
    const size_t at = base * elem;
    reduceBody<kIsa>(block, static_cast<const char*>(s[0]) + at, static_cast<const char*>(s[1]) + at, m,
                     dtype, op);
    for (int j = 2; j < n; ++j) reduceBody<kIsa>(block, block, static_cast<const char*>(s[j]) + at, m, dtype, op);
    std::memcpy(static_cast<char*>(dst) + at, block, m * elem);
  }
}

template <CpuIsa kIsa>
PYCOMM_ALWAYS_INLINE void divideBody(void* buf, size_t n, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      const float q = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] /= q;
      return;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      const double q = static_cast<double>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] /= q;
      return;
    }
    case DataType::kFloat16:
      return divideHalf<kIsa, Half16::kFloat16>(static_cast<uint16_t*>(buf), n,
                                                static_cast<float>(divisor));
    case DataType::kBFloat16:
      return divideHalf<kIsa, Half16::kBFloat16>(static_cast<uint16_t*>(buf), n,
                                                 static_cast<float>(divisor));
    default:
      PYCOMM_CHECK_INTERNAL(false, "divideBy on ", dataTypeName(dtype));
  }
}

}  // namespace

#ifdef PYCOMM_X86_DISPATCH
// The copies of reduce_avx2.cc and reduce_avx512.cc, which reduce.cc dispatches to.
namespace reduce_isa {
PYCOMM_TARGET_AVX2 void reduceAvx2(void* d, const void* a, const void* b, size_t n, DataType t, ReduceOp op);
PYCOMM_TARGET_AVX2 void divideAvx2(void* buf, size_t n, DataType t, int divisor);
PYCOMM_TARGET_AVX2 void reduceManyAvx2(void* d, const void* const* s, int n, size_t c, DataType t, ReduceOp op);
PYCOMM_TARGET_AVX512 void reduceAvx512(void* d, const void* a, const void* b, size_t n, DataType t, ReduceOp op);
PYCOMM_TARGET_AVX512 void divideAvx512(void* buf, size_t n, DataType t, int divisor);
PYCOMM_TARGET_AVX512 void reduceManyAvx512(void* d, const void* const* s, int n, size_t c, DataType t,
                                           ReduceOp op);
}  // namespace reduce_isa
#endif

}  // namespace pycomm
