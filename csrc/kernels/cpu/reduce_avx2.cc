// Element-wise reductions, the AVX2 + F16C copy (reduce_body.h's loops; reduce.cc dispatches).
#include "kernels/cpu/reduce_body.h"

#ifdef PYCOMM_X86_DISPATCH
namespace pycomm {
namespace reduce_isa {

PYCOMM_TARGET_AVX2 void widenFp16F16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  widenLoop<Half16::kFloat16>(in + i, out + i, n - i);
}

PYCOMM_TARGET_AVX2 void narrowFp16F16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  narrowLoop<Half16::kFloat16>(in + i, out + i, n - i);
}


PYCOMM_TARGET_AVX2 void reduceAvx2(void* d, const void* a, const void* b, size_t n, DataType t,
                                   ReduceOp op) {
  reduceBody<CpuIsa::kAvx2>(d, a, b, n, t, op);
}
PYCOMM_TARGET_AVX2 void divideAvx2(void* buf, size_t n, DataType t, int divisor) {
  divideBody<CpuIsa::kAvx2>(buf, n, t, divisor);
}
PYCOMM_TARGET_AVX2 void reduceManyAvx2(void* d, const void* const* s, int n, size_t c, DataType t,
                                       ReduceOp op) {
  reduceManyBody<CpuIsa::kAvx2>(d, s, n, c, t, op);
}

}  // namespace reduce_isa
}  // namespace pycomm
#endif
