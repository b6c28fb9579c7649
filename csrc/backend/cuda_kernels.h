// pycomm._C.kernels on CUDA tensors (cuda_kernel_bindings.cc, compiled only into
// the CUDA build, PYCOMM_WITH_CUDA). kernel_bindings.cc validates the arguments
// that do not depend on the device, then hands CUDA tensors to these functions,
// which check the tensors and run the kernels of csrc/kernels/cuda/ on the
// tensor's device and its current stream (like torch ops: asynchronous, except
// where a result size must be known on the host: approximate top-k reads its
// count back).
#pragma once

#ifdef PYCOMM_WITH_CUDA

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/dtype.h"
#include "common/reduce_op.h"
#include "kernels/cpu/quantize.h"

namespace pycomm {
namespace cudabind {

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x, size_t k, bool exact, uint64_t seed);
// top-k of g + e; e <- g + e with the selected entries zeroed.
std::tuple<at::Tensor, at::Tensor> topkEf(const at::Tensor& g, at::Tensor& e, size_t k, bool exact,
                                          uint64_t seed);
at::Tensor quantize(const at::Tensor& x, const QuantizeOptions& opts,
                    const std::optional<at::Tensor>& out);
at::Tensor quantizeEf(const at::Tensor& g, at::Tensor& e, const QuantizeOptions& opts,
                      const std::optional<at::Tensor>& out);
at::Tensor dequantize(const at::Tensor& packed, size_t count, int bits, size_t block,
                      const std::optional<at::Tensor>& out);
// out = op(a, b) element-wise (out may be a or b).
void reduce(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, DataType dtype,
            ReduceOp op);
void divide(const at::Tensor& t, DataType dtype, int divisor);

}  // namespace cudabind
}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
