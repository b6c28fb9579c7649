// Top-k selection by magnitude; the contract is in topk.h.
//
// Magnitudes are compared as keys: the bit pattern of |x| read as a non-negative
// int32, which orders like |x| (NaN above +inf). The one hot loop (collect the
// elements whose key reaches a bound) has a portable form and an AVX2 form picked
// at run time, which compares 64 keys into a bit mask and visits only its set bits:
// at 1% density about half of all 64-element chunks hold a hit, and testing every
// element of those one by one was half the time of an exact selection.
#include "kernels/cpu/topk.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/quantize.h"  // quantizeMix32 / quantizeSeedKey (sample positions)

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define PYCOMM_TOPK_INLINE inline __attribute__((always_inline))
#else
#define PYCOMM_TOPK_INLINE inline
#endif

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define PYCOMM_TOPK_X86_DISPATCH 1
#endif

namespace pycomm {
namespace {

PYCOMM_TOPK_INLINE int32_t keyOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return static_cast<int32_t>(b & 0x7FFFFFFFu);
}

float magnitudeOf(int32_t key) {
  float x;
  const uint32_t b = static_cast<uint32_t>(key);
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Elements (in index order) whose key reached a bound.
struct Hits {
  std::vector<int64_t> index;
  std::vector<float> value;
  void push(size_t i, float v) {
    index.push_back(static_cast<int64_t>(i));
    value.push_back(v);
  }
  size_t size() const { return index.size(); }
};

constexpr size_t kScanChunk = 64;

// The elements from `base` on, one at a time (what is left after the whole chunks).
template <bool Sum>
PYCOMM_TOPK_INLINE void collectTail(const float* x, float* e, size_t base, size_t n, int32_t low, Hits& hits) {
  for (; base < n; ++base) {
    float v;
    if constexpr (Sum) {
      v = x[base] + e[base];
      e[base] = v;
    } else {
      v = x[base];
    }
    if (keyOf(v) >= low) hits.push(base, v);
  }
}

// Appends every element with key >= low. With Sum, the element is g[i] + e[i]
// and is also stored into e[i] (the error-feedback pass).
template <bool Sum>
PYCOMM_TOPK_INLINE void collectBody(const float* __restrict x, float* __restrict e, size_t n,
                                    int32_t low, Hits& hits) {
  size_t base = 0;
  for (; base + kScanChunk <= n; base += kScanChunk) {
    const float* src;
    if constexpr (Sum) {
      float* __restrict v = e + base;
      const float* __restrict g = x + base;
      for (size_t j = 0; j < kScanChunk; ++j) v[j] = g[j] + v[j];
      src = v;
    } else {
      src = x + base;
    }
    int32_t reached = 0;
    for (size_t j = 0; j < kScanChunk; ++j) reached |= keyOf(src[j]) >= low ? 1 : 0;
    if (reached) {
      for (size_t j = 0; j < kScanChunk; ++j)
        if (keyOf(src[j]) >= low) hits.push(base + j, src[j]);
    }
  }
  collectTail<Sum>(x, e, base, n, low, hits);
}

void collectBaseline(const float* x, float* e, size_t n, int32_t low, Hits& hits) {
  if (e) collectBody<true>(x, e, n, low, hits);
  else collectBody<false>(x, nullptr, n, low, hits);
}

#ifdef PYCOMM_TOPK_X86_DISPATCH
// collectBody with the chunk's 64 comparisons gathered into a bit mask (8 compares of 8
// keys, movemask), whose set bits are the hits, in index order.
template <bool Sum>
__attribute__((target("avx2"))) PYCOMM_TOPK_INLINE void collectMaskBody(const float* x, float* e, size_t n,
                                                                      int32_t low, Hits& hits) {
  const __m256i noSign = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i below = _mm256_set1_epi32(low - 1);  // key >= low <=> key > low - 1 (low >= 0)
  size_t base = 0;
  for (; base + kScanChunk <= n; base += kScanChunk) {
    const float* src = Sum ? e + base : x + base;
    uint64_t mask = 0;
    for (size_t b = 0; b < kScanChunk / 8; ++b) {
      __m256 v;
      if constexpr (Sum) {
        v = _mm256_add_ps(_mm256_loadu_ps(x + base + 8 * b), _mm256_loadu_ps(e + base + 8 * b));
        _mm256_storeu_ps(e + base + 8 * b, v);
      } else {
        v = _mm256_loadu_ps(x + base + 8 * b);
      }
      const __m256i key = _mm256_and_si256(_mm256_castps_si256(v), noSign);
      const __m256i hit = _mm256_cmpgt_epi32(key, below);
      mask |= uint64_t(uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(hit)))) << (8 * b);
    }
    while (mask != 0) {
      const size_t j = static_cast<size_t>(__builtin_ctzll(mask));
      hits.push(base + j, src[j]);
      mask &= mask - 1;
    }
  }
  collectTail<Sum>(x, e, base, n, low, hits);
}

