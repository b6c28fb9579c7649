// ProcessGroupPycomm's work queue: every collective is queued here in submission
// order (enqueue, on the caller's thread: the sequence number, the flight recorder's
// "queued", the profiler's event) and run by runTask, on the group's worker thread or
// inline on a blocking caller with nothing queued ahead of it: the call check, the
// call hash, the device seam's steps, the body, then the Work's completion. After a
// runtime failure exchangeProgress tells the peers how far this rank got.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>  // allow_inflight_collective_as_graph_input

#include <condition_variable>
#include <cstring>
#include <thread>

#include "backend/call_check.h"
#include "backend/process_group.h"
#include "backend/tensor_checks.h"
#include "common/logging.h"
#include "common/stats.h"
#include "common/thread_name.h"

namespace pycomm {

namespace {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;

// What a tensor holds: its storage bytes, or a sparse tensor's indices and values.
uint64_t heldBytes(const at::Tensor& t) {
  if (!t.defined()) return 0;
  if (t.is_sparse()) return t._indices().nbytes() + t._values().nbytes();
  return t.nbytes();
}

}  // namespace

void ProcessGroupPycomm::stopWorker() {
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    stopping_ = true;
  }
  queueCv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void ProcessGroupPycomm::workerLoop() {
  nameThisThread("pycomm-worker");
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(queueMutex_);
      queueCv_.wait(lock, [&] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    runTask(task, /*inline_=*/false);
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      busy_ = false;
    }
    queueCv_.notify_all();
  }
}

