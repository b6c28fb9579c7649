// ProcessGroupPycomm's tensor collectives: the c10d entry points from broadcast to
// all-to-all. Each declares its tensors by role once and runs its body through
// runOnDevice (device_seam.h): CPU tensors as they are, a device with a seam (CUDA in
// the CUDA build, PYCOMM_WITH_CUDA: cuda_staging.cc) on host copies. The body checks
// the tensors it is given (tensor_checks.h) and enqueues (work_queue.cc) with the
// Launch it is given; the worker runs the collective through algorithms/.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cstring>
#include <unordered_map>

#include "algorithms/alltoall_splits.h"
#include "backend/call_check.h"
#include "backend/process_group.h"
#include "backend/tensor_checks.h"

namespace pycomm {

namespace {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;

char* ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// The inputs of an all-to-all as it may read them while writing `outputs`: an input
// that shares memory with an output (all_to_all_single(t, t), or an output list made
// of the input tensors) is read from a copy taken now (in the body, when the call's
// turn has come), since its blocks are sent while other ranks' blocks land in the
// outputs. The rest are the caller's tensors.
std::vector<at::Tensor> readableWhileWriting(const std::vector<at::Tensor>& inputs,
                                             const std::vector<at::Tensor>& outputs) {
  std::unordered_multimap<const c10::StorageImpl*, const at::Tensor*> written;
  for (const auto& t : outputs)
    if (t.has_storage()) written.emplace(t.storage().unsafeGetStorageImpl(), &t);
  std::vector<at::Tensor> result = inputs;
  for (auto& t : result) {
    if (!t.has_storage()) continue;
    auto [first, last] = written.equal_range(t.storage().unsafeGetStorageImpl());
    for (auto it = first; it != last; ++it)
      if (at::get_overlap_status(t, *it->second) != at::MemOverlapStatus::No) {
        t = t.clone();
        break;
      }
  }
  return result;
}

// The call `op` makes (common/call.h), described from its tensor `like` (dtype, and
// count: -1 takes like's numel, -2 leaves counts uncompared, as all-to-all's splits
// differ), its reduce op and root.
CallDescriptor callOf(const char* op, Collective collective, std::chrono::milliseconds timeout,
                      const at::Tensor* like = nullptr, int64_t count = -1, int reduceOp = -1, int root = -1) {
  CallDescriptor call = describeCall(op, collective, timeout);
  if (like != nullptr) {
    call.dtype = static_cast<int32_t>(toDataType(op, like->scalar_type()));
    call.count = count == -2 ? -1 : count >= 0 ? count : like->numel();
  }
  call.reduceOp = reduceOp;
  call.root = root;
  return call;
}

int64_t totalNumel(const Tensors& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

}  // namespace
c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::broadcast(Tensors& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  return runOnDevice("broadcast", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::inout(tensors)),
                     [&](const Launch& launch, Tensors& tensors) {
    const at::Tensor& t = single("broadcast", tensors);
    checkRank("broadcast", static_cast<int>(opts.rootRank), getSize(), "root rank");
    const int root = static_cast<int>(opts.rootRank);
    const CallDescriptor call = callOf("broadcast", Collective::kBroadcast, opts.timeout, &t, -1, -1, root);
    return enqueue(call, OpType::BROADCAST, tensors,
                   [t, root](Comm& c) {
                     pycomm::broadcast(c, t.data_ptr(), t.nbytes(), root);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce(Tensors& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  return runOnDevice("allreduce", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::inout(tensors)),
                     [&](const Launch& launch, Tensors& tensors) {
    if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
      return allreduceCoo(tensors, opts, launch);  // process_group_sparse.cc
    const at::Tensor& t = single("allreduce", tensors);
    const DataType dtype = toDataType("allreduce", t.scalar_type());
    const ReduceOp op = toReduceOp("allreduce", opts.reduceOp, dtype);
    const std::optional<double> premul = premulFactor(opts.reduceOp);
    const CallDescriptor call = callOf("allreduce", Collective::kAllreduce, opts.timeout, &t, -1, static_cast<int>(op));
    return enqueue(call, OpType::ALLREDUCE, tensors,
                   [this, t, dtype, op, premul](Comm& c) {
                     if (premul) t.mul_(*premul);
                     lastAlgorithm_ = &pycomm::allreduce(c, t.data_ptr(), static_cast<size_t>(t.numel()),
                                                         dtype, op, algorithm_.load());
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce_coalesced(
    Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return runOnDevice("allreduce_coalesced", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::inout(tensors)),
                     [&](const Launch& launch, Tensors& tensors) {
    if (tensors.empty()) usageError(where("allreduce_coalesced") + "got no tensors");
    const DataType dtype = checkTensor("allreduce_coalesced", tensors[0]);
    for (size_t i = 0; i < tensors.size(); ++i)
      checkLike("allreduce_coalesced", tensors[i], tensors[0], tensors[i].numel(),
                "tensor " + std::to_string(i));
    const ReduceOp op = toReduceOp("allreduce_coalesced", opts.reduceOp, dtype);
    const std::optional<double> premul = premulFactor(opts.reduceOp);
    const CallDescriptor call =
        callOf("allreduce_coalesced", Collective::kAllreduce, opts.timeout, &tensors[0], totalNumel(tensors), static_cast<int>(op));
    return enqueue(call, OpType::ALLREDUCE_COALESCED, tensors,
                   [this, tensors, dtype, op, premul](Comm& c) {
                     Tensors flat;
                     for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
                     at::Tensor buffer = at::cat(flat);
                     if (premul) buffer.mul_(*premul);
                     pycomm::allreduce(c, buffer.data_ptr(), static_cast<size_t>(buffer.numel()),
                                       dtype, op, algorithm_.load());
                     int64_t offset = 0;
                     for (const auto& t : tensors) {
                       t.view({-1}).copy_(buffer.narrow(0, offset, t.numel()));
                       offset += t.numel();
                     }
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce(Tensors& tensors,
                                                          const c10d::ReduceOptions& opts) {
  return runOnDevice("reduce", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::inout(tensors)),
                     [&](const Launch& launch, Tensors& tensors) {
    const Tensors pairs = complexAsPairs("reduce", tensors, opts.reduceOp);  // the same memory
    const at::Tensor& t = single("reduce", pairs);
    const DataType dtype = toDataType("reduce", t.scalar_type());
    const ReduceOp op = toReduceOp("reduce", opts.reduceOp, dtype);
    const std::optional<double> premul = premulFactor(opts.reduceOp);
    checkRank("reduce", static_cast<int>(opts.rootRank), getSize(), "root rank");
    const int root = static_cast<int>(opts.rootRank);
    const CallDescriptor call = callOf("reduce", Collective::kReduce, opts.timeout, &t, -1, static_cast<int>(op), root);
    return enqueue(call, OpType::REDUCE, tensors,
                   [t, dtype, op, root, premul](Comm& c) {
                     // Only the root's tensor changes; other ranks reduce in a copy.
                     at::Tensor acc = c.rank() == root ? t : t.clone();
                     if (premul) acc.mul_(*premul);
                     pycomm::reduce(c, acc.data_ptr(), static_cast<size_t>(acc.numel()), dtype, op, root);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather(
    std::vector<Tensors>& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  return runOnDevice("allgather", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, std::vector<Tensors>& outputs, Tensors& inputs) {
    const at::Tensor& input = single("allgather", inputs);
    if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != getSize())
      usageError(where("allgather") + "expected one output list of " + std::to_string(getSize()) +
            " tensors");
    for (size_t i = 0; i < outputs[0].size(); ++i)
      checkLike("allgather", outputs[0][i], input, input.numel(), "output tensor " + std::to_string(i));
    Tensors outs = outputs[0];
    const CallDescriptor call = callOf("allgather", Collective::kAllgather, opts.timeout, &input);
    return enqueue(call, OpType::ALLGATHER, outs,
                   [input, outs](Comm& c) {
                     std::vector<char*> chunks;
                     for (const auto& o : outs) chunks.push_back(ptr(o));
                     if (input.nbytes() > 0 && chunks[c.rank()] != ptr(input))
                       std::memcpy(chunks[c.rank()], ptr(input), input.nbytes());
                     pycomm::allgather(c, chunks, std::vector<size_t>(outs.size(), input.nbytes()));
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  return runOnDevice("allgather_into_tensor", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(output), role::in(input)),
                     [&](const Launch& launch, at::Tensor& output, at::Tensor& input) {
    checkTensor("allgather_into_tensor", input);
    checkLike("allgather_into_tensor", output, input, input.numel() * getSize(), "output tensor");
    at::Tensor in = input, out = output;
    const CallDescriptor call = callOf("allgather_into_tensor", Collective::kAllgather, opts.timeout, &input);
    return enqueue(call, OpType::_ALLGATHER_BASE, {output},
                   [in, out](Comm& c) {
                     const size_t bytes = in.nbytes();
                     std::vector<char*> chunks;
                     for (int i = 0; i < c.size(); ++i) chunks.push_back(ptr(out) + i * bytes);
                     if (bytes > 0 && chunks[c.rank()] != ptr(in))
                       std::memmove(chunks[c.rank()], ptr(in), bytes);
                     pycomm::allgather(c, chunks, std::vector<size_t>(c.size(), bytes));
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_coalesced(
    std::vector<Tensors>& outputLists, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  return runOnDevice("allgather_coalesced", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputLists), role::in(inputs)),
                     [&](const Launch& launch, std::vector<Tensors>& outputLists, Tensors& inputs) {
    const char* op = "allgather_coalesced";
    if (static_cast<int>(outputLists.size()) != getSize())
      usageError(where(op) + "expected " + std::to_string(getSize()) + " output lists (one per rank)");
    for (size_t i = 0; i < inputs.size(); ++i) checkTensor(op, inputs[i]);
    for (size_t r = 0; r < outputLists.size(); ++r) {
      if (outputLists[r].size() != inputs.size())
        usageError(where(op) + "output list " + std::to_string(r) + " has " +
              std::to_string(outputLists[r].size()) + " tensors, expected " +
              std::to_string(inputs.size()));
      for (size_t i = 0; i < inputs.size(); ++i)
        checkLike(op, outputLists[r][i], inputs[i], inputs[i].numel(),
                  "output " + std::to_string(r) + "/" + std::to_string(i));
    }
    Tensors flatOutputs;
    for (const auto& list : outputLists) flatOutputs.insert(flatOutputs.end(), list.begin(), list.end());
    std::vector<Tensors> lists = outputLists;
    Tensors ins = inputs;
    const CallDescriptor call =
        callOf(op, Collective::kAllgather, opts.timeout, inputs.empty() ? nullptr : &inputs[0], totalNumel(inputs));
    return enqueue(call, OpType::ALLGATHER_COALESCED, flatOutputs,
                   [lists, ins](Comm& c) {
                     for (size_t i = 0; i < ins.size(); ++i) {
                       std::vector<char*> chunks;
                       for (const auto& list : lists) chunks.push_back(ptr(list[i]));
                       const size_t bytes = ins[i].nbytes();
                       if (bytes > 0) std::memcpy(chunks[c.rank()], ptr(ins[i]), bytes);
                       pycomm::allgather(c, chunks, std::vector<size_t>(lists.size(), bytes));
                     }
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_into_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  return runOnDevice("allgather_into_tensor_coalesced", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, Tensors& outputs, Tensors& inputs) {
    const char* op = "allgather_into_tensor_coalesced";
    if (outputs.size() != inputs.size())
      usageError(where(op) + "expected as many outputs as inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkTensor(op, inputs[i]);
      checkLike(op, outputs[i], inputs[i], inputs[i].numel() * getSize(), "output " + std::to_string(i));
    }
    Tensors ins = inputs, outs = outputs;
    const CallDescriptor call =
        callOf(op, Collective::kAllgather, opts.timeout, inputs.empty() ? nullptr : &inputs[0], totalNumel(inputs));
    return enqueue(call, OpType::COALESCED, outs,
                   [ins, outs](Comm& c) {
                     for (size_t i = 0; i < ins.size(); ++i) {
                       const size_t bytes = ins[i].nbytes();
                       std::vector<char*> chunks;
                       for (int r = 0; r < c.size(); ++r) chunks.push_back(ptr(outs[i]) + r * bytes);
                       if (bytes > 0) std::memmove(chunks[c.rank()], ptr(ins[i]), bytes);
                       pycomm::allgather(c, chunks, std::vector<size_t>(c.size(), bytes));
                     }
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::gather(std::vector<Tensors>& outputs,
                                                          Tensors& inputs,
                                                          const c10d::GatherOptions& opts) {
  return runOnDevice("gather", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, std::vector<Tensors>& outputs, Tensors& inputs) {
    const at::Tensor& input = single("gather", inputs);
    checkRank("gather", static_cast<int>(opts.rootRank), getSize(), "root rank");
    const int root = static_cast<int>(opts.rootRank);
    Tensors outs = checkRootList("gather", outputs, input, getRank() == root, getSize(), "output");
    const CallDescriptor call = callOf("gather", Collective::kGather, opts.timeout, &input, -1, -1, root);
    return enqueue(call, OpType::GATHER, outs,
                   [input, outs, root](Comm& c) {
                     std::vector<char*> chunks;
                     for (const auto& o : outs) chunks.push_back(ptr(o));
                     pycomm::gather(c, input.data_ptr(), input.nbytes(), chunks, root);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::scatter(Tensors& outputs,
                                                           std::vector<Tensors>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  return runOnDevice("scatter", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, Tensors& outputs, std::vector<Tensors>& inputs) {
    const at::Tensor& output = single("scatter", outputs);
    checkRank("scatter", static_cast<int>(opts.rootRank), getSize(), "root rank");
    const int root = static_cast<int>(opts.rootRank);
    Tensors ins = checkRootList("scatter", inputs, output, getRank() == root, getSize(), "input");
    const CallDescriptor call = callOf("scatter", Collective::kScatter, opts.timeout, &output, -1, -1, root);
    return enqueue(call, OpType::SCATTER, outputs,
                   [output, ins, root](Comm& c) {
                     std::vector<const char*> chunks;
                     for (const auto& i : ins) chunks.push_back(ptr(i));
                     pycomm::scatter(c, chunks, output.data_ptr(), output.nbytes(), root);
                   }, launch);
  });
}

namespace {

// Reduce-scatter over a scratch copy of the inputs; rank r's chunk lands in `output`.
void reduceScatterInto(Comm& c, const Tensors& inputs, const at::Tensor& output, DataType dtype,
                       ReduceOp op, std::optional<double> premul) {
  Tensors flat;
  for (const auto& t : inputs) flat.push_back(t.reshape({-1}));
  at::Tensor scratch = at::cat(flat);  // always a fresh copy
  if (premul) scratch.mul_(*premul);
  const size_t elementBytes = elementSize(dtype);
  std::vector<char*> chunks;
  std::vector<size_t> counts;
  size_t offset = 0;
  for (const auto& t : inputs) {
    chunks.push_back(ptr(scratch) + offset * elementBytes);
    counts.push_back(static_cast<size_t>(t.numel()));
    offset += static_cast<size_t>(t.numel());
  }
  pycomm::reduceScatter(c, chunks, counts, dtype, op);  // finishes AVG
  const size_t mine = counts[c.rank()];
  if (mine > 0) std::memcpy(ptr(output), chunks[c.rank()], mine * elementBytes);
}

// `parts` consecutive views of `numel` elements each over a contiguous tensor.
Tensors equalParts(const at::Tensor& t, int parts, int64_t numel) {
  at::Tensor flat = t.reshape({-1});
  Tensors result;
  for (int i = 0; i < parts; ++i) result.push_back(flat.narrow(0, i * numel, numel));
  return result;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter(
    Tensors& outputs, std::vector<Tensors>& inputs, const c10d::ReduceScatterOptions& opts) {
  return runOnDevice("reduce_scatter", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, Tensors& outputs, std::vector<Tensors>& inputs) {
    const Tensors outs = complexAsPairs("reduce_scatter", outputs, opts.reduceOp);  // the same memory
    const at::Tensor& output = single("reduce_scatter", outs);
    const DataType dtype = toDataType("reduce_scatter", output.scalar_type());
    const ReduceOp op = toReduceOp("reduce_scatter", opts.reduceOp, dtype);
    const std::optional<double> premul = premulFactor(opts.reduceOp);
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != getSize())
      usageError(where("reduce_scatter") + "expected one input list of " + std::to_string(getSize()) +
            " tensors");
    Tensors ins = complexAsPairs("reduce_scatter", inputs[0], opts.reduceOp);
    // As on gloo, the sizes may differ: input j is rank j's share, of rank j's output's
    // size on every rank. Only this rank's own share is checked here; ranks that disagree
    // on another's fail in the collective (their messages or arena steps differ in size).
    for (size_t i = 0; i < ins.size(); ++i)
      checkLike("reduce_scatter", ins[i], output,
                static_cast<int>(i) == getRank() ? output.numel() : ins[i].numel(),
                "input tensor " + std::to_string(i));
    // count: the inputs' total, the same on every rank when the shares agree
    const CallDescriptor call =
        callOf("reduce_scatter", Collective::kReduceScatter, opts.timeout, &output, totalNumel(ins), static_cast<int>(op));
    return enqueue(call, OpType::REDUCE_SCATTER, outputs,
                   [ins, output, dtype, op, premul](Comm& c) {
                     reduceScatterInto(c, ins, output, dtype, op, premul);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return runOnDevice("reduce_scatter_tensor", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(output), role::in(input)),
                     [&](const Launch& launch, at::Tensor& output, at::Tensor& input) {
    const char* name = "reduce_scatter_tensor";
    // the same memory as the caller's (complex tensors: their (re, im) pairs)
    at::Tensor in = complexAsPairs(name, input, opts.reduceOp), out = complexAsPairs(name, output, opts.reduceOp);
    const DataType dtype = checkTensor(name, out);
    const ReduceOp op = toReduceOp(name, opts.reduceOp, dtype);
    const std::optional<double> premul = premulFactor(opts.reduceOp);
    checkLike(name, in, out, out.numel() * getSize(), "input tensor");
    const CallDescriptor call = callOf(name, Collective::kReduceScatter, opts.timeout, &out, -1, static_cast<int>(op));
    return enqueue(call, OpType::_REDUCE_SCATTER_BASE, {output},
                   [in, out, dtype, op, premul](Comm& c) {
                     reduceScatterInto(c, equalParts(in, c.size(), out.numel()), out, dtype, op, premul);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::ReduceScatterOptions& opts) {
  return runOnDevice("reduce_scatter_tensor_coalesced", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, Tensors& outputs, Tensors& inputs) {
    const char* name = "reduce_scatter_tensor_coalesced";
    if (outputs.size() != inputs.size()) usageError(where(name) + "expected as many outputs as inputs");
    std::vector<std::pair<DataType, ReduceOp>> kinds;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const DataType dtype = checkTensor(name, outputs[i]);
      kinds.push_back({dtype, toReduceOp(name, opts.reduceOp, dtype)});
      checkLike(name, inputs[i], outputs[i], outputs[i].numel() * getSize(), "input " + std::to_string(i));
    }
    const std::optional<double> premul = premulFactor(opts.reduceOp);
    Tensors ins = inputs, outs = outputs;
    // OpType::COALESCED: REDUCE_SCATTER_TENSOR_COALESCED exists only from torch 2.12 on,
    // and the extension must also build against torch 2.11 (the GPU machine's).
    const CallDescriptor call =
        callOf(name, Collective::kReduceScatter, opts.timeout, outputs.empty() ? nullptr : &outputs[0], totalNumel(outputs));
    return enqueue(call, OpType::COALESCED, outs,
                   [ins, outs, kinds, premul](Comm& c) {
                     for (size_t i = 0; i < ins.size(); ++i)
                       reduceScatterInto(c, equalParts(ins[i], c.size(), outs[i].numel()), outs[i],
                                         kinds[i].first, kinds[i].second, premul);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  return runOnDevice("alltoall", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(output), role::in(input)),
                     [&](const Launch& launch, at::Tensor& output, at::Tensor& input) {
    const char* name = "alltoall_base";
    checkTensor(name, input);
    checkTensor(name, output);
    if (input.scalar_type() != output.scalar_type())
      usageError(where(name) + "input and output dtypes differ");
    const int n = getSize();
    // The arithmetic (negative splits, sums past the rows or past int64, byte counts
    // past size_t) is checked torch-free in algorithms/alltoall_splits.cc.
    auto plan = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      const size_t rowBytes = rows == 0 ? 0 : t.nbytes() / static_cast<size_t>(rows);
      AlltoallLayout layout;
      const std::string error = checkAlltoallSplits(splits, n, rows, rowBytes, what, &layout);
      if (!error.empty()) usageError(where(name) + error);
      return std::make_pair(std::move(layout.offsets), std::move(layout.bytes));
    };
    auto [sendOffsets, sendBytes] = plan(input, inputSplits, "input");
    auto [recvOffsets, recvBytes] = plan(output, outputSplits, "output");
    if (sendBytes[getRank()] != recvBytes[getRank()])
      usageError(where(name) + "this rank sends itself " + std::to_string(sendBytes[getRank()]) +
            " bytes but expects " + std::to_string(recvBytes[getRank()]));
    at::Tensor out = output, input_ = input;
    const CallDescriptor call = callOf("alltoall", Collective::kAlltoall, opts.timeout, &input, -2);
    return enqueue(call, OpType::ALLTOALL_BASE, {output},
                   [input_, out, sendOffsets = sendOffsets, sendBytes = sendBytes,
                    recvOffsets = recvOffsets, recvBytes = recvBytes](Comm& c) {
                     // Copied here, in queue order: a call queued before this one may
                     // still be writing the input.
                     const at::Tensor in = readableWhileWriting({input_}, {out})[0];
                     std::vector<const char*> sends;
                     std::vector<char*> recvs;
                     for (int i = 0; i < c.size(); ++i) {
                       sends.push_back(ptr(in) + sendOffsets[i]);
                       recvs.push_back(ptr(out) + recvOffsets[i]);
                     }
                     pycomm::alltoall(c, sends, sendBytes, recvs, recvBytes);
                   }, launch);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall(Tensors& outputs, Tensors& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  return runOnDevice("alltoall", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::out(outputs), role::in(inputs)),
                     [&](const Launch& launch, Tensors& outputs, Tensors& inputs) {
    const char* name = "alltoall";
    const int n = getSize();
    if (static_cast<int>(outputs.size()) != n || static_cast<int>(inputs.size()) != n)
      usageError(where(name) + "expected " + std::to_string(n) + " input and output tensors");
    for (int i = 0; i < n; ++i) {
      checkTensor(name, inputs[i]);
      checkTensor(name, outputs[i]);
      if (inputs[i].scalar_type() != outputs[0].scalar_type() ||
          outputs[i].scalar_type() != outputs[0].scalar_type())
        usageError(where(name) + "all tensors must have one dtype");
    }
    if (inputs[getRank()].nbytes() != outputs[getRank()].nbytes())
      usageError(where(name) + "the tensor this rank sends itself differs in size from its output slot");
    Tensors inputs_ = inputs, outs = outputs;
    const CallDescriptor call = callOf(name, Collective::kAlltoall, opts.timeout, &inputs[0], -2);
    return enqueue(call, OpType::ALLTOALL, outs,
                   [inputs_, outs](Comm& c) {
                     const Tensors ins = readableWhileWriting(inputs_, outs);  // in queue order
                     std::vector<const char*> sends;
                     std::vector<char*> recvs;
                     std::vector<size_t> sendBytes, recvBytes;
                     for (int i = 0; i < c.size(); ++i) {
                       sends.push_back(ptr(ins[i]));
                       sendBytes.push_back(ins[i].nbytes());
                       recvs.push_back(ptr(outs[i]));
                       recvBytes.push_back(outs[i].nbytes());
                     }
                     pycomm::alltoall(c, sends, sendBytes, recvs, recvBytes);
                   }, launch);
  });
}

}  // namespace pycomm
