// CUDA tensors through the CPU collectives: the first, simple path (compiled only
// into the CUDA build, PYCOMM_WITH_CUDA); tests/test_cuda.py validates it where a
// GPU is lent. What has run where: docs/architecture.md, "CUDA".
//
// ProcessGroupPycommCuda overrides each collective: a call whose tensors are on
// the CPU goes to ProcessGroupPycomm unchanged; a call with CUDA tensors
//  1. checks they are on one device, strided and contiguous (usage errors raise);
//  2. enqueues a copy of each input into a pinned host twin on the caller's
//     current stream and records an event there (no host synchronisation);
//  3. runs the CPU collective on the twins, always queued (asyncOp), with its
//     body first waiting on that event (on the worker thread, see stagedBody);
//  4. when the CPU collective completes (on the worker), enqueues the copies of
//     the output twins back to the device on a side stream that first waits on
//     the call's event, and completes a CUDA Future there;
//  5. Work.wait() (and the Future's wait/then) makes the caller's current stream
//     wait on that Future's events: the device work after wait() is ordered after
//     the results landed, and the host blocks only until the collective is done.
// send() waits on its copy-in event on the caller's thread (point-to-point does
// not pass through the worker queue). Same-host CUDA IPC, pipelined segments and
// reductions in CUDA kernels are not done yet (docs/architecture.md).
#pragma once

#ifdef PYCOMM_WITH_CUDA

#include "backend/process_group.h"

namespace pycomm {

// The body the worker runs for a call made inside a staging scope on this thread:
// `body` preceded by a wait on the scope's copy-in event; `body` itself otherwise.
// ProcessGroupPycomm::enqueue calls it (CUDA build only).
std::function<void(Comm&)> stagedBody(std::function<void(Comm&)> body);

class ProcessGroupPycommCuda : public ProcessGroupPycomm {
 public:
  using ProcessGroupPycomm::ProcessGroupPycomm;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
};

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