__attribute__((target("avx2"))) void collectAvx2(const float* x, float* e, size_t n, int32_t low,
                                                 Hits& hits) {
  if (e) collectMaskBody<true>(x, e, n, low, hits);
  else collectMaskBody<false>(x, nullptr, n, low, hits);
}
bool topkHasAvx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

// x = the data (with e == nullptr), or g with e: then e <- g + e and the data is e.
void collectAtLeast(const float* x, float* e, size_t n, int32_t low, Hits& hits) {
#ifdef PYCOMM_TOPK_X86_DISPATCH
  if (topkHasAvx2()) return collectAvx2(x, e, n, low, hits);
#endif
  collectBaseline(x, e, n, low, hits);
}

// The k largest keys among hits (k <= hits.size()), ties by lowest index,
// written in index order.
void selectFromHits(const Hits& hits, size_t k, int64_t* indices, float* values) {
  const size_t h = hits.size();
  std::vector<int32_t> keys(h);
  for (size_t i = 0; i < h; ++i) keys[i] = keyOf(hits.value[i]);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<int32_t>());
  const int32_t kth = keys[k - 1];
  size_t greater = 0;
  for (size_t i = 0; i < h; ++i) greater += keyOf(hits.value[i]) > kth ? 1 : 0;
  size_t ties = k - greater;
  size_t out = 0;
  for (size_t i = 0; i < h && out < k; ++i) {
    const int32_t key = keyOf(hits.value[i]);
    if (key > kth || (key == kth && ties > 0)) {
      if (key == kth) --ties;
      indices[out] = hits.index[i];
      values[out] = hits.value[i];
      ++out;
    }
  }
  PYCOMM_CHECK_INTERNAL(out == k, "top-k selected ", out, " of ", k);
}

constexpr int kHistogramShift = 19;  // 31-bit keys -> 4096 bins (exponent + 4 mantissa bits)
constexpr size_t kBins = size_t(1) << (31 - kHistogramShift);

// Pass 1 of the exact selection: histogram of the top key bits of x (4 interleaved
// copies, so that runs of equal bins do not serialize on one counter). With Sum, x is e
// and each element first becomes g[i] + e[i] (the error-feedback sum, in the same pass).
template <bool Sum>
std::vector<uint64_t> keyHistogram(const float* g, float* x, size_t n) {
  std::vector<uint64_t> hist(kBins, 0);
  std::vector<uint32_t> part(4 * kBins);
  constexpr size_t kFlush = size_t(1) << 30;  // keeps the uint32 counters from overflowing
  for (size_t start = 0; start < n; start += kFlush) {
    std::fill(part.begin(), part.end(), 0u);
    const size_t end = std::min(n, start + kFlush);
    size_t i = start;
    for (; i + 4 <= end; i += 4) {
      if constexpr (Sum)
        for (size_t j = 0; j < 4; ++j) x[i + j] = g[i + j] + x[i + j];
      ++part[0 * kBins + (keyOf(x[i]) >> kHistogramShift)];
      ++part[1 * kBins + (keyOf(x[i + 1]) >> kHistogramShift)];
      ++part[2 * kBins + (keyOf(x[i + 2]) >> kHistogramShift)];
      ++part[3 * kBins + (keyOf(x[i + 3]) >> kHistogramShift)];
    }
    for (; i < end; ++i) {
      if constexpr (Sum) x[i] = g[i] + x[i];
      ++part[keyOf(x[i]) >> kHistogramShift];
    }
    for (size_t b = 0; b < kBins; ++b)
      hist[b] += uint64_t(part[b]) + part[kBins + b] + part[2 * kBins + b] + part[3 * kBins + b];
  }
  return hist;
}

// The sampled bound of the exact selection: from kExactSampleMax strided keys, the
// r-th largest, r = twice the count the k largest should have in the sample, plus 8.
// When at least k keys reach it, the k-th largest key does too, so one collecting pass
// holds every candidate and the selection runs among about 2k of them. Below
// kExactSampledMinCount elements, or denser than 1/16, the histogram is as cheap.
constexpr size_t kExactSampleMax = 4096;
constexpr size_t kExactSampledMinCount = 8192;

void collectKey(const float* x, size_t n, int32_t key, size_t quota, std::vector<int64_t>& out);

