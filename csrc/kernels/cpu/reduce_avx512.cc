// Element-wise reductions, the AVX-512 copy (reduce_body.h's loops; reduce.cc dispatches).
#include "kernels/cpu/reduce_body.h"

#ifdef PYCOMM_X86_DISPATCH
namespace pycomm {
namespace reduce_isa {

PYCOMM_TARGET_AVX512 void widenFp16Avx512(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        out + i, _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  widenLoop<Half16::kFloat16>(in + i, out + i, n - i);
}

PYCOMM_TARGET_AVX512 void narrowFp16Avx512(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  narrowLoop<Half16::kFloat16>(in + i, out + i, n - i);
}

PYCOMM_TARGET_AVX512 void reduceAvx512(void* d, const void* a, const void* b, size_t n,
                                       DataType t, ReduceOp op) {
  reduceBody<CpuIsa::kAvx512>(d, a, b, n, t, op);
}
PYCOMM_TARGET_AVX512 void divideAvx512(void* buf, size_t n, DataType t, int divisor) {
  divideBody<CpuIsa::kAvx512>(buf, n, t, divisor);
}
PYCOMM_TARGET_AVX512 void reduceManyAvx512(void* d, const void* const* s, int n, size_t c, DataType t,
                                           ReduceOp op) {
  reduceManyBody<CpuIsa::kAvx512>(d, s, n, c, t, op);
}

}  // namespace reduce_isa
}  // namespace pycomm
#endif
