#include "backend/work.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <cstdio>

#include "common/call.h"

namespace pycomm {

std::string GroupState::fail(const std::string& message, const std::string& reason) {
  std::string recorded;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) {
      failure_ = message;
      failed_.store(true, std::memory_order_release);
      first = true;
    }
    recorded = failure_;
  }
  if (first) {
    const std::string& told = reason.empty() ? message : reason;
    if (arena_) arena_->abort(told);
    transport_->abort(told);
  }
  return recorded;
}

std::string GroupState::failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::exception_ptr makeBackendError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

PycommWork::PycommWork(int rank, c10d::OpType opType, const char* profilingTitle,
                       std::vector<at::Tensor> outputs)
    : c10d::Work(rank, opType, profilingTitle),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

bool PycommWork::profilerActive() {
  return at::hasCallbacks() && at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE).has_value();
}

void PycommWork::recordProfile(const char* title,
                               const std::unordered_map<std::string, c10::IValue>& args) {
  // As c10d::Work does for its profiling title, plus keyword inputs: an async event
  // begun on the caller's thread and ended by finish(), on whichever thread that is.
  auto record = std::make_shared<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!record->isActive()) return;
  record->_setAsync();
  record->before(title, &args);
  std::function<void()> end = [record] { record->end(); };
  recordFunctionEndCallback_ = at::wrapPropagateTLSState(end);
}

void PycommWork::markDone(std::exception_ptr error, int sourceRank) {
  sourceRank_ = sourceRank;
  finish(error);
  completeFuture(error);
}

void PycommWork::completeFuture(std::exception_ptr error) {
  if (error) future_->setError(error);
  else future_->markCompleted(c10::IValue(outputs_));
}

bool PycommWork::wait(std::chrono::milliseconds timeout) {
  const bool done = c10d::Work::wait(timeout);  // throws the work's error
  future_->wait();
  return done;
}

PointToPointWork::PointToPointWork(int rank, c10d::OpType opType, const char* opName,
                                   std::vector<at::Tensor> tensors,
                                   std::shared_ptr<GroupState> group,
                                   std::chrono::milliseconds timeout, int peer)
    : PycommWork(rank, opType, opName, std::move(tensors)),
      opName_(opName),
      group_(std::move(group)),
      deadline_(Clock::now() + timeout),
      groupTimeout_(timeout),
      peer_(peer) {}

void PointToPointWork::attach(const RequestPtr& request, CompletionPool::Poster completions) {
  request_ = request;
  c10::intrusive_ptr<PointToPointWork> self =
      c10::intrusive_ptr<PointToPointWork>::reclaim_copy(this);
  const std::string op = opName_;
  request->onComplete([self, request, op, completions]() mutable {
    std::exception_ptr error;
    if (request->failed()) {
      // Transport errors come without an op prefix (a group's abort passes on
      // Error::detail()): this op names itself.
      error = makeBackendError(errorPrefix(op) + ": " + request->error());
    } else {
      self->sourceRank_ = request->sourceRank();
    }
    self->finishWork(error);  // wait() may return now
    {
      // Nobody has the future: nothing is attached to it, so completing it here runs
      // no user code (getFuture() waits for this).
      std::lock_guard<std::mutex> lock(self->futureMutex_);
      if (!self->futureHandedOut_) {
        self->completeFutureOnce(error);
        return;
      }
    }
    // Its callbacks are user code: a `then` chain may wait on another receive, which
    // only this thread can complete, or destroy the group. The work moves into the
    // posted completion, so this thread never drops the last reference to it.
    completions.post([work = std::move(self), error] { work->completeFutureOnce(error); });
  });
}

c10::intrusive_ptr<c10::ivalue::Future> PointToPointWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  futureHandedOut_ = true;
  return future_;
}

bool PointToPointWork::wait(std::chrono::milliseconds timeout) {
  auto deadline = deadline_;
  bool userDeadline = false;
  if (timeout != kNoTimeout && Clock::now() + timeout < deadline) {
    deadline = Clock::now() + timeout;
    userDeadline = true;
  }
  if (request_ && !request_->waitUntil(deadline)) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.1f", groupTimeout_.count() / 1000.0);
    const std::string who = peer_ == kAnySource ? std::string("any rank")
                                                : group_->transport().rankName(peer_);
    if (userDeadline) {
      C10_THROW_ERROR(DistBackendError, errorPrefix(opName_) + ": wait() timed out waiting for " + who);
    }
    const std::string detail = c10::str(group_->transport().rankName(group_->transport().rank()),
                                        ": Timed out after ", seconds, " s waiting for ", who);
    group_->fail(errorPrefix(opName_) + ": " + detail, detail);
  }
  const bool done = c10d::Work::wait(kNoTimeout);  // throws the work's error
  // Done: complete the future here unless the pool already has, so its value is
  // readable on return without waiting for a pool thread to be scheduled (callbacks
  // attached by now run on this thread, which may wait on anything).
  completeFutureOnce(nullptr);
  future_->wait();  // the pool may be completing it right now
  return done;
}

}  // namespace pycomm