// The hits and the elements of data at `ties` (both in index order) merged in index
// order into indices/values; returns how many were written.
size_t mergeByIndex(const Hits& hits, const std::vector<int64_t>& ties, const float* data, int64_t* indices,
                    float* values) {
  size_t out = 0, a = 0, t = 0;
  while (a < hits.size() || t < ties.size()) {
    if (t == ties.size() || (a < hits.size() && hits.index[a] < ties[t])) {
      indices[out] = hits.index[a];
      values[out] = hits.value[a];
      ++a;
    } else {
      indices[out] = ties[t];
      values[out] = data[ties[t]];
      ++t;
    }
    ++out;
  }
  return out;
}

// The exact selection when the k-th largest key is in the lowest histogram bin, with the
// zeros: fewer than about k nonzero elements (an embedding's dense gradient, a frozen
// block). Collecting that bin would hand selectFromHits every zero (16 MiB of zeros:
// several times the usual selection); instead the nonzero elements, and if they are
// fewer than k, the first zeros by index (the ties at 0 go to the lowest indices, as
// selectFromHits breaks them). Written in index order.
void exactAmongZeros(const float* x, size_t n, size_t k, int64_t* indices, float* values) {
  Hits hits;
  collectAtLeast(x, nullptr, n, 1, hits);  // key >= 1: every nonzero element, denormals too
  if (hits.size() >= k) {
    selectFromHits(hits, k, indices, values);
    return;
  }
  std::vector<int64_t> zeros;
  collectKey(x, n, 0, k - hits.size(), zeros);  // n - nonzero >= k - nonzero zeros exist
  mergeByIndex(hits, zeros, x, indices, values);
}

// Whether the sample says that the keys equal to `bound` alone would be about k or
// more of the n elements (each sampled key stands for `stride` of them): sign-like or
// few-level data, a constant buffer. Collecting every key >= bound would then take all
// of them (a constant buffer: the whole of it; 16 Mi floats took 410-450 ms, not 14), where
// at most k of them can be kept. NaN's largest key has no key above it: never.
bool tiedAtBound(const std::vector<int32_t>& sample, int32_t bound, size_t stride, size_t k) {
  if (bound == INT32_MAX) return false;
  size_t equal = 0;
  for (int32_t key : sample) equal += key == bound ? 1 : 0;
  return equal * stride >= k;
}

// Elements above `bound` into `above` (from src; with e, the data is src + e, written to
// e in the same pass), then, if they are fewer than `want`, the first `want - above`
// elements (by index) whose key equals bound into `ties`. Returns the data read.
const float* collectAboveThenTies(const float* src, float* e, size_t n, int32_t bound, size_t want, Hits& above,
                                  std::vector<int64_t>& ties) {
  collectAtLeast(src, e, n, bound + 1, above);
  const float* data = e != nullptr ? e : src;
  if (above.size() < want) collectKey(data, n, bound, want - above.size(), ties);
  return data;
}

