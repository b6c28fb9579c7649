// Usage checks on torch arguments, shared by every entry point of the backend
// layer: the process group's collectives, its compressed collectives, the kernel
// bindings (CPU and CUDA) and the device seam's probe (device_seam.h). They raise
// at the call, naming the op ("pycomm <op>: ..."): torch's ValueError, or
// TypeError for a dtype pycomm does not carry.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/reduce_op.h"

namespace pycomm {

[[noreturn]] void usageError(const std::string& message);  // ValueError
[[noreturn]] void typeError(const std::string& message);   // TypeError
// "pycomm <op>: ", the prefix of every usage error.
std::string where(const char* op);

// torch dtype -> DataType; a TypeError naming `op` for dtypes pycomm does not carry.
DataType toDataType(const char* op, at::ScalarType type);
// Not sparse ("sparse tensors are not supported"); contiguous. Parts of checkTensor,
// which the device seam applies to tensors off the CPU.
void checkStrided(const char* op, const at::Tensor& t);
void checkContiguous(const char* op, const at::Tensor& t);
// A defined, strided, contiguous CPU tensor of a carried dtype (a collective's argument).
DataType checkTensor(const char* op, const at::Tensor& t);
// The one tensor of a single-tensor collective, checked.
const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors);
// The one tensor of a send or receive: checked as single() but of any dtype, since only
// its bytes travel (as with gloo: uint16/32/64, float8 and the like included).
const at::Tensor& singleOfAnyDtype(const char* op, const std::vector<at::Tensor>& tensors);
// torch hands complex tensors to a backend as (re, im) pairs of reals for all_reduce,
// broadcast, all_gather, send and the like, but not for reduce and reduce_scatter, which
// gloo sums. For SUM, AVG and PREMUL_SUM, which act on re and im alike, these return a
// complex tensor's pairs view (at::view_as_real: the same memory, a last dimension of 2);
// another op on a complex tensor is a usage error, as in torch's all_reduce. Other
// tensors come back as they are.
at::Tensor complexAsPairs(const char* op, const at::Tensor& t, const c10d::ReduceOp& reduceOp);
std::vector<at::Tensor> complexAsPairs(const char* op, const std::vector<at::Tensor>& tensors,
                                       const c10d::ReduceOp& reduceOp);
// Checked, with `like`'s dtype and `numel` elements; `what` names it in the error.
void checkLike(const char* op, const at::Tensor& t, const at::Tensor& like, int64_t numel,
               const std::string& what);
// The root's one list of `size` tensors, each checked like `like` (gather's outputs,
// scatter's inputs; `what`: "output" or "input"); on another rank, which may pass
// none, an empty list.
std::vector<at::Tensor> checkRootList(const char* op, const std::vector<std::vector<at::Tensor>>& lists,
                                      const at::Tensor& like, bool isRoot, int size,
                                      const std::string& what);
// A contiguous CPU tensor of `dtype` called `name` (kernel and compressed-collective
// arguments; a wrong dtype is a TypeError).
void checkNamed(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype);
// c10d reduce op -> ReduceOp, checked against the dtype (AVG floating only, ...).
ReduceOp toReduceOp(const char* op, const c10d::ReduceOp& reduceOp, DataType dtype);
// PREMUL_SUM(f) (FSDP2 with a gradient divide factor) is a SUM of the inputs
// multiplied by f first: toReduceOp() gives kSum for it, and this gives f
// (nullopt for every other op). The factor is applied on the worker, in order.
std::optional<double> premulFactor(const c10d::ReduceOp& reduceOp);
// `rank` (a root, source or destination; `what` says which) lies in [0, size).
void checkRank(const char* op, int rank, int size, const char* what);
// A rounding seed >= 0; a quantization block >= 1 (returned as a size).
void checkSeed(const char* op, int64_t seed);
size_t checkBlock(const char* op, int64_t block);

}  // namespace pycomm
