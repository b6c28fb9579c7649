// GPU top-k by magnitude; the contract is in topk.cuh.
#include "kernels/cuda/topk.cuh"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "kernels/cpu/quantize.h"  // quantizeMix32 / quantizeSeedKey (sample positions)
#include "kernels/cpu/topk.h"      // topkBandLow / topkBandHigh
#include "kernels/cuda/cuda_check.cuh"

namespace pycomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 4096;
constexpr size_t kSampleMin = 65536;
constexpr double kSamplePerKept = 1024.0;

// Device-side selection state.
struct SelectState {
  uint32_t prefix;          // digits of the k-th key chosen so far
  uint32_t mask;            // which bits of prefix are chosen
  unsigned long long remaining;  // rank still to find within the prefix
  unsigned long long above; // elements strictly above the k-th key (final)
  unsigned long long written;    // compaction counters
  unsigned long long tiesWritten;
  int active;               // 0: the exact path is not needed (approximate succeeded)
  int pad;
  unsigned long long hist[256];
};

__device__ __forceinline__ uint32_t keyOf(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

__global__ void initKernel(SelectState* s, unsigned long long k, int active) {
  if (threadIdx.x == 0) {
    s->prefix = 0;
    s->mask = 0;
    s->remaining = k;
    s->above = 0;
    s->written = 0;
    s->tiesWritten = 0;
    s->active = active;
  }
  for (int b = threadIdx.x; b < 256; b += blockDim.x) s->hist[b] = 0;
}

__global__ void histogramKernel(const float* __restrict__ x, size_t n, SelectState* s, int shift) {
  if (!s->active) return;
  __shared__ unsigned int local[256];
  for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const uint32_t prefix = s->prefix, mask = s->mask;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t key = keyOf(x[i]);
    if ((key & mask) == prefix) atomicAdd(&local[(key >> shift) & 255u], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x)
    if (local[b]) atomicAdd(&s->hist[b], static_cast<unsigned long long>(local[b]));
}

// One thread: choose the digit holding the remaining-th largest key.
__global__ void chooseDigitKernel(SelectState* s, int shift) {
  if (!s->active || threadIdx.x != 0) return;
  unsigned long long cum = 0;
  int digit = 0;
  for (int b = 255; b >= 0; --b) {
    if (cum + s->hist[b] >= s->remaining) {
      digit = b;
      break;
    }
    cum += s->hist[b];
  }
  s->above += cum;
  s->remaining -= cum;
  s->prefix |= uint32_t(digit) << shift;
  s->mask |= 255u << shift;
  for (int b = 0; b < 256; ++b) s->hist[b] = 0;
}

// After the 4 digits: prefix = k-th key; take every key above it and `remaining` ties.
__global__ void compactExactKernel(const float* __restrict__ x, size_t n, SelectState* s,
                                   int64_t* indices, float* values) {
  if (!s->active) return;
  const uint32_t kth = s->prefix;
  const unsigned long long above = s->above, ties = s->remaining;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    const uint32_t key = keyOf(v);
    if (key > kth) {
      const unsigned long long p = atomicAdd(&s->written, 1ull);
      indices[p] = static_cast<int64_t>(i);
      values[p] = v;
    } else if (key == kth) {
      const unsigned long long t = atomicAdd(&s->tiesWritten, 1ull);
      if (t < ties) {
        indices[above + t] = static_cast<int64_t>(i);
        values[above + t] = v;
      }
    }
  }
}

__global__ void finishExactKernel(SelectState* s, unsigned long long k, int64_t* countOut) {
  if (s->active && threadIdx.x == 0) *countOut = static_cast<int64_t>(k);
}

__global__ void sampleKernel(const float* __restrict__ x, size_t m, size_t stride, uint32_t key,
                             float* __restrict__ sample) {
  for (size_t j = blockIdx.x * size_t(blockDim.x) + threadIdx.x; j < m;
       j += size_t(gridDim.x) * blockDim.x) {
    const size_t i = j * stride + quantizeMix32(key + static_cast<uint32_t>(j)) % stride;
    sample[j] = x[i];
  }
}

// Approximate pass: keep key > threshold (the sample's selected key) up to `cap`.
__global__ void compactAboveKernel(const float* __restrict__ x, size_t n, const SelectState* t,
                                   SelectState* s, unsigned long long cap, int64_t* indices,
                                   float* values) {
  const uint32_t threshold = t->prefix;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    if (keyOf(v) > threshold) {
      const unsigned long long p = atomicAdd(&s->written, 1ull);
      if (p < cap) {
        indices[p] = static_cast<int64_t>(i);
        values[p] = v;
      }
    }
  }
}

// Inside the band: publish the count and switch the exact path off; else reset for it.
__global__ void judgeApproxKernel(SelectState* s, unsigned long long lo, unsigned long long hi,
                                  int64_t* countOut) {
  if (threadIdx.x != 0) return;
  const unsigned long long got = s->written;
  if (got >= lo && got <= hi) {
    *countOut = static_cast<int64_t>(got);
    s->active = 0;
  } else {
    s->written = 0;
    s->active = 1;
  }
}

