// Element-wise reductions on raw buffers (no torch, no transport).
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/reduce_op.h"

namespace pycomm {

// dst[i] = op(dst[i], src[i]) for i < count. AVG reduces as SUM (the caller
// divides once at the end). For bool, SUM acts as OR and PRODUCT as AND.
void reduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);

// buf[i] /= divisor, for floating dtypes (used to finish ReduceOp::kAvg).
void divideBy(void* buf, size_t count, DataType dtype, int divisor);

}  // namespace pycomm
