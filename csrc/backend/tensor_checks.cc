#include "backend/tensor_checks.h"

#include <c10/util/Exception.h>

#include "common/call.h"
#include "common/error.h"

namespace pycomm {

void usageError(const std::string& message) { C10_THROW_ERROR(ValueError, message); }

void typeError(const std::string& message) { C10_THROW_ERROR(TypeError, message); }

std::string where(const char* op) { return errorPrefix(op) + ": "; }

DataType toDataType(const char* op, at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kBool;
    default:
      typeError(where(op) + "unsupported dtype " + c10::toString(type) +
                " (supported: float32, float64, float16, bfloat16, int8, int16, int32, int64, uint8, bool)");
  }
}

void checkStrided(const char* op, const at::Tensor& t) {
  if (t.layout() != at::kStrided)
    usageError(where(op) + "sparse tensors are not supported (call .to_dense() first)");
}

void checkContiguous(const char* op, const at::Tensor& t) {
  if (!t.is_contiguous()) usageError(where(op) + "tensors must be contiguous (call .contiguous() first)");
}

namespace {

// Defined, strided, on the CPU, contiguous: what every tensor argument must be.
void checkPlacement(const char* op, const at::Tensor& t) {
  if (!t.defined()) usageError(where(op) + "got an undefined tensor");
  checkStrided(op, t);
  if (!t.device().is_cpu())
    usageError(where(op) + "expected CPU tensors, got a tensor on " + t.device().str() +
               " (pycomm is registered for cpu)");
  checkContiguous(op, t);
}

}  // namespace

DataType checkTensor(const char* op, const at::Tensor& t) {
  checkPlacement(op, t);
  return toDataType(op, t.scalar_type());
}

const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors) {
  if (tensors.size() != 1)
    usageError(where(op) + "expected exactly one tensor, got " + std::to_string(tensors.size()));
  checkTensor(op, tensors[0]);
  return tensors[0];
}

const at::Tensor& singleOfAnyDtype(const char* op, const std::vector<at::Tensor>& tensors) {
  if (tensors.size() != 1)
    usageError(where(op) + "expected exactly one tensor, got " + std::to_string(tensors.size()));
  checkPlacement(op, tensors[0]);
  return tensors[0];
}

at::Tensor complexAsPairs(const char* op, const at::Tensor& t, const c10d::ReduceOp& reduceOp) {
  if (!t.defined() || !t.is_complex()) return t;
  const auto kind = reduceOp.op_;
  if (kind != c10d::ReduceOp::SUM && kind != c10d::ReduceOp::AVG && kind != c10d::ReduceOp::PREMUL_SUM)
    usageError(where(op) + "complex tensors are reduced with SUM, AVG or PREMUL_SUM only");
  if (t.is_conj()) usageError(where(op) + "a conjugated view cannot be written in place (call .resolve_conj() first)");
  return at::view_as_real(t);
}

std::vector<at::Tensor> complexAsPairs(const char* op, const std::vector<at::Tensor>& tensors,
                                       const c10d::ReduceOp& reduceOp) {
  std::vector<at::Tensor> result;
  result.reserve(tensors.size());
  for (const auto& t : tensors) result.push_back(complexAsPairs(op, t, reduceOp));
  return result;
}

void checkLike(const char* op, const at::Tensor& t, const at::Tensor& like, int64_t numel,
               const std::string& what) {
  checkTensor(op, t);
  if (t.scalar_type() != like.scalar_type())
    usageError(where(op) + what + " has dtype " + c10::toString(t.scalar_type()) + ", expected " +
               c10::toString(like.scalar_type()));
  if (t.numel() != numel)
    usageError(where(op) + what + " has " + std::to_string(t.numel()) + " elements, expected " +
               std::to_string(numel));
}

std::vector<at::Tensor> checkRootList(const char* op, const std::vector<std::vector<at::Tensor>>& lists,
                                      const at::Tensor& like, bool isRoot, int size,
                                      const std::string& what) {
  if (!isRoot) {
    if (!lists.empty() && !lists[0].empty())
      usageError(where(op) + "only the root rank may pass " + what + " tensors");
    return {};
  }
  if (lists.size() != 1 || static_cast<int>(lists[0].size()) != size)
    usageError(where(op) + "the root needs one " + what + " list of " + std::to_string(size) + " tensors");
  for (size_t i = 0; i < lists[0].size(); ++i)
    checkLike(op, lists[0][i], like, like.numel(), what + " tensor " + std::to_string(i));
  return lists[0];
}

void checkNamed(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  if (!t.defined()) usageError(where(op) + name + " is undefined");
  if (!t.device().is_cpu())
    usageError(where(op) + name + " must be a CPU tensor (got " + t.device().str() + ")");
  if (t.scalar_type() != dtype)
    typeError(where(op) + name + " must be " + dataTypeName(toDataType(op, dtype)) + " (got " +
              c10::toString(t.scalar_type()) + ")");
  if (!t.is_contiguous()) usageError(where(op) + name + " must be contiguous");
}

ReduceOp toReduceOp(const char* op, const c10d::ReduceOp& reduceOp, DataType dtype) {
  ReduceOp result;
  switch (reduceOp.op_) {
    case c10d::ReduceOp::SUM: result = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG: result = ReduceOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: result = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: result = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: result = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: result = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: result = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: result = ReduceOp::kBxor; break;
    case c10d::ReduceOp::PREMUL_SUM:
      if (dtype != DataType::kFloat32 && dtype != DataType::kFloat64 && dtype != DataType::kFloat16 &&
          dtype != DataType::kBFloat16)
        usageError(where(op) + "PREMUL_SUM needs a floating-point tensor (got " + dataTypeName(dtype) + ")");
      result = ReduceOp::kSum;
      break;
    default: usageError(where(op) + "unsupported reduce op");
  }
  try {
    checkReduceSupported(op, result, dtype);
  } catch (const Error& e) {
    usageError(e.what());
  }
  return result;
}

std::optional<double> premulFactor(const c10d::ReduceOp& reduceOp) {
  if (reduceOp.op_ != c10d::ReduceOp::PREMUL_SUM) return std::nullopt;
  // NCCLPreMulSumSupplement: the name torch 2.11 has, an alias of PreMulSumSupplement in 2.13.
  const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(reduceOp.supplement_.get());
  if (supplement == nullptr) usageError("pycomm: PREMUL_SUM without its factor");
  if (supplement->tensor_factor.defined()) return supplement->tensor_factor.item<double>();
  return supplement->double_factor;
}

void checkRank(const char* op, int rank, int size, const char* what) {
  if (rank < 0 || rank >= size)
    usageError(where(op) + what + " " + std::to_string(rank) + " is outside the group (size " +
               std::to_string(size) + ")");
}

void checkSeed(const char* op, int64_t seed) {
  if (seed < 0) usageError(where(op) + "seed must be >= 0");
}

size_t checkBlock(const char* op, int64_t block) {
  if (block < 1) usageError(where(op) + "block must be >= 1 (got " + std::to_string(block) + ")");
  return static_cast<size_t>(block);
}

}  // namespace pycomm
