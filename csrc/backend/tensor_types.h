// torch dtypes -> pycomm::DataType (the backend's one conversion).
#pragma once

#include <c10/core/ScalarType.h>

#include "common/dtype.h"

namespace pycomm {

// Throws a TypeError naming `op` for dtypes pycomm does not carry.
DataType toDataType(const char* op, at::ScalarType type);

}  // namespace pycomm
