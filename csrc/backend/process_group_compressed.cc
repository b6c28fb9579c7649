// ProcessGroupPycomm's compressed collectives (algorithms/allreduce_quantized.cc,
// allreduce_sparse.cc), used by pycomm.hooks on pycomm groups. Validation on the
// caller's thread (usage errors raise ValueError / TypeError naming the op), then the
// same ordered worker queue and Work/Future as every other collective.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/process_group.h"
#include "backend/tensor_checks.h"

namespace pycomm {
namespace {

void checkResidual(const char* op, const at::Tensor& residual, const at::Tensor& like) {
  if (!residual.defined()) return;
  checkNamed(op, "residual", residual, at::kFloat);
  if (residual.numel() != like.numel())
    usageError(where(op) + "residual has " + std::to_string(residual.numel()) +
               " elements, expected " + std::to_string(like.numel()));
  if (residual.is_same(like) || residual.data_ptr() == like.data_ptr())
    usageError(where(op) + "residual must not share memory with the data");
}

// A compressed all-reduce's call: float32, `count` elements, and its codec setting,
// compared across ranks in the root's place.
CallDescriptor compressedCall(const char* op, Collective collective, int64_t count, int32_t setting) {
  CallDescriptor call = describeCall(op, collective, c10d::kUnsetTimeout);
  call.dtype = static_cast<int32_t>(DataType::kFloat32);
  call.count = count;
  call.root = setting;
  return call;
}

float* dataOrNull(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

std::vector<size_t> checkSegments(const char* op, const std::vector<int64_t>& segments, int64_t count) {
  std::vector<size_t> lengths;
  int64_t total = 0;
  for (int64_t s : segments) {
    if (s < 0) usageError(where(op) + "segment lengths must be >= 0");
    total += s;
    lengths.push_back(static_cast<size_t>(s));
  }
  if (!segments.empty() && total != count)
    usageError(where(op) + "segments sum to " + std::to_string(total) +
               " elements but the tensor has " + std::to_string(count));
  return lengths;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduceQuantizedTensor(
    at::Tensor tensor, at::Tensor residual, std::vector<int64_t> segments, std::vector<int64_t> keys,
    int bits, int64_t block, bool stochastic, int64_t seed, bool asyncOp) {
  const char* op = "allreduce_quantized";
  checkNamed(op, "tensor", tensor, at::kFloat);
  checkResidual(op, residual, tensor);
  std::vector<size_t> lengths = checkSegments(op, segments, tensor.numel());
  if (!keys.empty() && keys.size() != std::max<size_t>(segments.size(), 1))
    usageError(where(op) + std::to_string(keys.size()) + " keys for " +
               std::to_string(segments.size()) + " segments");
  std::vector<uint64_t> segmentKeys(keys.begin(), keys.end());
  QuantizeOptions opts;
  opts.bits = bits;
  opts.block = checkBlock(op, block);
  checkSeed(op, seed);
  opts.stochastic = stochastic;
  opts.seed = static_cast<uint64_t>(seed);
  try {
    checkQuantizeOptions(op, opts.bits, opts.block);
  } catch (const Error& e) {
    usageError(e.what());
  }
  return enqueue(compressedCall(op, Collective::kAllreduceQuantized, tensor.numel(), bits * 1000 + (stochastic ? 1 : 0)),
                 c10d::OpType::ALLREDUCE, {tensor},
                 [tensor, residual, lengths, segmentKeys, opts](Comm& c) {
                   c.setAlgorithm(strCat(opts.bits, "-bit"));
                   allreduceQuantized(c, tensor.data_ptr<float>(), static_cast<size_t>(tensor.numel()),
                                      lengths, segmentKeys, opts, dataOrNull(residual));
                 },
                 Launch{asyncOp, {}});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduceSparseTensor(
    at::Tensor indices, at::Tensor values, at::Tensor out, at::Tensor residual,
    std::vector<int64_t> segments, const std::string& valueType, double keepDensity, double divisor,
    bool asyncOp) {
  const char* op = "allreduce_sparse";
  checkNamed(op, "values", values, at::kFloat);
  checkNamed(op, "out", out, at::kFloat);
  checkResidual(op, residual, out);
  if (!indices.defined() || !indices.device().is_cpu() || indices.scalar_type() != at::kLong ||
      !indices.is_contiguous())
    usageError(where(op) + "indices must be a contiguous CPU int64 tensor");
  if (indices.numel() != values.numel())
    usageError(where(op) + "indices and values differ in length (" + std::to_string(indices.numel()) +
                    " and " + std::to_string(values.numel()) + ")");
  if (out.data_ptr() == values.data_ptr() && out.numel() > 0)
    usageError(where(op) + "out must not share memory with values");
  SparseAllreduceOptions opts;
  if (valueType == "float32") opts.valueType = DataType::kFloat32;
  else if (valueType == "float16") opts.valueType = DataType::kFloat16;
  else if (valueType == "bfloat16") opts.valueType = DataType::kBFloat16;
  else usageError(where(op) + "value_dtype must be float32, float16 or bfloat16 (got " + valueType + ")");
  if (!(keepDensity >= 0.0 && keepDensity <= 1.0))
    usageError(where(op) + "keep_density must be in [0, 1] (got " + std::to_string(keepDensity) + ")");
  opts.keepDensity = keepDensity;
  if (!(divisor > 0.0 && divisor <= 3.0e38))
    usageError(where(op) + "divisor must be positive and finite (got " + std::to_string(divisor) + ")");
  opts.divisor = static_cast<float>(divisor);
  std::vector<size_t> lengths = checkSegments(op, segments, out.numel());
  try {
    checkSparseInput(op, indices.data_ptr<int64_t>(), static_cast<size_t>(indices.numel()),
                     static_cast<size_t>(out.numel()));
  } catch (const Error& e) {
    usageError(e.what());
  }
  return enqueue(compressedCall(op, Collective::kAllreduceSparse, out.numel(), static_cast<int32_t>(opts.valueType)),
                 c10d::OpType::ALLREDUCE, {out},
                 [indices, values, out, residual, lengths, opts](Comm& c) {
                   c.setAlgorithm("sparse");
                   allreduceSparse(c, indices.data_ptr<int64_t>(), values.data_ptr<float>(),
                                   static_cast<size_t>(indices.numel()),
                                   static_cast<size_t>(out.numel()), lengths, out.data_ptr<float>(),
                                   dataOrNull(residual), opts);
                 },
                 Launch{asyncOp, {}});
}

}  // namespace pycomm