std::exception_ptr ProcessGroupPycomm::runTask(Task& task, bool inline_) {
  at::NoGradGuard noGrad;  // scratch copies made here never join an autograd graph
  std::exception_ptr error;
  const auto started = Clock::now();
  Clock::time_point ended;
  recorder_.started(task.seq, started);
  const std::string earlier = group_->failed() ? group_->failure() : std::string();
  if (!earlier.empty()) {
    error = makeBackendError(errorPrefix(task.call.op) +
                             ": the process group is unusable after an earlier failure (" +
                             earlier + "); destroy it and create a new one");
    ended = Clock::now();
    recorder_.finished(task.seq, "", true, ended);
  } else {
    try {
      comm_->begin(task.call);
      // Not before a monitored barrier: the check would wait for the very ranks it is
      // to name, and time out without naming them.
      if (config_.checkCalls && comm_->size() > 1 && task.call.collective != Collective::kMonitoredBarrier)
        checkSameCall(*comm_, task.call);
      comm_->setCall(callHash(task.call));  // after the check, which names both calls
      if (task.beforeBody) task.beforeBody();
      task.body(*comm_);
      if (task.afterBody) task.afterBody();
    } catch (const Error& e) {
      std::string message = e.what();
      ended = Clock::now();
      group_->fail(message, e.detail());  // aborts first: peers learn of it at once
      recorder_.finished(task.seq, comm_->algorithmName(), true, ended);
      // Every failed rank publishes how far it got; one that timed out also waits
      // briefly for the others' and says which rank is behind, at which call.
      const std::string verdict = exchangeProgress(task.seq, e.kind() == ErrorKind::kTimeout);
      if (!verdict.empty()) message += "; " + verdict;
      debugLog("failure: " + message);
      error = makeBackendError(message);
    } catch (const std::exception& e) {
      const std::string message = e.what();
      ended = Clock::now();
      group_->fail(message);
      recorder_.finished(task.seq, comm_->algorithmName(), true, ended);
      exchangeProgress(task.seq, false);
      debugLog("failure: " + message);
      error = makeBackendError(message);
    }
    if (error == nullptr) {
      ended = Clock::now();
      recorder_.finished(task.seq, comm_->algorithmName(), false, ended);
    }
  }
  Stats::instance().recordOp(task.call.op, std::chrono::duration<double>(ended - started).count(),
                             task.call.bytes, error != nullptr, getSize());
  if (!task.work) return error;
  if (inline_) {
    task.work->markDone(error);
  } else {
    // wait() returns now; callbacks run off the worker, which may be needed for
    // a collective one of them waits on (torch's PowerSGD does).
    task.work->finishWork(error);
    completions_.post([work = task.work, error] { work->completeFuture(error); });
  }
  return nullptr;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::enqueue(CallDescriptor call, OpType type,
                                                           Tensors outputs, Body body,
                                                           const Launch& launch) {
  const bool asyncOp = launch.asyncOp;
  call.bytes = 0;
  for (const auto& t : outputs) call.bytes += heldBytes(t);
  call.timeout = effectiveTimeout(call.timeout);
  // The profiling title goes to our own event (recordProfile), not c10d::Work's.
  c10::intrusive_ptr<PycommWork> work;
  const bool profiling = PycommWork::profilerActive();
  // A blocking call may go without a Work (see enqueue's declaration), saving the
  // Work, its Future and torch's wait() on them: most of a small call's CPU time
  // beyond torch's own frontend.
  const bool workOptional = launch.workOptional && !asyncOp && !profiling &&
                            !c10d::allow_inflight_collective_as_graph_input();
  auto makeWork = [&] { return c10::make_intrusive<PycommWork>(getRank(), type, nullptr, std::move(outputs)); };
  if (!workOptional) work = makeWork();
  if (profiling) {
    work->recordProfile(
        (std::string("pycomm:") + call.op).c_str(),
        {{"op", c10::IValue(std::string(call.op))},
         {"bytes", c10::IValue(static_cast<int64_t>(call.bytes))},
         {"dtype", c10::IValue(std::string(call.dtypeName()))},
         {"algorithm", c10::IValue(expectedAlgorithm(call))},
         {"seq", c10::IValue(static_cast<int64_t>(sequence_.load()))},
         {"group_size", c10::IValue(static_cast<int64_t>(getSize()))},
         {"async_op", c10::IValue(asyncOp)}});
  }
  Task task{call, launch.beforeBody, std::move(body), launch.afterBody, work, 0};
  {
    std::unique_lock<std::mutex> lock(queueMutex_);
    if (stopping_) usageError(where(call.op) + "the process group was shut down");
    task.seq = sequence_++;
    recorder_.queued(task.seq, call, Clock::now());
    if (!asyncOp && queue_.empty() && !busy_) {
      // A blocking call with nothing ahead of it runs here: same order, two
      // thread hand-offs fewer.
      busy_ = true;
      lock.unlock();
      std::exception_ptr error = runTask(task, /*inline_=*/true);
      lock.lock();
      busy_ = false;
      // The worker waits for !busy_ only with work queued or a stop pending;
      // waking it after every blocking call would cost a context switch per call.
      const bool wakeWorker = !queue_.empty() || stopping_;
      lock.unlock();
      if (wakeWorker) queueCv_.notify_all();
      if (error) std::rethrow_exception(error);
      return work;  // nullptr when the caller takes none
    }
    if (!task.work) {  // queued after all (work ahead of it): it needs its Work
      task.work = work = makeWork();
    }
    queue_.push_back(std::move(task));
  }
  queueCv_.notify_one();
  return work;
}

std::string ProcessGroupPycomm::exchangeProgress(uint64_t seq, bool compare) {
  const int n = getSize(), me = getRank();
  if (!store_ || n < 2) return "";
  ProgressReport mine;
  mine.reported = true;
  mine.seq = static_cast<int64_t>(seq);
  mine.lastCompleted = recorder_.lastCompleted();
  CallRecord record;
  mine.call = recorder_.find(seq, &record) ? describeRecord(record) : "?";
  // The store may be gone with a failed rank (torch's TCPStore lives in rank 0), so
  // the exchange runs on a thread of its own and is waited for a bounded time.
  struct Shared {
    std::mutex mutex;
    std::condition_variable cv;
    bool published = false;  // this rank's report is in the store (or the store failed)
    bool done = false;
    std::vector<ProgressReport> reports;
  };
  auto shared = std::make_shared<Shared>();
  const auto grace = std::min<std::chrono::milliseconds>(config_.timeout, std::chrono::milliseconds(1000));
  const std::string prefix = config_.storePrefix + "progress/";
  std::thread([shared, store = store_, prefix, n, me, mine, compare, grace] {
    std::vector<ProgressReport> reports(n);
    reports[me] = mine;
    try {
      const std::string value = encodeProgress(mine);
      store->set(prefix + std::to_string(me), std::vector<uint8_t>(value.begin(), value.end()));
      {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->published = true;
      }
      shared->cv.notify_all();
      const auto deadline = Clock::now() + grace;
      int missing = n - 1;
      while (compare && missing > 0 && Clock::now() < deadline) {
        for (int r = 0; r < n; ++r) {
          if (r == me || reports[r].reported) continue;
          const std::string key = prefix + std::to_string(r);
          if (!store->check({key})) continue;
          const std::vector<uint8_t> bytes = store->get(key);
          if (decodeProgress(std::string(bytes.begin(), bytes.end()), &reports[r])) --missing;
        }
        if (missing > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (...) {
      // A store that fails leaves the reports we have.
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->reports = std::move(reports);
    shared->published = shared->done = true;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mutex);
  if (!compare) {
    // Publish before the failure reaches the caller: a rank whose caller then leaves
    // (and with it, for torch's TCPStore, the store it hosts) would otherwise be named
    // by the rank that compares as one that never reached the call.
    shared->cv.wait_for(lock, grace, [&] { return shared->published; });
    return "";
  }
  if (!shared->cv.wait_for(lock, grace + std::chrono::milliseconds(500), [&] { return shared->done; }))
    return "flight recorder: the store did not answer in time to compare the ranks' progress";
  std::vector<std::string> names;
  for (int r = 0; r < n; ++r) names.push_back(group_->transport().rankName(r));
  return compareProgress(me, shared->reports, names);
}


}  // namespace pycomm