// The exact selection over x[0, n). With g != nullptr, x is e, and e <- g + e first
// (fused into the first pass).
void exactImpl(const float* x, size_t n, size_t k, int64_t* indices, float* values,
               const float* g = nullptr) {
  float* e = const_cast<float*>(x);  // written only with g, where the caller passed e
  if (k == 0 || k >= n) {
    if (g != nullptr)
      for (size_t i = 0; i < n; ++i) e[i] = g[i] + e[i];
    for (size_t i = 0; k != 0 && i < n; ++i) {
      indices[i] = static_cast<int64_t>(i);
      values[i] = x[i];
    }
    return;
  }
  if (n >= kExactSampledMinCount && 16 * k <= n) {
    const size_t m = std::min(kExactSampleMax, n / 8);
    const size_t stride = n / m;
    std::vector<int32_t> sample(m);
    for (size_t j = 0; j < m; ++j) {
      const size_t i = j * stride + quantizeMix32(static_cast<uint32_t>(j)) % stride;
      sample[j] = keyOf(g != nullptr ? g[i] + e[i] : x[i]);
    }
    const size_t r = std::min(m, static_cast<size_t>(std::ceil(2.0 * double(m) * double(k) / double(n))) + 8);
    std::nth_element(sample.begin(), sample.begin() + (r - 1), sample.end(), std::greater<int32_t>());
    const int32_t bound = sample[r - 1];
    if (bound > 0 && tiedAtBound(sample, bound, stride, k)) {
      // The k largest are every key above the bound and, if those are fewer than k, the
      // lowest-index keys equal to it (when enough exist; else the k-th key is lower).
      Hits above;
      std::vector<int64_t> ties;
      const float* data = collectAboveThenTies(g != nullptr ? g : x, g != nullptr ? e : nullptr, n, bound, k,
                                               above, ties);
      if (above.size() >= k) {
        selectFromHits(above, k, indices, values);
        return;
      }
      if (above.size() + ties.size() == k) {
        mergeByIndex(above, ties, data, indices, values);
        return;
      }
      g = nullptr;  // the k-th key is below the bound (rare): e holds g + e now
    } else if (bound > 0) {  // a zero bound would collect every zero
      Hits hits;
      hits.index.reserve(r * stride + r * stride / 4 + 64);
      hits.value.reserve(r * stride + r * stride / 4 + 64);
      collectAtLeast(g != nullptr ? g : x, g != nullptr ? e : nullptr, n, bound, hits);
      if (hits.size() >= k) {
        selectFromHits(hits, k, indices, values);
        return;
      }
      g = nullptr;  // too few (rare): e holds g + e now; the histogram passes run on it
    }
  }
  const std::vector<uint64_t> hist = g != nullptr ? keyHistogram<true>(g, e, n) : keyHistogram<false>(nullptr, e, n);
  size_t bin = kBins;
  uint64_t atOrAbove = 0;
  while (bin > 0) {
    --bin;
    atOrAbove += hist[bin];
    if (atOrAbove >= k) break;
  }
  if (bin == 0) return exactAmongZeros(x, n, k, indices, values);
  // Pass 2: everything in or above the k-th bin, then an exact selection among it.
  Hits hits;
  hits.index.reserve(atOrAbove);
  hits.value.reserve(atOrAbove);
  collectAtLeast(x, nullptr, n, static_cast<int32_t>(bin << kHistogramShift), hits);
  selectFromHits(hits, k, indices, values);
}

// First `quota` indices (in order) whose element's key is `key` (0: +-0).
void collectKey(const float* x, size_t n, int32_t key, size_t quota, std::vector<int64_t>& out) {
  for (size_t i = 0; i < n && out.size() < quota; ++i)
    if (keyOf(x[i]) == key) out.push_back(static_cast<int64_t>(i));
}

constexpr size_t kSampleMin = 65536;
// The sample holds ~1024 elements above the threshold (relative error of the
// estimate ~3%); the threshold aims 5% above k, since too many candidates cost
// one cheap trim while too few cost a full exact pass.
constexpr double kSamplePerKept = 1024.0;
constexpr double kAimAbove = 1.05;

