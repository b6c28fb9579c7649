// Element-wise reductions on the GPU: the CUDA twin of kernels/cpu/reduce.h, with
// the same semantics (integer SUM/PRODUCT wrap, MIN/MAX propagate NaN, float16 and
// bfloat16 widen to float32 and round back once per element, bool SUM is OR and
// PRODUCT is AND, AVG reduces as SUM and the caller divides once).
//
// All pointers are device pointers; calls are asynchronous on `stream` and return
// at once. Unsupported (op, dtype) pairs throw a usage error; CUDA failures throw
// pycomm::Error. 16-byte vector loads and stores are used when every pointer is
// 16-byte aligned (the element tail is done by scalar threads), scalar ones otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/dtype.h"
#include "common/reduce_op.h"

namespace pycomm {
namespace cuda {

// dst[i] = op(dst[i], src[i]) for i < count.
void reduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op,
                cudaStream_t stream);

// out[i] = op(a[i], b[i]) for i < count; out may be a or b (not a partial overlap).
// One pass that reads 2 and writes 1 buffer: what a pipelined all-reduce needs to
// reduce a received segment into a fresh output.
void reduce(void* out, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op,
            cudaStream_t stream);

// buf[i] /= divisor for floating dtypes (finishes ReduceOp::kAvg).
void divideBy(void* buf, size_t count, DataType dtype, int divisor, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
