// Block quantization of float32 gradients (no torch, no transport): 8-bit and
// 4-bit symmetric codes with one float32 scale per block, 1-bit signs with a
// per-block scale, deterministic or stochastic (unbiased) rounding, and fused
// error feedback. The CUDA versions (kernels/cuda/quantize.cuh) produce the same
// layout and use the same counter-based RNG (quantizeUniform below).
//
// ---------------------------------------------------------------------------
// Packed layout (little-endian, no header, no padding between blocks)
// ---------------------------------------------------------------------------
// The input of `count` floats is cut into blocks of `block` elements; the last
// block holds count % block elements when that is not zero. Each block is
//
//     float32 scale                      (4 bytes, unaligned in general)
//     codes                              ceil(n * bits / 8) bytes, n = elements in the block
//
// so packedSize(count, bits, block) = sum over blocks of 4 + ceil(n * bits / 8).
// Codes are always symmetric (there is no zero point; 0.0 decodes to exactly 0):
//
//   bits = 8: one int8 per element, code in [-127, 127];   x ~= code * scale,
//             scale = max|x| / 127 over the block.
//   bits = 4: two codes per byte, element 2j in the LOW nibble, 2j+1 in the high
//             nibble; each nibble holds code + 8 with code in [-7, 7] (nibble 0 is
//             unused); x ~= code * scale, scale = max|x| / 7. An odd tail leaves
//             the last high nibble 0.
//   bits = 1: eight signs per byte, element 8j+b in bit b (LSB first); bit 1
//             decodes to +scale, bit 0 to -scale; trailing bits of the last byte
//             are 0. Deterministic: bit = (x >= 0), scale = mean |x| over the block
//             (the scaled sign of EF-signSGD, Karimireddy et al. 2019, and 1-bit
//             Adam). Stochastic: scale = max |x|, bit = 1 with probability
//             (1 + x / scale) / 2, so that E[decode] = x (QSGD with one level).
//   A block whose max |x| is 0 stores scale 0 and all codes decode to 0.
//
// Rounding (8/4-bit), with v = x / scale in [-L, L], L = 127 or 7:
//   deterministic: code = round-half-to-even(v);  |x - decode| <= scale / 2
//   stochastic:    code = floor(v) + (u < v - floor(v)), u uniform in [0, 1);
//                  E[code] = v (unbiased, QSGD, Alistarh et al. 2017);
//                  |x - decode| < scale
//   (bounds up to float32 rounding of the arithmetic, ~1e-6 relative to max|x|).
//   u = quantizeUniform(seed, i) for the element's global index i: the result
//   depends only on (input, seed), not on threads or chunking.
//
// Non-finite input: a block containing NaN or +-inf has a non-finite scale and
// decodes to NaN; callers that care must check their gradients first.
// ---------------------------------------------------------------------------
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define PYCOMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PYCOMM_HOST_DEVICE inline
#endif

namespace pycomm {

struct QuantizeOptions {
  int bits = 8;              // 8, 4 or 1
  size_t block = 256;        // elements per scale, >= 1
  bool stochastic = false;   // unbiased stochastic rounding
  uint64_t seed = 0;         // RNG seed for stochastic rounding
};

// Validates (bits, block) and throws a usage error naming `op` otherwise.
void checkQuantizeOptions(const char* op, int bits, size_t block);

// Bytes of the packed form of `count` floats.
size_t packedSize(size_t count, int bits, size_t block);

// out[0 .. packedSize) <- packed form of x[0 .. count).
void quantize(const float* x, size_t count, const QuantizeOptions& opts, uint8_t* out);

// x[0 .. count) <- decoded values of `packed` (which holds packedSize(count, bits, block) bytes).
void dequantize(const uint8_t* packed, size_t count, int bits, size_t block, float* x);

// Fused error feedback in one pass over the data (Karimireddy et al. 2019):
//   out <- quantize(g + e);   e <- (g + e) - dequantize(out)
// with every float operation done exactly as dequantize() does it, so that
// e_new == (g + e) - dequantize(out) holds bit for bit.
void quantizeErrorFeedback(const float* g, float* e, size_t count, const QuantizeOptions& opts,
                           uint8_t* out);

// ---- counter-based RNG shared by the CPU and CUDA kernels -------------------
// A stateless hash of (seed, index): the murmur3 32-bit finalizer applied to a
// key mixed from the seed and the index. Bijective in the low 32 index bits for
// a fixed (seed, index >> 32), so consecutive indices never repeat a draw.
PYCOMM_HOST_DEVICE uint32_t quantizeMix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// Key for indices [hi << 32, (hi + 1) << 32): depends on the whole seed.
PYCOMM_HOST_DEVICE uint32_t quantizeSeedKey(uint64_t seed, uint32_t hi) {
  uint32_t k = quantizeMix32(static_cast<uint32_t>(seed) ^ 0x9E3779B9u);
  k = quantizeMix32(k ^ static_cast<uint32_t>(seed >> 32) ^ 0x7F4A7C15u);
  return quantizeMix32(k + hi * 0x632BE5ABu);
}

// Uniform in [0, 1) with 24 random bits, for element `lo` (low 32 bits of its index).
PYCOMM_HOST_DEVICE float quantizeUniform(uint32_t key, uint32_t lo) {
  const uint32_t h = quantizeMix32(lo * 0x9E3779B1u + key);
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

}  // namespace pycomm
