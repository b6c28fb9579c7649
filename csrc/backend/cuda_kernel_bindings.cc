// CUDA tensors -> csrc/kernels/cuda/ (see cuda_kernels.h). Compiled only into the
// CUDA build; tests/kernels/test_cuda.py validates it where a GPU is lent. What has run
// where: docs/architecture.md, "CUDA".
#include "backend/cuda_kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <string>

#include "backend/tensor_checks.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/quantize.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/topk.cuh"

namespace pycomm {
namespace cudabind {
namespace {

// The names the CPU bindings use in their messages (float32, not Float).
std::string dtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kByte: return "uint8";
    default: return c10::toString(dtype);
  }
}

// A contiguous CUDA tensor of `dtype` on `device` (the first tensor's device when null).
void checkCuda(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
               const at::Device* device = nullptr) {
  if (!t.is_cuda()) usageError(where(op) + name + " must be a CUDA tensor (got " + t.device().str() + ")");
  if (device != nullptr && t.device() != *device)
    usageError(where(op) + name + " is on " + t.device().str() + ", expected " + device->str());
  if (t.scalar_type() != dtype)
    typeError(where(op) + name + " must be " + dtypeName(dtype) + " (got " + dtypeName(t.scalar_type()) +
              ")");
  if (!t.is_contiguous()) usageError(where(op) + name + " must be contiguous");
}

cudaStream_t currentStream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

at::Tensor outputOf(const char* op, const std::optional<at::Tensor>& out, int64_t numel,
                    at::ScalarType dtype, const at::Device& device) {
  if (!out) return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  const at::Tensor& t = *out;
  if (t.device() != device || t.scalar_type() != dtype || !t.is_contiguous() || t.numel() != numel)
    usageError(where(op) + "out must be a contiguous " + dtypeName(dtype) +
          " tensor of " + std::to_string(numel) + " elements on " + device.str());
  return t;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x, size_t k, bool exact, uint64_t seed) {
  checkCuda("topk", "x", x, at::kFloat);
  const c10::cuda::CUDAGuard guard(x.device());
  const size_t n = static_cast<size_t>(x.numel());
  const size_t cap = exact ? k : topkBandHigh(k);
  auto options = x.options();
  at::Tensor indices = at::empty({static_cast<int64_t>(cap)}, options.dtype(at::kLong));
  at::Tensor values = at::empty({static_cast<int64_t>(cap)}, options);
  if (k == 0) return {indices, values};
  at::Tensor count = at::empty({1}, options.dtype(at::kLong));
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(cuda::topkWorkspaceBytes(n, k))}, options.dtype(at::kByte));
  const cudaStream_t stream = currentStream(x);
  if (exact) {
    cuda::topkExact(x.data_ptr<float>(), n, k, indices.data_ptr<int64_t>(), values.data_ptr<float>(),
                    count.data_ptr<int64_t>(), workspace.data_ptr(), stream);
    return {indices, values};
  }
  cuda::topkApprox(x.data_ptr<float>(), n, k, seed, indices.data_ptr<int64_t>(),
                   values.data_ptr<float>(), count.data_ptr<int64_t>(), workspace.data_ptr(), stream);
  const int64_t used = count.item<int64_t>();  // the one host read: the result's size
  return {indices.narrow(0, 0, used), values.narrow(0, 0, used)};
}

std::tuple<at::Tensor, at::Tensor> topkEf(const at::Tensor& g, at::Tensor& e, size_t k, bool exact,
                                          uint64_t seed) {
  checkCuda("topk_ef", "g", g, at::kFloat);
  const at::Device device = g.device();
  checkCuda("topk_ef", "e", e, at::kFloat, &device);
  const c10::cuda::CUDAGuard guard(device);
  // e <- g + e in place, select from it, zero what was selected (three passes;
  // a fused kernel is future work).
  e.add_(g);
  auto [indices, values] = topk(e, k, exact, seed);
  e.index_fill_(0, indices, 0.0);
  return {indices, values};
}

at::Tensor quantize(const at::Tensor& x, const QuantizeOptions& opts,
                    const std::optional<at::Tensor>& outArg) {
  checkCuda("quantize", "x", x, at::kFloat);
  const c10::cuda::CUDAGuard guard(x.device());
  const size_t n = static_cast<size_t>(x.numel());
  at::Tensor out = outputOf("quantize", outArg,
                            static_cast<int64_t>(packedSize(n, opts.bits, opts.block)), at::kByte,
                            x.device());
  cuda::quantize(x.data_ptr<float>(), n, opts, out.data_ptr<uint8_t>(), currentStream(x));
  return out;
}

at::Tensor quantizeEf(const at::Tensor& g, at::Tensor& e, const QuantizeOptions& opts,
                      const std::optional<at::Tensor>& outArg) {
  checkCuda("quantize_ef", "g", g, at::kFloat);
  const at::Device device = g.device();
  checkCuda("quantize_ef", "e", e, at::kFloat, &device);
  const c10::cuda::CUDAGuard guard(device);
  const size_t n = static_cast<size_t>(g.numel());
  at::Tensor out = outputOf("quantize_ef", outArg,
                            static_cast<int64_t>(packedSize(n, opts.bits, opts.block)), at::kByte,
                            device);
  cuda::quantizeErrorFeedback(g.data_ptr<float>(), e.data_ptr<float>(), n, opts,
                              out.data_ptr<uint8_t>(), currentStream(g));
  return out;
}

at::Tensor dequantize(const at::Tensor& packed, size_t count, int bits, size_t block,
                      const std::optional<at::Tensor>& outArg) {
  checkCuda("dequantize", "packed", packed, at::kByte);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor out =
      outputOf("dequantize", outArg, static_cast<int64_t>(count), at::kFloat, packed.device());
  cuda::dequantize(packed.data_ptr<uint8_t>(), count, bits, block, out.data_ptr<float>(),
                   currentStream(packed));
  return out;
}

void reduce(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, DataType dtype,
            ReduceOp op) {
  checkCuda("reduce", "a", a, a.scalar_type());
  const at::Device device = a.device();
  checkCuda("reduce", "b", b, a.scalar_type(), &device);
  checkCuda("reduce", "out", out, a.scalar_type(), &device);
  const c10::cuda::CUDAGuard guard(device);
  cuda::reduce(out.data_ptr(), a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.numel()), dtype,
               op, currentStream(a));
}

void divide(const at::Tensor& t, DataType dtype, int divisor) {
  checkCuda("divide", "t", t, t.scalar_type());
  const c10::cuda::CUDAGuard guard(t.device());
  cuda::divideBy(t.data_ptr(), static_cast<size_t>(t.numel()), dtype, divisor, currentStream(t));
}

}  // namespace cudabind
}  // namespace pycomm
