// dist.all_reduce of sparse COO tensors (torch.sparse_coo_tensor, the gradients of
// nn.Embedding / nn.EmbeddingBag with sparse=True): the torch side of
// algorithms/allreduce_coo.cc. On the caller's thread: the usage checks, and the
// sparse indices linearized into one row id per entry (row-major over the sparse
// sizes; the dense dimensions are the row). On the worker: the all-reduce, then
// the result put into the tensor in place (coalesced), as gloo does, so the Work's
// result and its Future's value (DDP reads it) are the tensor itself.
#include <ATen/ATen.h>
#include <ATen/native/SparseTensorUtils.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "backend/process_group.h"
#include "backend/tensor_checks.h"
#include "common/fnv.h"

namespace pycomm {

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduceCoo(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts,
                                                                const Launch& launch) {
  const char* name = "allreduce";
  const at::Tensor& t = tensors[0];
  if (!t.device().is_cpu())
    usageError(where(name) + "expected CPU tensors, got a sparse tensor on " + t.device().str());
  const DataType dtype = toDataType(name, t.scalar_type());
  const ReduceOp op = toReduceOp(name, opts.reduceOp, dtype);
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    usageError(where(name) + "sparse tensors support only ReduceOp.SUM and ReduceOp.AVG (got " +
               reduceOpName(op) + "; call .to_dense() first)");
  const int64_t sparseDim = t.sparse_dim();
  const auto sizes = t.sizes().vec();
  const std::optional<double> premul = premulFactor(opts.reduceOp);
  if (premul && !at::isFloatingType(t.scalar_type()))
    usageError(where(name) + "PREMUL_SUM needs a floating-point tensor (got " +
               std::string(c10::toString(t.scalar_type())) + ")");
  // Row ids over the sparse sizes, row-major; rows of the product of the dense sizes.
  uint64_t rowCount = 1;
  for (int64_t d = 0; d < sparseDim; ++d) {
    const uint64_t size = static_cast<uint64_t>(sizes[d]);
    if (size != 0 && rowCount > static_cast<uint64_t>(INT64_MAX) / size)
      usageError(where(name) + "the sparse dimensions of the tensor hold more than 2^63 - 1 entries");
    rowCount *= size;
  }
  // Every rank must pass the same shape, not only the same rows and row width: FNV-1a
  // over sparse_dim and the sizes, compared in the all-reduce's header round.
  uint64_t shape = fnv1a(&sparseDim, sizeof(sparseDim));
  shape = fnv1a(sizes.data(), sizes.size() * sizeof(int64_t), shape);
  if (shape == 0) shape = 1;  // 0 means "not given"
  int64_t rowElems = 1;
  for (size_t d = static_cast<size_t>(sparseDim); d < sizes.size(); ++d) rowElems *= sizes[d];

  const at::Tensor indices = t._indices().to(at::kLong).contiguous();  // [sparseDim, nnz]
  const at::Tensor values = t._values().contiguous();                  // [nnz, dense sizes...]
  const int64_t nnz = t._nnz();
  auto rows = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(nnz), 0);
  const int64_t* idx = indices.data_ptr<int64_t>();
  for (int64_t d = 0; d < sparseDim; ++d) {
    const int64_t size = sizes[d];
    const int64_t* line = idx + d * nnz;
    int64_t* row = rows->data();
    for (int64_t j = 0; j < nnz; ++j) {
      if (line[j] < 0 || line[j] >= size)
        usageError(where(name) + "sparse index " + std::to_string(line[j]) + " of dimension " +
                   std::to_string(d) + " at position " + std::to_string(j) + " is outside the size " +
                   std::to_string(size));
      row[j] = row[j] * size + line[j];
    }
  }

  at::Tensor tensor = t;
  CallDescriptor call = describeCall(name, Collective::kAllreduceCoo, opts.timeout);
  call.comparedAs = "allreduce (sparse)";  // never the same call as a dense all-reduce
  call.dtype = static_cast<int32_t>(dtype);
  call.count = t.numel();
  call.reduceOp = static_cast<int>(op);
  return enqueue(call, c10d::OpType::ALLREDUCE, tensors,
                 [tensor, values, rows, rowCount, rowElems, sizes, sparseDim, dtype, op, shape, premul](Comm& c) {
                   at::Tensor outRows, outValues;
                   const auto valueShape = at::IntArrayRef(sizes).slice(static_cast<size_t>(sparseDim));
                   auto allocate = [&](size_t unionRows) {
                     std::vector<int64_t> shape{static_cast<int64_t>(unionRows)};
                     shape.insert(shape.end(), valueShape.begin(), valueShape.end());
                     outRows = at::empty({static_cast<int64_t>(unionRows)}, at::kLong);
                     outValues = at::empty(shape, values.options());
                     return CooOutput{outRows.data_ptr<int64_t>(), outValues.data_ptr()};
                   };
                   pycomm::allreduceCoo(c, rows->data(), values.data_ptr(), rows->size(), rowCount,
                                        static_cast<size_t>(rowElems), dtype, op, allocate, shape);
                   // PREMUL_SUM (torch's _make_nccl_premul_sum): the factor times the sum,
                   // as the dense path scales each rank's tensor before summing.
                   if (premul) outValues.mul_(*premul);
                   // Row ids back to [sparseDim, nnz] indices.
                   const int64_t unionRows = outRows.numel();
                   at::Tensor outIndices = at::empty({sparseDim, unionRows}, at::kLong);
                   int64_t* dst = outIndices.data_ptr<int64_t>();
                   const int64_t* src = outRows.data_ptr<int64_t>();
                   if (sparseDim == 1) {
                     std::copy(src, src + unionRows, dst);
                   } else {
                     for (int64_t j = 0; j < unionRows; ++j) {
                       int64_t row = src[j];
                       for (int64_t d = sparseDim - 1; d >= 0; --d) {
                         dst[d * unionRows + j] = row % sizes[d];
                         row /= sizes[d];
                       }
                     }
                   }
                   at::sparse::get_sparse_impl(tensor)->set_indices_and_values_unsafe(outIndices, outValues);
                   at::sparse::get_sparse_impl(tensor)->set_coalesced(true);
                 },
                 launch);
}

}  // namespace pycomm
