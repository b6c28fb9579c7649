// Checked CUDA calls for the kernels in csrc/kernels/cuda/: a failure throws
// pycomm::Error (never exit/abort), naming the op and the CUDA error.
#pragma once

#include <cuda_runtime.h>

#include "common/error.h"

#define PYCOMM_CUDA_CHECK(op, call)                                                      \
  do {                                                                                   \
    const cudaError_t pycommErr_ = (call);                                               \
    if (pycommErr_ != cudaSuccess)                                                       \
      ::pycomm::throwError(::pycomm::ErrorKind::kInternal, "pycomm ", op, ": ", #call,   \
                           " failed: ", cudaGetErrorString(pycommErr_));                 \
  } while (0)

// After every <<<...>>> launch.
#define PYCOMM_CUDA_LAUNCH_CHECK(op) PYCOMM_CUDA_CHECK(op, cudaGetLastError())