unsigned gridFor(size_t n) {
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>((n + kThreads - 1) / kThreads, kMaxGrid)));
}

constexpr size_t align256(size_t b) { return (b + 255) / 256 * 256; }

size_t sampleSize(size_t count, size_t k) {
  size_t m = std::max(kSampleMin, static_cast<size_t>(std::ceil(kSamplePerKept * double(count) / double(k))));
  return std::min(m, count / 4);
}

// Radix select of the k-th largest key of x[0, n) into s (4 digits: bits 24..31, ..., 0..7).
void radixSelect(const char* op, const float* x, size_t n, SelectState* s, cudaStream_t stream) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    histogramKernel<<<gridFor(n), kThreads, 0, stream>>>(x, n, s, shift);
    PYCOMM_CUDA_LAUNCH_CHECK(op);
    chooseDigitKernel<<<1, 32, 0, stream>>>(s, shift);
    PYCOMM_CUDA_LAUNCH_CHECK(op);
  }
}

void exactInto(const char* op, const float* x, size_t count, size_t k, int64_t* indices,
               float* values, int64_t* countOut, SelectState* s, bool reset, cudaStream_t stream) {
  if (reset) {
    initKernel<<<1, kThreads, 0, stream>>>(s, k, 1);
    PYCOMM_CUDA_LAUNCH_CHECK(op);
  }
  radixSelect(op, x, count, s, stream);
  compactExactKernel<<<gridFor(count), kThreads, 0, stream>>>(x, count, s, indices, values);
  PYCOMM_CUDA_LAUNCH_CHECK(op);
  finishExactKernel<<<1, 32, 0, stream>>>(s, k, countOut);
  PYCOMM_CUDA_LAUNCH_CHECK(op);
}

}  // namespace

size_t topkWorkspaceBytes(size_t count, size_t k) {
  size_t bytes = 2 * align256(sizeof(SelectState));
  if (k > 0 && count >= kTopkApproxMinCount) bytes += align256(sampleSize(count, k) * sizeof(float));
  return bytes;
}

void topkExact(const float* x, size_t count, size_t k, int64_t* indices, float* values,
               int64_t* countOut, void* workspace, cudaStream_t stream) {
  PYCOMM_CHECK_USAGE(k <= count, "pycomm topk: k = ", k, " exceeds the count ", count);
  if (k == 0) {
    PYCOMM_CUDA_CHECK("topk", cudaMemsetAsync(countOut, 0, sizeof(int64_t), stream));
    return;
  }
  auto* s = static_cast<SelectState*>(workspace);
  exactInto("topk", x, count, k, indices, values, countOut, s, true, stream);
}

void topkApprox(const float* x, size_t count, size_t k, uint64_t seed, int64_t* indices,
                float* values, int64_t* countOut, void* workspace, cudaStream_t stream) {
  PYCOMM_CHECK_USAGE(k <= count, "pycomm topk: k = ", k, " exceeds the count ", count);
  if (k == 0 || count < kTopkApproxMinCount || k >= count / 2)
    return topkExact(x, count, k, indices, values, countOut, workspace, stream);
  auto* s = static_cast<SelectState*>(workspace);
  auto* sampled = reinterpret_cast<SelectState*>(static_cast<char*>(workspace) + align256(sizeof(SelectState)));
  auto* sample = reinterpret_cast<float*>(static_cast<char*>(workspace) + 2 * align256(sizeof(SelectState)));
  const size_t m = sampleSize(count, k);
  size_t rank = static_cast<size_t>(std::llround(1.05 * double(m) * double(k) / double(count)));
  rank = std::min(std::max<size_t>(rank, 1), m);

  sampleKernel<<<gridFor(m), kThreads, 0, stream>>>(x, m, count / m, quantizeSeedKey(seed ^ 0x5A17C0DEull, 0),
                                                    sample);
  PYCOMM_CUDA_LAUNCH_CHECK("topk");
  initKernel<<<1, kThreads, 0, stream>>>(sampled, rank, 1);
  PYCOMM_CUDA_LAUNCH_CHECK("topk");
  radixSelect("topk", sample, m, sampled, stream);
  initKernel<<<1, kThreads, 0, stream>>>(s, k, 1);
  PYCOMM_CUDA_LAUNCH_CHECK("topk");
  compactAboveKernel<<<gridFor(count), kThreads, 0, stream>>>(x, count, sampled, s,
                                                             topkBandHigh(k), indices, values);
  PYCOMM_CUDA_LAUNCH_CHECK("topk");
  judgeApproxKernel<<<1, 32, 0, stream>>>(s, topkBandLow(k), topkBandHigh(k), countOut);
  PYCOMM_CUDA_LAUNCH_CHECK("topk");
  // Exact fallback: its kernels return at once when the approximate pass was in the band.
  exactInto("topk", x, count, k, indices, values, countOut, s, false, stream);
}

}  // namespace cuda
}  // namespace pycomm
