// Reduction operators and which element types each one accepts.
#pragma once

#include "common/dtype.h"
#include "common/error.h"

namespace pycomm {

enum class ReduceOp : uint8_t {
  kSum,
  kAvg,  // computed as kSum followed by a division by the group size
  kProduct,
  kMin,
  kMax,
  kBand,
  kBor,
  kBxor,
};

inline const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
  }
  return "unknown";
}

// Throws a usage error naming `opName` when `op` cannot reduce `dtype`:
// AVG needs a floating type; bitwise ops need integers or bool.
inline void checkReduceSupported(const char* opName, ReduceOp op, DataType dtype) {
  if (op == ReduceOp::kAvg) {
    PYCOMM_CHECK_USAGE(isFloating(dtype), "pycomm ", opName, ": ReduceOp.AVG is not supported for ",
                       dataTypeName(dtype), " (use a floating dtype, or SUM and divide)");
  }
  if (op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) {
    PYCOMM_CHECK_USAGE(!isFloating(dtype), "pycomm ", opName, ": ReduceOp.", reduceOpName(op),
                       " is not supported for ", dataTypeName(dtype),
                       " (bitwise ops need an integer or bool dtype)");
  }
}

}  // namespace pycomm
