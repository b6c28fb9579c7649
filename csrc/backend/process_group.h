// ProcessGroupPycomm: the c10d::Backend that torch.distributed talks to.
//
// Every c10d entry point declares its tensors by role and runs through the device
// seam (device_seam.h): CPU tensors as they are, another device's through its seam.
// Collectives are validated at the call (usage errors raise there, naming the
// op), then run in submission order on one worker thread per group, so
// async_op=True overlaps with the caller's compute. Point-to-point operations
// go straight to the transport. The first runtime failure makes the group
// unusable: later operations fail at once with that failure.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/plan.h"
#include "backend/call_check.h"
#include "backend/completion_pool.h"
#include "backend/device_seam.h"
#include "backend/flight_recorder.h"
#include "backend/work.h"
#include "common/group_config.h"
#include "transport/transport.h"

namespace pycomm {

// The op name of dist.monitored_barrier's calls (errors, stats, the flight recorder).
constexpr const char* kMonitoredBarrier = "monitored_barrier";

class ProcessGroupPycomm : public c10d::Backend {
 public:
  // Bootstraps the group through `store` (torch's per-group prefix store;
  // transport/bootstrap.h).
  ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     GroupConfig config);
  // Runs over a given transport (the loopback transport in tests).
  ProcessGroupPycomm(std::shared_ptr<Transport> transport, GroupConfig config);
  ~ProcessGroupPycomm() override;

