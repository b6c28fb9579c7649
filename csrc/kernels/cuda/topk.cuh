// Top-k by magnitude on the GPU (device pointers, asynchronous on `stream`).
//
// exact: exactly k entries: radix select of the k-th |x| (4 histogram passes of
//   8 bits over the 31-bit key of |x|, the digit chosen on the device, no host
//   sync), then one compaction pass. Ties at the k-th magnitude: an arbitrary
//   subset of them. OUTPUT ORDER IS UNSPECIFIED (atomic compaction), unlike the
//   CPU kernel's ascending index order; sort the indices if order matters.
// approximate (Deep Gradient Compression, Lin et al. 2018): radix select on a
//   jittered strided sample gives the threshold, one pass keeps |x| > threshold;
//   if that count falls outside [topkBandLow(k), topkBandHigh(k)] the exact path
//   runs (its kernels are launched anyway and return at once when not needed),
//   so the band of kernels/cpu/topk.h holds without a host round trip.
// The number selected is written to *countOut (device int64).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pycomm {
namespace cuda {

// Scratch bytes the calls below need for (count, k), 256-byte aligned.
size_t topkWorkspaceBytes(size_t count, size_t k);

// indices/values hold k (exact) or topkBandHigh(k) (approximate) entries.
void topkExact(const float* x, size_t count, size_t k, int64_t* indices, float* values,
               int64_t* countOut, void* workspace, cudaStream_t stream);

void topkApprox(const float* x, size_t count, size_t k, uint64_t seed, int64_t* indices,
                float* values, int64_t* countOut, void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