// Approximate selection (DGC). g/e as in collectAtLeast: with e, the data is g + e and
// e holds it afterwards.
size_t approxImpl(const float* x, float* e, size_t n, size_t k, uint64_t seed, int64_t* indices,
                  float* values, TopkInfo* info) {
  TopkInfo local;
  TopkInfo& stats = info ? *info : local;
  stats = TopkInfo{};
  auto exactOnData = [&](const float* data) {
    exactImpl(data, n, k, indices, values);
    return k;
  };
  if (n < kTopkApproxMinCount || k == 0 || k >= n / 2) {
    if (e) {
      exactImpl(e, n, k, indices, values, x);  // e <- x + e in its first pass
      return k;
    }
    return exactOnData(x);
  }
  const size_t lo = topkBandLow(k), hi = topkBandHigh(k);

  // Threshold estimate from a jittered strided sample.
  size_t m = std::max(kSampleMin, static_cast<size_t>(std::ceil(kSamplePerKept * double(n) / double(k))));
  m = std::min(m, n / 4);
  const size_t stride = n / m;
  const uint32_t key = quantizeSeedKey(seed ^ 0x5A17C0DEull, 0);
  std::vector<int32_t> sample(m);
  for (size_t j = 0; j < m; ++j) {
    const size_t i = j * stride + quantizeMix32(key + static_cast<uint32_t>(j)) % stride;
    sample[j] = keyOf(e ? x[i] + e[i] : x[i]);
  }
  size_t rank = static_cast<size_t>(std::llround(kAimAbove * double(m) * double(k) / double(n)));
  rank = std::min(std::max<size_t>(rank, 1), m);
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(),
                   std::greater<int32_t>());
  const int32_t threshold = sample[rank - 1];
  stats.sampleSize = m;
  stats.threshold = magnitudeOf(threshold);

  if (threshold > 0 && tiedAtBound(sample, threshold, stride, k)) {
    // Most of the band would be ties at the threshold: keep those above it and fill up
    // to k with the lowest-index ties, without collecting every tie first.
    Hits above;
    std::vector<int64_t> ties;
    const float* data = collectAboveThenTies(x, e, n, threshold, k, above, ties);
    if (above.size() > hi) {
      stats.path = TopkPath::kTrimmed;
      selectFromHits(above, k, indices, values);
      return k;
    }
    if (above.size() >= lo) {
      stats.path = TopkPath::kOnePass;
      std::copy(above.index.begin(), above.index.end(), indices);
      std::copy(above.value.begin(), above.value.end(), values);
      return above.size();
    }
    if (above.size() + ties.size() >= lo) {
      stats.path = TopkPath::kTieFill;
      return mergeByIndex(above, ties, data, indices, values);
    }
    stats.path = TopkPath::kFallback;
    return exactOnData(data);
  }

  // The one pass: everything >= threshold (> 0 when the threshold is 0, so that a
  // mostly-zero gradient does not collect its zeros).
  Hits hits;
  hits.index.reserve(hi + hi / 4 + 16);
  hits.value.reserve(hi + hi / 4 + 16);
  collectAtLeast(x, e, n, threshold == 0 ? 1 : threshold, hits);
  const float* data = e ? e : x;

  size_t above = 0, equal = 0;
  for (size_t i = 0; i < hits.size(); ++i) {
    const int32_t kk = keyOf(hits.value[i]);
    above += kk > threshold ? 1 : 0;
    equal += kk == threshold ? 1 : 0;
  }
  if (above > hi) {
    stats.path = TopkPath::kTrimmed;
    selectFromHits(hits, k, indices, values);
    return k;
  }
  if (above >= lo) {
    stats.path = TopkPath::kOnePass;
    size_t out = 0;
    for (size_t i = 0; i < hits.size(); ++i) {
      if (keyOf(hits.value[i]) > threshold) {
        indices[out] = hits.index[i];
        values[out] = hits.value[i];
        ++out;
      }
    }
    return out;
  }
  // Too few above the threshold: fill with elements equal to it, lowest index first.
  const size_t quota = k - above;
  if (threshold != 0 && above + equal >= lo) {
    stats.path = TopkPath::kTieFill;
    size_t out = 0, ties = std::min(quota, equal);
    for (size_t i = 0; i < hits.size(); ++i) {
      const int32_t kk = keyOf(hits.value[i]);
      if (kk > threshold || (kk == threshold && ties > 0)) {
        if (kk == threshold) --ties;
        indices[out] = hits.index[i];
        values[out] = hits.value[i];
        ++out;
      }
    }
    return out;
  }
  if (threshold == 0) {
    std::vector<int64_t> zeros;
    zeros.reserve(quota);
    collectKey(data, n, 0, quota, zeros);
    if (above + zeros.size() >= lo) {
      stats.path = TopkPath::kTieFill;
      return mergeByIndex(hits, zeros, data, indices, values);
    }
  }
  stats.path = TopkPath::kFallback;
  return exactOnData(data);
}

}  // namespace

size_t topkCount(const char* op, size_t count, double density) {
  PYCOMM_CHECK_USAGE(density > 0.0 && density <= 1.0, "pycomm ", op,
                     ": density must be in (0, 1] (got ", density, ")");
  if (count == 0) return 0;
  const double want = std::ceil(density * static_cast<double>(count) - 1e-9);
  size_t k = want < 1.0 ? 1 : static_cast<size_t>(want);
  return std::min(k, count);
}

void topkExact(const float* x, size_t count, size_t k, int64_t* indices, float* values) {
  PYCOMM_CHECK_USAGE(k <= count, "pycomm topk: k = ", k, " exceeds the count ", count);
  exactImpl(x, count, k, indices, values);
}

size_t topkApprox(const float* x, size_t count, size_t k, uint64_t seed, int64_t* indices,
                  float* values, TopkInfo* info) {
  PYCOMM_CHECK_USAGE(k <= count, "pycomm topk: k = ", k, " exceeds the count ", count);
  return approxImpl(x, nullptr, count, k, seed, indices, values, info);
}

size_t topkErrorFeedback(const float* g, float* e, size_t count, size_t k, bool exact,
                         uint64_t seed, int64_t* indices, float* values, TopkInfo* info) {
  PYCOMM_CHECK_USAGE(k <= count, "pycomm topk_ef: k = ", k, " exceeds the count ", count);
  size_t m;
  if (exact) {
    exactImpl(e, count, k, indices, values, g);  // e <- g + e in its first pass
    m = k;
    if (info) *info = TopkInfo{};
  } else {
    m = approxImpl(g, e, count, k, seed, indices, values, info);
  }
  for (size_t j = 0; j < m; ++j) e[indices[j]] = 0.0f;
  return m;
}

}  // namespace pycomm