  const std::string getBackendName() const override { return "pycomm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;
  // abort() telling the peers why: they fail with "rank R aborted the group: <reason>"
  // (the hooks use it when they raise before their collective, so the peers do not wait
  // in it until the timeout).
  void abortWithReason(const std::string& reason);
  // Sequence numbers (torch's desync checks, object collectives on subgroups):
  // every rank counts the collectives it submitted, starting from 0, so the
  // counts agree while the ranks make the same calls. Point-to-point is not counted.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }

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
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  // Algorithm control and introspection (pycomm.set_algorithm & co).
  void setAlgorithm(const std::string& name);
  std::string algorithm() const;
  std::string selectAlgorithm(size_t bytes) const;
  std::string lastAlgorithm() const;
  // The first runtime failure ("" while the group is healthy).
  std::string failure() { return group_->failure(); }
  uint64_t bytesSent() const { return group_->transportPtr()->bytesSent(); }
  uint64_t bytesReceived() const { return group_->transportPtr()->bytesReceived(); }
  // The last collectives of this group (pycomm.flight_recorder()), oldest first.
  std::vector<CallRecord> flightRecord() const { return recorder_.snapshot(); }

  // ---- compressed collectives (process_group_compressed.cc; float32 CPU tensors).
  // Queued on the worker in submission order like every collective; usage errors
  // raise here; the Work's Future completes with [tensor] / [out].
  // Quantized all-reduce: tensor <- sum over ranks (allreduceQuantized). residual:
  // an undefined tensor or float32 of tensor's size (error feedback, updated in place).
  // segments: lengths of the parameters the tensor holds (empty: one); keys: one per
  // segment for the rounding seeds (empty: their positions).
  c10::intrusive_ptr<c10d::Work> allreduceQuantizedTensor(at::Tensor tensor, at::Tensor residual,
                                                          std::vector<int64_t> segments,
                                                          std::vector<int64_t> keys, int bits,
                                                          int64_t block, bool stochastic,
                                                          int64_t seed, bool asyncOp);
  // Sparse all-reduce: out (count float32) <- sum over ranks of (indices int64
  // ascending, values float32), divided by `divisor`. valueType "float32" | "float16" |
  // "bfloat16".
  c10::intrusive_ptr<c10d::Work> allreduceSparseTensor(at::Tensor indices, at::Tensor values,
                                                       at::Tensor out, at::Tensor residual,
                                                       std::vector<int64_t> segments,
                                                       const std::string& valueType,
                                                       double keepDensity, double divisor, bool asyncOp);

 private:
  // dist.all_reduce of a sparse COO tensor (process_group_sparse.cc): the tensor
  // becomes the coalesced sum (or mean) over ranks, in place, as on gloo.
  c10::intrusive_ptr<c10d::Work> allreduceCoo(std::vector<at::Tensor>& tensors,
                                              const c10d::AllreduceOptions& opts,
                                              const Launch& launch);

  using Body = std::function<void(Comm&)>;
  // Queues `body` for the worker (`launch.beforeBody` first, `launch.afterBody` after
  // it succeeds, both before the work completes), or runs it inline for a
  // blocking call with nothing queued; the returned work completes with `outputs`.
  // An inline call with `launch.workOptional` returns no work (nullptr), unless
  // the profiler records or torch registers in-flight works (a failure throws).
  // (work_queue.cc) `call`: the entry point's description (common/call.h), whose
  // bytes (of `outputs`) and timeout (the group's if unset) enqueue fills in.
  c10::intrusive_ptr<c10d::Work> enqueue(CallDescriptor call, c10d::OpType type,
                                         std::vector<at::Tensor> outputs, Body body,
                                         const Launch& launch);
  void workerLoop();
  void stopWorker();
  std::chrono::milliseconds effectiveTimeout(std::chrono::milliseconds requested) const;
  c10::intrusive_ptr<c10d::Work> pointToPoint(const char* op, c10d::OpType type,
                                              std::vector<at::Tensor>& tensors, int peer, int tag,
                                              bool isSend);
  // Starts the worker with the all-reduce `setting` (PYCOMM_ALGO, found by the constructor).
  void start(const AllreduceAlgorithm* setting);
  // Makes `setting` the group's all-reduce algorithm after checking that it fits the
  // group (the one check: the run trusts it, as the group's topology never changes).
  void applySetting(const AllreduceAlgorithm* setting);

  struct Task {
    CallDescriptor call;
    std::function<void()> beforeBody;  // a device seam's step (empty: none)
    Body body;
    std::function<void()> afterBody;   // a device seam's step after a body that succeeded
    c10::intrusive_ptr<PycommWork> work;
    uint64_t seq = 0;  // the group's sequence number of this call
  };
  // Runs one task to completion: on the worker thread, whose Future completions
  // (and their callbacks) go to completions_, or inline on a blocking caller,
  // which completes the Future itself (no callback can be attached yet). A task
  // without a work (inline only) returns its failure instead (null: success).
  std::exception_ptr runTask(Task& task, bool inline_);
  // The algorithm `op` on `bytes` is expected to run (for the profiler, which
  // needs it when the call is made; the flight recorder keeps what did run).
  std::string expectedAlgorithm(const CallDescriptor& call) const;
  // After a runtime failure of call `seq`: publishes this rank's progress in the
  // store and, when `compare`, waits briefly for the peers' and returns the
  // verdict (flight_recorder.h compareProgress; "" without one). Bounded: a store
  // that does not answer costs at most the grace period.
  std::string exchangeProgress(uint64_t seq, bool compare);

  GroupConfig config_;
  // The lowest rank of each host, ascending (empty with PYCOMM_TRANSPORT=tcp).
  std::vector<int> hostLeaders_;
  std::shared_ptr<GroupState> group_;
  std::unique_ptr<Comm> comm_;  // used by the worker thread only
  // The all-reduce setting (nullptr: auto) and what the last all-reduce ran.
  std::atomic<const AllreduceAlgorithm*> algorithm_{nullptr};
  std::atomic<const AllreduceAlgorithm*> lastAlgorithm_{nullptr};

  std::atomic<uint64_t> sequence_{0};  // collectives submitted (enqueue)
  FlightRecorder recorder_;  // the last collectives (flight_recorder.h)
  // torch's store (for the progress exchange after a failure); null over a given transport.
  c10::intrusive_ptr<c10d::Store> store_;

  std::mutex queueMutex_;
  std::condition_variable queueCv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  bool busy_ = false;  // a task is running (on the worker or inline on a caller)
  std::thread worker_;
  CompletionPool completions_;  // stopped after the worker
};

}  // namespace pycomm
