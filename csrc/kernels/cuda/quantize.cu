// GPU block quantization; layout and rules in kernels/cpu/quantize.h.
//
// One thread block (kThreads threads) per quantization block (grid-stride over
// blocks): a block-wide reduction of max|v| (or sum|v| for 1-bit deterministic),
// then each thread writes whole code bytes (1, 2 or 8 elements each) and, for
// error feedback, the new residual of those elements.
#include "kernels/cuda/quantize.cuh"

#include <algorithm>

#include "kernels/cuda/cuda_check.cuh"

namespace pycomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 1u << 20;

__device__ __forceinline__ uint32_t absBits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

template <bool EF>
__device__ __forceinline__ float valueAt(const float* x, const float* e, size_t i) {
  if constexpr (EF) return __fadd_rn(x[i], e[i]);
  else return x[i];
}

__device__ __forceinline__ float uniformAt(uint64_t seed, size_t i) {
  return quantizeUniform(quantizeSeedKey(seed, static_cast<uint32_t>(uint64_t(i) >> 32)),
                         static_cast<uint32_t>(i));
}

template <int L>
__device__ __forceinline__ int32_t codeOf(float v, bool stochastic, float u) {
  int32_t c;
  if (stochastic) {
    int32_t t = static_cast<int32_t>(v);
    t -= static_cast<float>(t) > v ? 1 : 0;
    const float frac = __fsub_rn(v, static_cast<float>(t));
    c = t + (u < frac ? 1 : 0);
  } else {
    c = static_cast<int32_t>(__fsub_rn(__fadd_rn(v, 12582912.0f), 12582912.0f));
  }
  return max(-L, min(L, c));
}

// Sum (Max = false) or max (Max = true) over the thread block.
template <bool Max>
__device__ float blockReduce(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_down_sync(0xFFFFFFFFu, v, o);
    v = Max ? fmaxf(v, w) : __fadd_rn(v, w);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? shared[lane] : (Max ? 0.0f : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
      const float w = __shfl_down_sync(0xFFFFFFFFu, v, o);
      v = Max ? fmaxf(v, w) : __fadd_rn(v, w);
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float r = shared[0];
  __syncthreads();
  return r;
}

__device__ __forceinline__ void storeScale(uint8_t* p, float s) {
  const uint32_t b = __float_as_uint(s);
  p[0] = b & 255; p[1] = (b >> 8) & 255; p[2] = (b >> 16) & 255; p[3] = b >> 24;
}

__device__ __forceinline__ float loadScale(const uint8_t* p) {
  return __uint_as_float(uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) |
                         (uint32_t(p[3]) << 24));
}

__host__ __device__ __forceinline__ size_t codeBytes(size_t n, int bits) {
  return (n * size_t(bits) + 7) / 8;
}

template <int Bits, bool EF>
__global__ void quantizeKernel(const float* __restrict__ x, float* e, size_t count, size_t block,
                               bool stochastic, uint64_t seed, uint8_t* __restrict__ out) {
  __shared__ float shared[kThreads / 32];
  const size_t nblocks = (count + block - 1) / block;
  const size_t blockBytes = 4 + codeBytes(block, Bits);
  for (size_t q = blockIdx.x; q < nblocks; q += gridDim.x) {
    const size_t base = q * block;
    const size_t n = min(block, count - base);
    uint8_t* dst = out + q * blockBytes;
    float scale, inv;
    if (Bits == 1 && !stochastic) {
      float sum = 0.0f;
      for (size_t j = threadIdx.x; j < n; j += kThreads)
        sum = __fadd_rn(sum, fabsf(valueAt<EF>(x, e, base + j)));
      sum = blockReduce<false>(sum, shared);
      scale = __fdiv_rn(sum, static_cast<float>(n));
      inv = 0.0f;
    } else {
      uint32_t m = 0;
      for (size_t j = threadIdx.x; j < n; j += kThreads)
        m = max(m, absBits(valueAt<EF>(x, e, base + j)));
      // Reduce the bit patterns as floats: for non-negative floats both orders agree
      // (a NaN makes fmaxf drop it; the CPU kernel propagates it instead).
      const float maxAbs = blockReduce<true>(__uint_as_float(m), shared);
      constexpr int L = Bits == 8 ? 127 : Bits == 4 ? 7 : 1;
      scale = Bits == 1 ? maxAbs : __fdiv_rn(maxAbs, static_cast<float>(L));
      inv = maxAbs > 0.0f ? __fdiv_rn(static_cast<float>(L), maxAbs) : 0.0f;
    }
    if (threadIdx.x == 0) storeScale(dst, scale);
    uint8_t* codes = dst + 4;
    const size_t nbytes = codeBytes(n, Bits);
    constexpr int kPerByte = 8 / Bits;
    for (size_t b = threadIdx.x; b < nbytes; b += kThreads) {
      uint32_t byte = 0;
      for (int l = 0; l < kPerByte; ++l) {
        const size_t j = b * kPerByte + l;
        if (j >= n) break;
        const size_t i = base + j;
        const float v = valueAt<EF>(x, e, i);
        float deq;
        if constexpr (Bits == 1) {
          uint32_t bit;
          if (stochastic) {
            const float p = __fadd_rn(0.5f, __fmul_rn(v, __fmul_rn(0.5f, inv)));
            bit = scale > 0.0f ? (uniformAt(seed, i) < p ? 1u : 0u) : 1u;
          } else {
            bit = v >= 0.0f ? 1u : 0u;
          }
          byte |= bit << l;
          deq = bit ? scale : -scale;
        } else {
          constexpr int L = Bits == 8 ? 127 : 7;
          const int32_t c = codeOf<L>(__fmul_rn(v, inv), stochastic,
                                      stochastic ? uniformAt(seed, i) : 0.0f);
          byte |= Bits == 8 ? (uint32_t(c) & 255u) : (uint32_t(c + 8) << (4 * l));
          deq = __fmul_rn(static_cast<float>(c), scale);
        }
        if constexpr (EF) e[i] = __fsub_rn(v, deq);
      }
      codes[b] = static_cast<uint8_t>(byte);
    }
    __syncthreads();
  }
}

