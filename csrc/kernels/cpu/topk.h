// Top-k selection by magnitude on float32 buffers (no torch, no transport), for
// sparsified gradient exchange.
//
// Both modes return (indices, values) in ASCENDING INDEX order; values are the
// signed input values at those indices. Magnitude order is the order of |x|'s
// bit pattern: NaN counts as larger than +inf (as in torch.topk).
//
//   exact:        exactly k = topkCount(count, density) elements, the k largest
//                 |x|. Ties at the k-th magnitude are broken by lowest index.
//                 A bound from a strided sample of 4096 keys (about twice k of
//                 them reach it), one pass collecting the elements at or above
//                 it, then an exact selection among those. When the sample says
//                 the keys equal to the bound alone are about k or more (sign-like
//                 or few-level data, a constant buffer), the pass collects only the
//                 keys above it and a second one the lowest-index keys equal to it,
//                 as many as k needs. When fewer than k
//                 reach the bound (rare), radix select: one histogram pass over
//                 the top 12 bits of |x|, one pass collecting the elements in or
//                 above the k-th bin, then an exact selection among those.
//   approximate:  m elements with topkBandLow(k) <= m <= topkBandHigh(k), i.e.
//                 |m - k| <= k / 10 (achieved density within +-10% of the asked
//                 one, up to the rounding of k); all of them have |x| >= every
//                 unselected |x|. As in Deep Gradient Compression (Lin et al.
//                 2018): estimate the threshold from a sample (strided with
//                 jitter, drawn from a counter-based hash of the seed), then one
//                 pass selecting |x| > threshold. The band is enforced, not hoped
//                 for: too many -> exact selection among the few candidates; too
//                 few -> fill with elements equal to the threshold (lowest index
//                 first; with heavy ties in the sample, the pass collects only the
//                 keys above the threshold, as in exact mode); still too few
//                 (rare) -> exact selection. Inputs below kTopkApproxMinCount
//                 elements use the exact mode.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pycomm {

constexpr size_t kTopkApproxMinCount = size_t(1) << 18;

// k for a density in (0, 1]: ceil(density * count), at least 1 when count > 0.
// Throws a usage error (naming `op`) for a density outside (0, 1].
size_t topkCount(const char* op, size_t count, double density);

inline size_t topkBandLow(size_t k) { return k - k / 10; }
inline size_t topkBandHigh(size_t k) { return k + k / 10; }

// Which path the approximate selection took (for tests and benchmarks).
enum class TopkPath : int {
  kExact = 0,       // exact mode, or input too small for sampling
  kOnePass = 1,     // sampled threshold, one pass, inside the band
  kTieFill = 2,     // ... plus elements equal to the threshold
  kTrimmed = 3,     // ... too many: exact selection among the candidates
  kFallback = 4,    // sample was off: exact selection over the whole input
};

struct TopkInfo {
  TopkPath path = TopkPath::kExact;
  size_t sampleSize = 0;
  float threshold = 0.0f;  // |x| threshold the sample gave (approximate mode)
};

// Writes exactly k entries. indices/values hold k entries. k <= count.
void topkExact(const float* x, size_t count, size_t k, int64_t* indices, float* values);

// Writes m entries (returned), topkBandLow(k) <= m <= topkBandHigh(k);
// indices/values hold topkBandHigh(k) entries. Deterministic given seed.
size_t topkApprox(const float* x, size_t count, size_t k, uint64_t seed, int64_t* indices,
                  float* values, TopkInfo* info = nullptr);

// Fused error feedback: v = g + e; select the top-k of v (exact or approximate as
// above) into indices/values; e <- v with the selected entries set to 0, i.e.
// e_new == v - scatter(indices, values) exactly. The approximate mode reads g and
// e once (plus the sample). Returns the number selected.
size_t topkErrorFeedback(const float* g, float* e, size_t count, size_t k, bool exact,
                         uint64_t seed, int64_t* indices, float* values,
                         TopkInfo* info = nullptr);

}  // namespace pycomm
