// GPU element-wise reductions; semantics in kernels/cuda/reduce.cuh.
//
// One grid-stride kernel per (element type, op): each thread moves 16-byte
// packets (4 floats, 8 halves, 16 bytes), kUnroll of them in flight per loop
// iteration so enough loads are outstanding to approach copy bandwidth; the
// count % (16 / element size) tail and unaligned buffers take a scalar loop.
#include "kernels/cuda/reduce.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_check.cuh"

namespace pycomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kBlocksPerSm = 8;  // 2048 resident threads per SM / kThreads

// ---------------------------------------------------------------- element codecs
// Storage type S <-> compute type C. 16-bit floats compute in float32 and round
// to nearest even once per element (the CPU kernels do the same).

template <typename S>
struct Plain {
  using C = S;
  static __device__ __forceinline__ C load(S v) { return v; }
  static __device__ __forceinline__ S store(C v) { return v; }
};

struct Fp16 {
  using C = float;
  static __device__ __forceinline__ float load(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ uint16_t store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

struct Bf16 {
  using C = float;
  static __device__ __forceinline__ float load(uint16_t v) {
    return __bfloat162float(__ushort_as_bfloat16(v));
  }
  static __device__ __forceinline__ uint16_t store(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

// ---------------------------------------------------------------- operators
// Integer SUM and PRODUCT wrap (arithmetic in the unsigned type, no signed-overflow UB).

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};

struct Product {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      using W = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, U>;
      return static_cast<T>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

// MIN / MAX propagate NaN like torch.minimum / torch.maximum.
struct Min {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return b < a ? b : a;
  }
};

struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a < b ? b : a;
  }
};

struct BitAnd {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return static_cast<T>(a & b); }
};
struct BitOr {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return static_cast<T>(a | b); }
};
struct BitXor {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return static_cast<T>(a ^ b); }
};

// bool: one byte holding 0 or 1.
struct BoolOr {
  __device__ __forceinline__ uint8_t operator()(uint8_t a, uint8_t b) const { return (a | b) != 0; }
};
struct BoolAnd {
  __device__ __forceinline__ uint8_t operator()(uint8_t a, uint8_t b) const { return (a & b) != 0; }
};
struct BoolXor {
  __device__ __forceinline__ uint8_t operator()(uint8_t a, uint8_t b) const { return (a ^ b) != 0; }
};

// a / divisor (the second operand is ignored: launched with Unary = true).
template <typename T>
struct DivideBy {
  T divisor;
  __device__ __forceinline__ T operator()(T a, T) const { return a / divisor; }
};

// ---------------------------------------------------------------- the kernel

template <typename S, typename Codec, typename Op, bool Unary>
__device__ __forceinline__ S combine(const Op& op, S a, S b) {
  return Codec::store(op(Codec::load(a), Unary ? Codec::load(a) : Codec::load(b)));
}

// out[i] = op(a[i], b[i]); b is unused when Unary. With `vectorized`, every
// pointer is 16-byte aligned and whole packets move as uint4.
template <typename S, typename Codec, typename Op, bool Unary>
__global__ void __launch_bounds__(kThreads)
    combineKernel(S* out, const S* a, const S* b, size_t count, bool vectorized, Op op) {
  constexpr size_t kPer = 16 / sizeof(S);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t packets = vectorized ? count / kPer : 0;
  if (packets > 0) {
    const uint4* va = reinterpret_cast<const uint4*>(a);
    const uint4* vb = reinterpret_cast<const uint4*>(b);
    uint4* vo = reinterpret_cast<uint4*>(out);
    size_t p = tid;
    // kUnroll packets per iteration: all loads first, so they are in flight together.
    for (; p + (kUnroll - 1) * stride < packets; p += kUnroll * stride) {
      uint4 x[kUnroll], y[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        x[u] = va[p + u * stride];
        if (!Unary) y[u] = vb[p + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        S* xs = reinterpret_cast<S*>(&x[u]);
        const S* ys = reinterpret_cast<const S*>(&y[u]);
#pragma unroll
        for (size_t k = 0; k < kPer; ++k)
          xs[k] = combine<S, Codec, Op, Unary>(op, xs[k], Unary ? xs[k] : ys[k]);
        vo[p + u * stride] = x[u];
      }
    }
    for (; p < packets; p += stride) {
      uint4 x = va[p], y;
      if (!Unary) y = vb[p];
      S* xs = reinterpret_cast<S*>(&x);
      const S* ys = reinterpret_cast<const S*>(&y);
#pragma unroll
      for (size_t k = 0; k < kPer; ++k)
        xs[k] = combine<S, Codec, Op, Unary>(op, xs[k], Unary ? xs[k] : ys[k]);
      vo[p] = x;
    }
  }
  for (size_t i = packets * kPer + tid; i < count; i += stride)
    out[i] = combine<S, Codec, Op, Unary>(op, a[i], Unary ? a[i] : b[i]);
}

unsigned gridFor(size_t work) {
  int device = 0, sms = 0;
  PYCOMM_CUDA_CHECK("reduce", cudaGetDevice(&device));
  PYCOMM_CUDA_CHECK("reduce", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t wanted = (work + kThreads - 1) / kThreads;
  const size_t cap = static_cast<size_t>(std::max(sms, 1)) * kBlocksPerSm;
  return static_cast<unsigned>(std::max<size_t>(1, std::min(wanted, cap)));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename S, typename Codec, bool Unary, typename Op>
void launch(const char* name, void* out, const void* a, const void* b, size_t count, Op op,
            cudaStream_t stream) {
  const bool vectorized = aligned16(out) && aligned16(a) && (Unary || aligned16(b));
  const size_t work = vectorized ? (count + 16 / sizeof(S) - 1) / (16 / sizeof(S)) : count;
  combineKernel<S, Codec, Op, Unary><<<gridFor(work), kThreads, 0, stream>>>(
      static_cast<S*>(out), static_cast<const S*>(a), static_cast<const S*>(b), count, vectorized,
      op);
  PYCOMM_CUDA_LAUNCH_CHECK(name);
}

// One (storage, codec) pair: dispatch on the op. Bitwise ops exist for integers only.
template <typename S, typename Codec>
void reduceTyped(void* out, const void* a, const void* b, size_t count, ReduceOp op,
                 cudaStream_t stream) {
  using C = typename Codec::C;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return launch<S, Codec, false>("reduce", out, a, b, count, Sum{}, stream);
    case ReduceOp::kProduct:
      return launch<S, Codec, false>("reduce", out, a, b, count, Product{}, stream);
    case ReduceOp::kMin: return launch<S, Codec, false>("reduce", out, a, b, count, Min{}, stream);
    case ReduceOp::kMax: return launch<S, Codec, false>("reduce", out, a, b, count, Max{}, stream);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<C>) {
        if (op == ReduceOp::kBand)
          return launch<S, Codec, false>("reduce", out, a, b, count, BitAnd{}, stream);
        if (op == ReduceOp::kBor)
          return launch<S, Codec, false>("reduce", out, a, b, count, BitOr{}, stream);
        return launch<S, Codec, false>("reduce", out, a, b, count, BitXor{}, stream);
      }
      break;
  }
  PYCOMM_CHECK_INTERNAL(false, "reduce op ", reduceOpName(op), " reached a type that cannot do it");
}

void reduceBool(void* out, const void* a, const void* b, size_t count, ReduceOp op,
                cudaStream_t stream) {
  using P = Plain<uint8_t>;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor: return launch<uint8_t, P, false>("reduce", out, a, b, count, BoolOr{}, stream);
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return launch<uint8_t, P, false>("reduce", out, a, b, count, BoolAnd{}, stream);
    case ReduceOp::kBxor:
      return launch<uint8_t, P, false>("reduce", out, a, b, count, BoolXor{}, stream);
    case ReduceOp::kAvg: break;
  }
  PYCOMM_CHECK_INTERNAL(false, "AVG on bool");
}

}  // namespace

