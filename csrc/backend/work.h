// Work objects handed to torch: completion, errors and the Future DDP hooks use.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/completion_pool.h"
#include "transport/shm_arena.h"
#include "transport/transport.h"

namespace pycomm {

// What a group's works share with it: the first runtime failure, and the
// transport to abort when one happens (so no buffer is written after it).
class GroupState {
 public:
  explicit GroupState(std::shared_ptr<Transport> transport) : transport_(std::move(transport)) {}
  // Records the first failure (`message`) and aborts the arena and the transport,
  // which tell the peers `reason` (the message without its op prefix; "" for the
  // message itself). Returns the recorded failure.
  std::string fail(const std::string& message, const std::string& reason = "");
  std::string failure();
  // Whether a failure was recorded: one atomic load (every call checks it).
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Transport& transport() { return *transport_; }
  const std::shared_ptr<Transport>& transportPtr() { return transport_; }
  // The node-local arena, when ranks share a host (aborted with the transport).
  void setArena(std::shared_ptr<ShmArena> arena) { arena_ = std::move(arena); }
  ShmArena* arena() { return arena_.get(); }

 private:
  std::mutex mutex_;
  std::string failure_;
  std::atomic<bool> failed_{false};  // set with failure_, under mutex_
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<ShmArena> arena_;
};

// Converts a failure message into the exception torch surfaces in Python as
// torch.distributed.DistBackendError.
std::exception_ptr makeBackendError(const std::string& message);

class PycommWork : public c10d::Work {
 public:
  PycommWork(int rank, c10d::OpType opType, const char* profilingTitle,
             std::vector<at::Tensor> outputs);

  // When torch's profiler is recording: an event `title` ("pycomm:allreduce")
  // from now until the work completes, carrying `args` (op, bytes, dtype,
  // algorithm, ...) as keyword inputs, which torch.profiler writes into the
  // trace's event args. profilerActive(): whether anything records at all (cheap).
  static bool profilerActive();
  void recordProfile(const char* title, const std::unordered_map<std::string, c10::IValue>& args);
  // Completes the work (and its future): successfully when `error` is null.
  void markDone(std::exception_ptr error, int sourceRank = -1);
  // The same in two steps: the work (wait() returns), then its future (callbacks
  // run), the second on another thread (the group's CompletionPool).
  void finishWork(std::exception_ptr error) { finish(error); }
  void completeFuture(std::exception_ptr error);
  // Until the work and its future are complete: a caller may use the future's
  // value right after wait().
  bool wait(std::chrono::milliseconds timeout) override;

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Only a receive has one; for any other work torch's own error, as gloo gives.
  int sourceRank() const override {
    if (opType_ != c10d::OpType::RECV && opType_ != c10d::OpType::RECVANYSOURCE) return c10d::Work::sourceRank();
    return sourceRank_;
  }

 protected:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int sourceRank_ = -1;
};

// A send or receive posted straight to the transport (not through the ordered
// queue, so isend/irecv pairs cannot deadlock). wait() is bounded by the group
// timeout: on expiry the group fails and the receive buffer is released.
// The request completes the work where it completes (usually a TCP I/O thread).
// So does the future, unless someone has asked for it (getFuture): then nothing can
// be attached to it yet, and it costs no hand-off. Once handed out, it completes
// on the group's CompletionPool (its callbacks are user code, which must not run
// on the I/O thread), or in wait() if that comes first.
class PointToPointWork : public PycommWork {
 public:
  PointToPointWork(int rank, c10d::OpType opType, const char* opName, std::vector<at::Tensor> tensors,
                   std::shared_ptr<GroupState> group, std::chrono::milliseconds timeout, int peer);
  void attach(const RequestPtr& request, CompletionPool::Poster completions);
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // Completes the future unless the pool or wait() already did.
  void completeFutureOnce(std::exception_ptr error) {
    if (!futureClaimed_.exchange(true, std::memory_order_acq_rel)) completeFuture(error);
  }

  std::atomic<bool> futureClaimed_{false};
  std::mutex futureMutex_;       // orders getFuture() against completion on the I/O thread
  bool futureHandedOut_ = false;  // under futureMutex_
  std::string opName_;
  std::shared_ptr<GroupState> group_;
  RequestPtr request_;
  Clock::time_point deadline_;
  std::chrono::milliseconds groupTimeout_;
  int peer_;
};

}  // namespace pycomm
