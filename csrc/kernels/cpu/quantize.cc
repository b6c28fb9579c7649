// Block quantization kernels; the layout and the rounding rules are documented in
// quantize.h. The per-element loops are written so that the compiler
// auto-vectorizes them; they are compiled twice (the portable baseline and an
// AVX2 copy picked at run time), never with -march=native.
#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "kernels/cpu/cpu_isa.h"

// Fused error feedback needs e = v - code * scale rounded exactly as dequantize()
// rounds code * scale: forbid fusing the multiply and the subtraction (FMA).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif


namespace pycomm {
namespace {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 half-to-even

PYCOMM_ALWAYS_INLINE uint32_t absBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b & 0x7FFFFFFFu;
}

PYCOMM_ALWAYS_INLINE float fromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

PYCOMM_ALWAYS_INLINE void storeScale(uint8_t* p, float s) { std::memcpy(p, &s, sizeof s); }
PYCOMM_ALWAYS_INLINE float loadScale(const uint8_t* p) {
  float s;
  std::memcpy(&s, p, sizeof s);
  return s;
}

size_t codeBytes(size_t n, int bits) { return (n * static_cast<size_t>(bits) + 7) / 8; }

// Where element values come from: plain x, or g + e for error feedback. Both
// recompute the same float for the same index, so a block can be read twice.
struct PlainSource {
  const float* x;
  PYCOMM_ALWAYS_INLINE float operator()(size_t i) const { return x[i]; }
};
struct SumSource {
  const float* g;
  const float* e;
  PYCOMM_ALWAYS_INLINE float operator()(size_t i) const { return g[i] + e[i]; }
};

// Uniform draws for the elements of one block. Fast: the block lies within one
// 2^32-index window (constant key). Slow: it straddles one (at most one block per 4G elements).
struct FastUniform {
  uint32_t key;
  uint32_t lo0;
  PYCOMM_ALWAYS_INLINE float operator()(size_t j) const {
    return quantizeUniform(key, lo0 + static_cast<uint32_t>(j));
  }
};
struct SlowUniform {
  uint64_t seed;
  size_t base;
  PYCOMM_ALWAYS_INLINE float operator()(size_t j) const {
    const uint64_t i = static_cast<uint64_t>(base + j);
    return quantizeUniform(quantizeSeedKey(seed, static_cast<uint32_t>(i >> 32)),
                           static_cast<uint32_t>(i));
  }
};

// 8/4-bit code of v = x * inv (|v| <= L up to rounding), clamped to [-L, L].
template <int L, bool Stochastic>
PYCOMM_ALWAYS_INLINE int32_t codeOf(float v, float u) {
  int32_t c;
  if constexpr (Stochastic) {
    int32_t t = static_cast<int32_t>(v);       // truncation
    t -= static_cast<float>(t) > v ? 1 : 0;    // floor
    const float frac = v - static_cast<float>(t);
    c = t + (u < frac ? 1 : 0);
  } else {
    c = static_cast<int32_t>((v + kRoundMagic) - kRoundMagic);
  }
  c = c < -L ? -L : c;
  c = c > L ? L : c;
  return c;
}

// Packs 8 signs per byte, lowest bit first; bit 1 decodes to +scale, bit 0 to
// -scale. bitOf(j, v) decides element j's bit. With EF, also writes
// e[base + j] = v - decode(bit).
template <bool EF, typename Source, typename BitOf>
PYCOMM_ALWAYS_INLINE void packSigns(const Source& src, float* e, size_t base, size_t n, float scale,
                                    const BitOf& bitOf, uint8_t* __restrict codes) {
  const size_t full = n / 8;
  for (size_t b = 0; b < full; ++b) {  // fixed 8 lanes: the loop the compiler vectorizes
    uint32_t byte = 0;
    for (int l = 0; l < 8; ++l) {
      const float v = src(base + 8 * b + l);
      const uint32_t bit = bitOf(8 * b + l, v);
      byte |= bit << l;
      if constexpr (EF) e[base + 8 * b + l] = v - (bit ? scale : -scale);
    }
    codes[b] = static_cast<uint8_t>(byte);
  }
  if (n % 8) {
    uint32_t byte = 0;
    for (size_t l = 0; l < n % 8; ++l) {
      const float v = src(base + 8 * full + l);
      const uint32_t bit = bitOf(8 * full + l, v);
      byte |= bit << l;
      if constexpr (EF) e[base + 8 * full + l] = v - (bit ? scale : -scale);
    }
    codes[full] = static_cast<uint8_t>(byte);
  }
}

// Quantizes one block of n elements src(base + j), j < n, into out (scale, codes);
// with EF, also writes e[base + j] = v - decode(code).
template <int Bits, bool Stochastic, bool EF, typename Source, typename Uniform>
PYCOMM_ALWAYS_INLINE void quantizeBlock(const Source& src, float* e, size_t base,
                                        size_t n, const Uniform& uniform, uint8_t* __restrict out) {
  uint8_t* __restrict codes = out + 4;
  if constexpr (Bits == 1 && !Stochastic) {
    // scale = mean |v|, summed in 8 fixed lanes (vectorizable, order fixed).
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t j = 0;
    for (; j + 8 <= n; j += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += std::fabs(src(base + j + l));
    for (; j < n; ++j) lanes[0] += std::fabs(src(base + j));
    const float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                      ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    const float scale = sum / static_cast<float>(n);
    storeScale(out, scale);
    packSigns<EF>(src, e, base, n, scale, [](size_t, float v) { return v >= 0.0f ? 1u : 0u; }, codes);
    return;
  } else {
    uint32_t maxBits = 0;
    for (size_t j = 0; j < n; ++j) {
      const uint32_t b = absBits(src(base + j));
      maxBits = maxBits > b ? maxBits : b;
    }
    const float maxAbs = fromBits(maxBits);
    constexpr int L = Bits == 8 ? 127 : Bits == 4 ? 7 : 1;
    // 1-bit stochastic: scale = max|v|, P(bit) = (1 + v / scale) / 2.
    const float scale = Bits == 1 ? maxAbs : maxAbs / static_cast<float>(L);
    storeScale(out, scale);
    // A zero block codes 0 (decodes to 0); 1-bit then stores bit 1 (decodes to +0).
    const float inv = maxAbs > 0.0f ? static_cast<float>(L) / maxAbs : 0.0f;
    if constexpr (Bits == 8) {
      int8_t* __restrict c8 = reinterpret_cast<int8_t*>(codes);
      for (size_t j = 0; j < n; ++j) {
        const float v = src(base + j);
        const int32_t c = codeOf<127, Stochastic>(v * inv, Stochastic ? uniform(j) : 0.0f);
        c8[j] = static_cast<int8_t>(c);
        if constexpr (EF) e[base + j] = v - static_cast<float>(c) * scale;
      }
    } else if constexpr (Bits == 4) {
      const size_t pairs = n / 2;
      for (size_t p = 0; p < pairs; ++p) {
        const float v0 = src(base + 2 * p);
        const float v1 = src(base + 2 * p + 1);
        const int32_t c0 = codeOf<7, Stochastic>(v0 * inv, Stochastic ? uniform(2 * p) : 0.0f);
        const int32_t c1 = codeOf<7, Stochastic>(v1 * inv, Stochastic ? uniform(2 * p + 1) : 0.0f);
        codes[p] = static_cast<uint8_t>((c0 + 8) | ((c1 + 8) << 4));
        if constexpr (EF) {
          e[base + 2 * p] = v0 - static_cast<float>(c0) * scale;
          e[base + 2 * p + 1] = v1 - static_cast<float>(c1) * scale;
        }
      }
      if (n % 2) {
        const float v0 = src(base + n - 1);
        const int32_t c0 = codeOf<7, Stochastic>(v0 * inv, Stochastic ? uniform(n - 1) : 0.0f);
        codes[pairs] = static_cast<uint8_t>(c0 + 8);
        if constexpr (EF) e[base + n - 1] = v0 - static_cast<float>(c0) * scale;
      }
    } else {  // 1-bit stochastic
      const float half = 0.5f * inv;  // inv = 1 / max|v|
      auto bitOf = [&](size_t j, float v) -> uint32_t {
        if (!(maxAbs > 0.0f)) return 1u;
        const float p = 0.5f + v * half;
        return uniform(j) < p ? 1u : 0u;
      };
      packSigns<EF>(src, e, base, n, scale, bitOf, codes);
    }
  }
}

template <int Bits, bool Stochastic, bool EF, typename Source>
PYCOMM_ALWAYS_INLINE void quantizeAll(const Source& src, float* e, size_t count, size_t block,
                                      uint64_t seed, uint8_t* out) {
  for (size_t base = 0; base < count; base += block) {
    const size_t n = std::min(block, count - base);
    const uint64_t first = base, last = base + n - 1;
    if ((first >> 32) == (last >> 32)) {
      const FastUniform u{Stochastic ? quantizeSeedKey(seed, static_cast<uint32_t>(first >> 32)) : 0u,
                          static_cast<uint32_t>(first)};
      quantizeBlock<Bits, Stochastic, EF>(src, e, base, n, u, out);
    } else {
      quantizeBlock<Bits, Stochastic, EF>(src, e, base, n, SlowUniform{seed, base}, out);
    }
    out += 4 + codeBytes(n, Bits);
  }
}

template <int Bits>
PYCOMM_ALWAYS_INLINE void dequantizeAll(const uint8_t* __restrict packed, size_t count,
                                        size_t block, float* __restrict x) {
  for (size_t base = 0; base < count; base += block) {
    const size_t n = std::min(block, count - base);
    const float scale = loadScale(packed);
    const uint8_t* __restrict codes = packed + 4;
    float* __restrict y = x + base;
    if constexpr (Bits == 8) {
      const int8_t* c8 = reinterpret_cast<const int8_t*>(codes);
      for (size_t j = 0; j < n; ++j) y[j] = static_cast<float>(c8[j]) * scale;
    } else if constexpr (Bits == 4) {
      for (size_t p = 0; p < n / 2; ++p) {
        const int32_t byte = codes[p];
        y[2 * p] = static_cast<float>((byte & 15) - 8) * scale;
        y[2 * p + 1] = static_cast<float>((byte >> 4) - 8) * scale;
      }
      if (n % 2) y[n - 1] = static_cast<float>((codes[n / 2] & 15) - 8) * scale;
    } else {
      // Branch-free: bit 0 flips the sign bit of the scale (random signs defeat a branch).
      uint32_t scaleBits;
      std::memcpy(&scaleBits, &scale, 4);
      for (size_t j = 0; j < n; ++j) {
        const uint32_t negative = ((codes[j / 8] >> (j % 8)) & 1u) ^ 1u;
        const uint32_t v = scaleBits ^ (negative << 31);
        std::memcpy(y + j, &v, 4);
      }
    }
    packed += 4 + codeBytes(n, Bits);
  }
}

// ---- one entry point per ISA; the bodies above are inlined into each --------

struct Args {
  const float* x;   // plain source, or g with EF
  float* e;         // EF only
  size_t count;
  size_t block;
  uint64_t seed;
  uint8_t* out;
};

template <int Bits, bool Stochastic, bool EF>
PYCOMM_ALWAYS_INLINE void quantizeDispatchBody(const Args& a) {
  if constexpr (EF) {
    quantizeAll<Bits, Stochastic, true>(SumSource{a.x, a.e}, a.e, a.count, a.block, a.seed, a.out);
  } else {
    quantizeAll<Bits, Stochastic, false>(PlainSource{a.x}, nullptr, a.count, a.block, a.seed, a.out);
  }
}

PYCOMM_ALWAYS_INLINE void quantizeSelect(const Args& a, int bits, bool stochastic, bool ef) {
#define PYCOMM_Q_CASE(B)                                                      \
  if (bits == B) {                                                            \
    if (stochastic) {                                                         \
      if (ef) return quantizeDispatchBody<B, true, true>(a);                  \
      return quantizeDispatchBody<B, true, false>(a);                         \
    }                                                                         \
    if (ef) return quantizeDispatchBody<B, false, true>(a);                   \
    return quantizeDispatchBody<B, false, false>(a);                          \
  }
  PYCOMM_Q_CASE(8)
  PYCOMM_Q_CASE(4)
  PYCOMM_Q_CASE(1)
#undef PYCOMM_Q_CASE
}

PYCOMM_ALWAYS_INLINE void dequantizeSelect(const uint8_t* packed, size_t count, int bits,
                                           size_t block, float* x) {
  if (bits == 8) return dequantizeAll<8>(packed, count, block, x);
  if (bits == 4) return dequantizeAll<4>(packed, count, block, x);
  return dequantizeAll<1>(packed, count, block, x);
}

void quantizeBaseline(const Args& a, int bits, bool stochastic, bool ef) {
  quantizeSelect(a, bits, stochastic, ef);
}
void dequantizeBaseline(const uint8_t* packed, size_t count, int bits, size_t block, float* x) {
  dequantizeSelect(packed, count, bits, block, x);
}

#ifdef PYCOMM_X86_DISPATCH
// AVX2 without FMA: products must round exactly like the baseline's.
__attribute__((target("avx2"))) void quantizeAvx2(const Args& a, int bits, bool stochastic,
                                                  bool ef) {
  quantizeSelect(a, bits, stochastic, ef);
}
__attribute__((target("avx2"))) void dequantizeAvx2(const uint8_t* packed, size_t count, int bits,
                                                    size_t block, float* x) {
  dequantizeSelect(packed, count, bits, block, x);
}

#endif

void runQuantize(const Args& a, int bits, bool stochastic, bool ef) {
#ifdef PYCOMM_X86_DISPATCH
  if (cpuSupports(CpuIsa::kAvx2)) return quantizeAvx2(a, bits, stochastic, ef);
#endif
  quantizeBaseline(a, bits, stochastic, ef);
}

}  // namespace

void checkQuantizeOptions(const char* op, int bits, size_t block) {
  PYCOMM_CHECK_USAGE(bits == 8 || bits == 4 || bits == 1, "pycomm ", op,
                     ": bits must be 8, 4 or 1 (got ", bits, ")");
  PYCOMM_CHECK_USAGE(block >= 1 && block <= (size_t(1) << 30), "pycomm ", op,
                     ": block must be in [1, 2^30] (got ", block, ")");
}

size_t packedSize(size_t count, int bits, size_t block) {
  checkQuantizeOptions("packed_size", bits, block);
  const size_t full = count / block;
  const size_t tail = count % block;
  size_t bytes = full * (4 + codeBytes(block, bits));
  if (tail) bytes += 4 + codeBytes(tail, bits);
  return bytes;
}

void quantize(const float* x, size_t count, const QuantizeOptions& opts, uint8_t* out) {
  checkQuantizeOptions("quantize", opts.bits, opts.block);
  if (count == 0) return;
  runQuantize(Args{x, nullptr, count, opts.block, opts.seed, out}, opts.bits, opts.stochastic,
              false);
}

void quantizeErrorFeedback(const float* g, float* e, size_t count, const QuantizeOptions& opts,
                           uint8_t* out) {
  checkQuantizeOptions("quantize_ef", opts.bits, opts.block);
  if (count == 0) return;
  runQuantize(Args{g, e, count, opts.block, opts.seed, out}, opts.bits, opts.stochastic, true);
}

void dequantize(const uint8_t* packed, size_t count, int bits, size_t block, float* x) {
  checkQuantizeOptions("dequantize", bits, block);
  if (count == 0) return;
#ifdef PYCOMM_X86_DISPATCH
  if (cpuSupports(CpuIsa::kAvx2)) return dequantizeAvx2(packed, count, bits, block, x);
#endif
  dequantizeBaseline(packed, count, bits, block, x);
}

}  // namespace pycomm