void reduce(void* out, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op,
            cudaStream_t stream) {
  checkReduceSupported("reduce", op, dtype);
  if (count == 0) return;
  PYCOMM_CHECK_USAGE(out != nullptr && a != nullptr && b != nullptr,
                     "pycomm reduce: null device pointer for ", count, " elements");
  switch (dtype) {
    case DataType::kFloat32: return reduceTyped<float, Plain<float>>(out, a, b, count, op, stream);
    case DataType::kFloat64: return reduceTyped<double, Plain<double>>(out, a, b, count, op, stream);
    case DataType::kFloat16: return reduceTyped<uint16_t, Fp16>(out, a, b, count, op, stream);
    case DataType::kBFloat16: return reduceTyped<uint16_t, Bf16>(out, a, b, count, op, stream);
    case DataType::kInt8: return reduceTyped<int8_t, Plain<int8_t>>(out, a, b, count, op, stream);
    case DataType::kInt16: return reduceTyped<int16_t, Plain<int16_t>>(out, a, b, count, op, stream);
    case DataType::kInt32: return reduceTyped<int32_t, Plain<int32_t>>(out, a, b, count, op, stream);
    case DataType::kInt64: return reduceTyped<int64_t, Plain<int64_t>>(out, a, b, count, op, stream);
    case DataType::kUInt8: return reduceTyped<uint8_t, Plain<uint8_t>>(out, a, b, count, op, stream);
    case DataType::kBool: return reduceBool(out, a, b, count, op, stream);
  }
}

void reduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op,
                cudaStream_t stream) {
  reduce(dst, dst, src, count, dtype, op, stream);
}

void divideBy(void* buf, size_t count, DataType dtype, int divisor, cudaStream_t stream) {
  PYCOMM_CHECK_USAGE(isFloating(dtype), "pycomm divide: ", dataTypeName(dtype),
                     " is not a floating dtype");
  PYCOMM_CHECK_USAGE(divisor != 0, "pycomm divide: divisor must not be 0");
  if (count == 0) return;
  switch (dtype) {
    case DataType::kFloat32:
      return launch<float, Plain<float>, true>("divide", buf, buf, nullptr, count,
                                               DivideBy<float>{static_cast<float>(divisor)}, stream);
    case DataType::kFloat64:
      return launch<double, Plain<double>, true>(
          "divide", buf, buf, nullptr, count, DivideBy<double>{static_cast<double>(divisor)}, stream);
    case DataType::kFloat16:
      return launch<uint16_t, Fp16, true>("divide", buf, buf, nullptr, count,
                                          DivideBy<float>{static_cast<float>(divisor)}, stream);
    case DataType::kBFloat16:
      return launch<uint16_t, Bf16, true>("divide", buf, buf, nullptr, count,
                                          DivideBy<float>{static_cast<float>(divisor)}, stream);
    default: break;
  }
}

}  // namespace cuda
}  // namespace pycomm
