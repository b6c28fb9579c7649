// Element-wise reductions. The loops are written once, as plain C++ the compiler
// auto-vectorizes (functors for the element ops, __restrict operands, selects
// instead of branches), and compiled three times: the portable baseline, an
// AVX2 + F16C copy and an AVX-512 copy (target attributes, never -march=native);
// reduceInto() calls the copy for reduceIsa(). float16 / bfloat16 go through
// float32 in L1-sized blocks; their conversions are branch-free (F16C / AVX-512
// instructions for float16 where the CPU has them) and round to nearest even
// exactly like kernels/cpu/half.h.
//
// This file holds the portable copy and the dispatch; reduce_avx2.cc and reduce_avx512.cc
// the other two; the loops themselves are in reduce_body.h.
#include "kernels/cpu/reduce.h"

#include "kernels/cpu/reduce_body.h"

namespace pycomm {
namespace {

void reduceGeneric(void* d, const void* a, const void* b, size_t n, DataType t, ReduceOp op) {
  reduceBody<CpuIsa::kGeneric>(d, a, b, n, t, op);
}
void divideGeneric(void* buf, size_t n, DataType t, int divisor) {
  divideBody<CpuIsa::kGeneric>(buf, n, t, divisor);
}
void reduceManyGeneric(void* d, const void* const* s, int n, size_t c, DataType t, ReduceOp op) {
  reduceManyBody<CpuIsa::kGeneric>(d, s, n, c, t, op);
}

std::atomic<CpuIsa>& activeIsa() {
  static std::atomic<CpuIsa> isa{bestCpuIsa()};
  return isa;
}

}  // namespace

CpuIsa reduceIsa() { return activeIsa().load(std::memory_order_relaxed); }

void setReduceIsa(CpuIsa isa) {
  PYCOMM_CHECK_USAGE(cpuSupports(isa), "pycomm set_cpu_isa: this CPU (or build) cannot run ",
                     cpuIsaName(isa), "; best here is ", cpuIsaName(bestCpuIsa()));
  activeIsa().store(isa, std::memory_order_relaxed);
}

void reduceInto(void* dst, const void* a, const void* b, size_t count, DataType dtype,
                ReduceOp op) {
  if (count == 0) return;
  switch (reduceIsa()) {
#ifdef PYCOMM_X86_DISPATCH
    case CpuIsa::kAvx512: return reduce_isa::reduceAvx512(dst, a, b, count, dtype, op);
    case CpuIsa::kAvx2: return reduce_isa::reduceAvx2(dst, a, b, count, dtype, op);
#endif
    default: return reduceGeneric(dst, a, b, count, dtype, op);
  }
}

void reduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op) {
  reduceInto(dst, dst, src, count, dtype, op);
}

void reduceMany(void* dst, const void* const* srcs, int n, size_t count, DataType dtype,
                ReduceOp op) {
  PYCOMM_CHECK_INTERNAL(n >= 1, "reduceMany of ", n, " sources");
  if (count == 0) return;
  switch (reduceIsa()) {
#ifdef PYCOMM_X86_DISPATCH
    case CpuIsa::kAvx512: return reduce_isa::reduceManyAvx512(dst, srcs, n, count, dtype, op);
    case CpuIsa::kAvx2: return reduce_isa::reduceManyAvx2(dst, srcs, n, count, dtype, op);
#endif
    default: return reduceManyGeneric(dst, srcs, n, count, dtype, op);
  }
}

void divideBy(void* buf, size_t count, DataType dtype, int divisor) {
  if (count == 0 && isFloating(dtype)) return;
  switch (reduceIsa()) {
#ifdef PYCOMM_X86_DISPATCH
    case CpuIsa::kAvx512: return reduce_isa::divideAvx512(buf, count, dtype, divisor);
    case CpuIsa::kAvx2: return reduce_isa::divideAvx2(buf, count, dtype, divisor);
#endif
    default: return divideGeneric(buf, count, dtype, divisor);
  }
}

bool allZeroBytes(const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  constexpr size_t kBlock = 256;  // OR a block of words (vectorised), test once per block
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint64_t any = 0;
    for (size_t j = 0; j < kBlock; j += sizeof(uint64_t)) {
      uint64_t word;
      std::memcpy(&word, b + i + j, sizeof word);
      any |= word;
    }
    if (any != 0) return false;
  }
  for (; i < n; ++i)
    if (b[i] != 0) return false;
  return true;
}

}  // namespace pycomm
