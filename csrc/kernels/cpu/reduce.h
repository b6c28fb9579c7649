// Element-wise reductions on raw buffers (no torch, no transport).
//
// Vectorized per instruction set (kernels/cpu/cpu_isa.h): a portable copy, an
// AVX2 + F16C copy and an AVX-512 copy, the widest the CPU supports picked at run
// time. Every copy gives the same bits (NaN payloads aside): float16 / bfloat16 are widened
// to float32, combined, and rounded back once (round to nearest even); integer
// SUM / PRODUCT wrap like torch's; MIN / MAX propagate NaN like torch.minimum /
// torch.maximum (a NaN in the first operand wins) and keep the first operand on a
// tie (-0.0 vs +0.0).
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/reduce_op.h"
#include "kernels/cpu/cpu_isa.h"

namespace pycomm {

// dst[i] = op(dst[i], src[i]) for i < count. AVG reduces as SUM (the caller
// divides once at the end). For bool, SUM acts as OR and PRODUCT as AND.
void reduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);

// dst[i] = op(a[i], b[i]) for i < count: the same reduction without first
// copying a into dst (e.g. reducing a received segment and the local one straight
// into an output or shared buffer). dst may be a or b itself; it must not
// partially overlap either.
void reduceInto(void* dst, const void* a, const void* b, size_t count, DataType dtype,
                ReduceOp op);

// dst[i] = op(...op(op(srcs[0][i], srcs[1][i]), srcs[2][i])..., srcs[n-1][i]) for
// i < count: the n sources combined in their order, float16 / bfloat16 in float32
// and rounded back once (the one-shot all-reduce: every rank reduces all ranks'
// copies in rank order, so every rank gets the same bits). dst may be one of the
// sources (not a partial overlap of one). n >= 1. Allocates nothing.
void reduceMany(void* dst, const void* const* srcs, int n, size_t count, DataType dtype,
                ReduceOp op);

// buf[i] /= divisor, for floating dtypes (used to finish ReduceOp::kAvg).
void divideBy(void* buf, size_t count, DataType dtype, int divisor);

// Whether the n bytes at p are all zero; returns at the first block holding a
// nonzero byte, so a buffer in use costs a few words and only an all-zero one a
// full read. The hooks ask it of each parameter's slice of a DDP bucket: DDP
// zero-fills the slice of a parameter this rank did not use (-0.0 is not zero
// here, which only makes the caller treat the slice as used).
bool allZeroBytes(const void* p, size_t n);

// The instruction set the functions above use: bestCpuIsa() unless forced.
CpuIsa reduceIsa();

// Forces the instruction set (tests and benchmarks compare them); process-wide.
// A usage error when the CPU does not support it.
void setReduceIsa(CpuIsa isa);

}  // namespace pycomm