template <int Bits>
__global__ void dequantizeKernel(const uint8_t* __restrict__ packed, size_t count, size_t block,
                                 float* __restrict__ x) {
  const size_t blockBytes = 4 + codeBytes(block, Bits);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t q = i / block, j = i % block;
    const uint8_t* src = packed + q * blockBytes;
    const float scale = loadScale(src);
    const uint8_t byte = src[4 + j * Bits / 8];
    if constexpr (Bits == 8) {
      x[i] = __fmul_rn(static_cast<float>(static_cast<int8_t>(byte)), scale);
    } else if constexpr (Bits == 4) {
      const int c = ((j & 1) ? (byte >> 4) : (byte & 15)) - 8;
      x[i] = __fmul_rn(static_cast<float>(c), scale);
    } else {
      x[i] = ((byte >> (j & 7)) & 1) ? scale : -scale;
    }
  }
}

template <bool EF>
void launchQuantize(const char* op, const float* x, float* e, size_t count,
                    const QuantizeOptions& opts, uint8_t* out, cudaStream_t stream) {
  checkQuantizeOptions(op, opts.bits, opts.block);
  if (count == 0) return;
  const size_t nblocks = (count + opts.block - 1) / opts.block;
  const unsigned grid = static_cast<unsigned>(std::min<size_t>(nblocks, kMaxGrid));
  switch (opts.bits) {
    case 8:
      quantizeKernel<8, EF><<<grid, kThreads, 0, stream>>>(x, e, count, opts.block,
                                                           opts.stochastic, opts.seed, out);
      break;
    case 4:
      quantizeKernel<4, EF><<<grid, kThreads, 0, stream>>>(x, e, count, opts.block,
                                                           opts.stochastic, opts.seed, out);
      break;
    default:
      quantizeKernel<1, EF><<<grid, kThreads, 0, stream>>>(x, e, count, opts.block,
                                                           opts.stochastic, opts.seed, out);
      break;
  }
  PYCOMM_CUDA_LAUNCH_CHECK(op);
}

}  // namespace

void quantize(const float* x, size_t count, const QuantizeOptions& opts, uint8_t* out,
              cudaStream_t stream) {
  launchQuantize<false>("quantize", x, nullptr, count, opts, out, stream);
}

void quantizeErrorFeedback(const float* g, float* e, size_t count, const QuantizeOptions& opts,
                           uint8_t* out, cudaStream_t stream) {
  launchQuantize<true>("quantize_ef", g, e, count, opts, out, stream);
}

void dequantize(const uint8_t* packed, size_t count, int bits, size_t block, float* x,
                cudaStream_t stream) {
  checkQuantizeOptions("dequantize", bits, block);
  if (count == 0) return;
  const unsigned grid =
      static_cast<unsigned>(std::min<size_t>((count + kThreads - 1) / kThreads, kMaxGrid));
  switch (bits) {
    case 8: dequantizeKernel<8><<<grid, kThreads, 0, stream>>>(packed, count, block, x); break;
    case 4: dequantizeKernel<4><<<grid, kThreads, 0, stream>>>(packed, count, block, x); break;
    default: dequantizeKernel<1><<<grid, kThreads, 0, stream>>>(packed, count, block, x); break;
  }
  PYCOMM_CUDA_LAUNCH_CHECK("dequantize");
}

}  // namespace cuda
}  // namespace pycomm
