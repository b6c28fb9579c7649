#include "kernels/cpu/reduce.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/error.h"
#include "kernels/cpu/half.h"

namespace pycomm {
namespace {

// Integer sums and products wrap (two's complement) like torch's, without
// signed-overflow UB: do the arithmetic in the unsigned type.
template <typename T>
inline T wrapAdd(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T>
inline T wrapMul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    using W = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, U>;
    return static_cast<T>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b)));
  } else {
    return a * b;
  }
}

// MIN/MAX propagate NaN like torch.minimum/maximum.
template <typename T>
inline T minOf(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return b < a ? b : a;
}

template <typename T>
inline T maxOf(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return a < b ? b : a;
}

template <typename T, typename F>
void apply(T* __restrict dst, const T* __restrict src, size_t count, F f) {
  for (size_t i = 0; i < count; ++i) dst[i] = f(dst[i], src[i]);
}

template <typename T>
void reduceTyped(T* dst, const T* src, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return apply(dst, src, count, [](T a, T b) { return wrapAdd(a, b); });
    case ReduceOp::kProduct:
      return apply(dst, src, count, [](T a, T b) { return wrapMul(a, b); });
    case ReduceOp::kMin:
      return apply(dst, src, count, [](T a, T b) { return minOf(a, b); });
    case ReduceOp::kMax:
      return apply(dst, src, count, [](T a, T b) { return maxOf(a, b); });
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::kBand) return apply(dst, src, count, [](T a, T b) { return T(a & b); });
        if (op == ReduceOp::kBor) return apply(dst, src, count, [](T a, T b) { return T(a | b); });
        return apply(dst, src, count, [](T a, T b) { return T(a ^ b); });
      }
      break;
  }
  PYCOMM_CHECK_INTERNAL(false, "reduce op ", reduceOpName(op), " reached a type that cannot do it");
}

// 16-bit floats: widen to float32, combine, round back once per element.
template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduceHalf(uint16_t* dst, const uint16_t* src, size_t count, ReduceOp op) {
  constexpr size_t kBlock = 256;
  float a[kBlock];
  float b[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    for (size_t i = 0; i < n; ++i) {
      a[i] = Load(dst[base + i]);
      b[i] = Load(src[base + i]);
    }
    reduceTyped(a, b, n, op);
    for (size_t i = 0; i < n; ++i) dst[base + i] = Store(a[i]);
  }
}

// bool is one byte holding 0 or 1: SUM is OR and PRODUCT is AND (as NCCL maps them).
void reduceBool(uint8_t* dst, const uint8_t* src, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return apply(dst, src, count, [](uint8_t a, uint8_t b) { return uint8_t((a | b) != 0); });
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return apply(dst, src, count, [](uint8_t a, uint8_t b) { return uint8_t((a & b) != 0); });
    case ReduceOp::kBxor:
      return apply(dst, src, count, [](uint8_t a, uint8_t b) { return uint8_t((a ^ b) != 0); });
    case ReduceOp::kAvg:
      break;
  }
  PYCOMM_CHECK_INTERNAL(false, "AVG on bool");
}

}  // namespace

void reduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op) {
  if (count == 0) return;
  switch (dtype) {
    case DataType::kFloat32:
      return reduceTyped(static_cast<float*>(dst), static_cast<const float*>(src), count, op);
    case DataType::kFloat64:
      return reduceTyped(static_cast<double*>(dst), static_cast<const double*>(src), count, op);
    case DataType::kFloat16:
      return reduceHalf<halfToFloat, floatToHalf>(static_cast<uint16_t*>(dst),
                                                  static_cast<const uint16_t*>(src), count, op);
    case DataType::kBFloat16:
      return reduceHalf<bfloat16ToFloat, floatToBfloat16>(
          static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count, op);
    case DataType::kInt8:
      return reduceTyped(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), count, op);
    case DataType::kInt16:
      return reduceTyped(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), count, op);
    case DataType::kInt32:
      return reduceTyped(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count, op);
    case DataType::kInt64:
      return reduceTyped(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count, op);
    case DataType::kUInt8:
      return reduceTyped(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op);
    case DataType::kBool:
      return reduceBool(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op);
  }
}

void divideBy(void* buf, size_t count, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= static_cast<float>(divisor);
      return;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= static_cast<double>(divisor);
      return;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] = floatToHalf(halfToFloat(p[i]) / divisor);
      return;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] = floatToBfloat16(bfloat16ToFloat(p[i]) / divisor);
      return;
    }
    default:
      PYCOMM_CHECK_INTERNAL(false, "divideBy on ", dataTypeName(dtype));
  }
}

}  // namespace pycomm
