// Block quantization on the GPU: the same packed layout, rounding rules and
// counter-based RNG as the CPU kernels (documented in kernels/cpu/quantize.h).
// 8/4-bit codes and stochastic draws match the CPU bit for bit (all products and
// sums use round-to-nearest intrinsics, no FMA contraction); the 1-bit
// deterministic scale (a mean) sums in a different order and may differ in the
// last bits.
//
// All pointers are device pointers; calls are asynchronous on `stream`. Usage
// errors and CUDA failures throw pycomm::Error.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/quantize.h"

namespace pycomm {
namespace cuda {

// out: packedSize(count, opts.bits, opts.block) bytes.
void quantize(const float* x, size_t count, const QuantizeOptions& opts, uint8_t* out,
              cudaStream_t stream);

void dequantize(const uint8_t* packed, size_t count, int bits, size_t block, float* x,
                cudaStream_t stream);

// out <- quantize(g + e); e <- (g + e) - dequantize(out), in one pass.
void quantizeErrorFeedback(const float* g, float* e, size_t count, const QuantizeOptions& opts,
                           uint8_t* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
