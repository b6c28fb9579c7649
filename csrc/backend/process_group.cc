#include "backend/process_group.h"

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>  // allow_inflight_collective_as_graph_input

#include <condition_variable>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "algorithms/alltoall_splits.h"
#include "backend/store_adapter.h"
#include "backend/tensor_checks.h"
#include "common/fnv.h"
#include "common/logging.h"
#include "common/stats.h"
#include "common/thread_name.h"
#include "transport/bootstrap.h"

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

CallSignature signature(const char* op, const at::Tensor* like = nullptr, int64_t count = -1,
                        int reduceOp = -1, int root = -1) {
  CallSignature sig;
  std::strncpy(sig.op, op, sizeof(sig.op) - 1);
  if (like != nullptr) {
    sig.dtype = static_cast<int32_t>(toDataType(op, like->scalar_type()));
    // count: -1 takes the tensor's numel, -2 leaves counts uncompared (all-to-all splits differ).
    sig.count = count == -2 ? -1 : count >= 0 ? count : like->numel();
  }
  sig.reduceOp = reduceOp;
  sig.root = root;
  return sig;
}

// What a tensor holds: its storage bytes, or a sparse tensor's indices and values.
uint64_t heldBytes(const at::Tensor& t) {
  if (!t.defined()) return 0;
  if (t.is_sparse()) return t._indices().nbytes() + t._values().nbytes();
  return t.nbytes();
}

int64_t totalNumel(const Tensors& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

// What Comm::setCall puts in a collective's tags: FNV-1a over the collective, dtype,
// reduce op and root (not the count: sizes are checked by the message sizes, and
// all-to-all's differ).
uint64_t callHash(const CallSignature& sig) {
  uint64_t h = fnv1a(sig.op, std::strlen(sig.op), 1469598103934665603ull);  // (a digit short of kFnvOffset)
  h = fnv1a(&sig.dtype, sizeof(sig.dtype), h);
  h = fnv1a(&sig.reduceOp, sizeof(sig.reduceOp), h);
  h = fnv1a(&sig.root, sizeof(sig.root), h);
  return h ^ (h >> 29);
}

std::string describeCall(const CallSignature& sig) {
  std::string text = sig.op;
  if (sig.dtype >= 0) text += strCat(" ", dataTypeName(static_cast<DataType>(sig.dtype)));
  if (sig.count >= 0) text += strCat(" x", sig.count);
  if (sig.reduceOp >= 0) text += strCat(" ", reduceOpName(static_cast<ReduceOp>(sig.reduceOp)));
  if (sig.root >= 0) text += strCat(" root ", sig.root);
  return text;
}

}  // namespace

void ProcessGroupPycomm::checkSameCall(Comm& comm, const CallSignature& mine) {
  const int n = comm.size();
  std::vector<CallSignature> all(n);
  all[comm.rank()] = mine;
  std::vector<char*> chunks;
  for (auto& sig : all) chunks.push_back(reinterpret_cast<char*>(&sig));
  comm.setAlgorithm("check");
  ringAllgather(comm, chunks, std::vector<size_t>(n, sizeof(CallSignature)));
  comm.setAlgorithm("");
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && std::memcmp(&all[r], &all[0], sizeof(CallSignature)) == 0;
  if (same) return;
  std::string calls;
  for (int r = 0; r < n && r < 8; ++r)
    calls += strCat(r ? "; " : "", comm.transport().rankName(r), ": ", describeCall(all[r]));
  const std::string detail = strCat("ranks made different calls (PYCOMM_CHECK): ", calls, n > 8 ? "; ..." : "");
  throw Error(ErrorKind::kUsage, strCat("pycomm ", mine.op, ": ", detail), detail);
}

ProcessGroupPycomm::ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, GroupConfig config)
    : c10d::Backend(rank, size), config_(std::move(config)), store_(store) {
  setDebugEnabled(config_.debug);
  GroupTransport bootstrapped;
  try {
    findAllreduceAlgorithm(config_.algorithm);  // reject a bad PYCOMM_ALGO before connecting
    StoreAdapter adapter(store);
    bootstrapped = bootstrapGroup(adapter, rank, size, config_);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUsage) usageError(e.what());
    C10_THROW_ERROR(DistNetworkError, e.what());
  }
  hostLeaders_ = std::move(bootstrapped.hostLeaders);
  group_ = std::make_shared<GroupState>(std::move(bootstrapped.transport));
  group_->setArena(std::move(bootstrapped.arena));
  start();
}

ProcessGroupPycomm::ProcessGroupPycomm(std::shared_ptr<Transport> transport, GroupConfig config)
    : c10d::Backend(transport->rank(), transport->size()), config_(std::move(config)) {
  setDebugEnabled(config_.debug);
  transport->setGlobalRanks(config_.globalRanks);
  group_ = std::make_shared<GroupState>(std::move(transport));
  start();
}

void ProcessGroupPycomm::start() {
  comm_ = std::make_unique<Comm>(group_->transport(), config_.timeout, config_.segmentBytes);
  comm_->setArena(group_->arena());
  comm_->setCostModel(config_.cost);
  comm_->setHostLeaders(hostLeaders_);
  try {
    const AllreduceAlgorithm* setting = findAllreduceAlgorithm(config_.algorithm);
    if (setting != nullptr) checkFits(*setting, topologyOf(*comm_));
    algorithm_ = setting;
  } catch (const Error& e) {
    usageError(strCat(e.what(), " (PYCOMM_ALGO=", config_.algorithm, ")"));
  }
  worker_ = std::thread([this] { workerLoop(); });
}

ProcessGroupPycomm::~ProcessGroupPycomm() { shutdown(); }

void ProcessGroupPycomm::stopWorker() {
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    stopping_ = true;
  }
  queueCv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void ProcessGroupPycomm::shutdown() {
  auto stop = [this] {
    stopWorker();  // runs what is queued, then stops
    completions_.stop();  // completes their futures
    if (group_->arena()) group_->arena()->leave();  // local peers still waiting fail now
    group_->transportPtr()->abort("the process group was shut down");
  };
  // Python may drop the last reference with the GIL held, while a future callback
  // on the worker waits for the GIL: release it for the join.
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* state = PyEval_SaveThread();
    stop();
    PyEval_RestoreThread(state);
  } else {
    stop();
  }
}

void ProcessGroupPycomm::abort() { abortWithReason("the process group was aborted"); }

void ProcessGroupPycomm::abortWithReason(const std::string& reason) {
  group_->fail("pycomm: " + reason, reason);
  stopWorker();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupPycomm::getBackendOptions() {
  return c10::make_intrusive<Options>("pycomm", config_.timeout);
}

void ProcessGroupPycomm::setTimeout(std::chrono::milliseconds timeout) { config_.timeout = timeout; }

std::chrono::milliseconds ProcessGroupPycomm::effectiveTimeout(
    std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? config_.timeout : requested;
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
    error = makeBackendError("pycomm " + task.op +
                             ": the process group is unusable after an earlier failure (" +
                             earlier + "); destroy it and create a new one");
    ended = Clock::now();
    recorder_.finished(task.seq, "", true, ended);
  } else {
    try {
      comm_->begin(task.op, task.timeout);
      // Not before a monitored barrier: the check would wait for the very ranks it is
      // to name, and time out without naming them.
      if (config_.checkCalls && comm_->size() > 1 && task.op != kMonitoredBarrier)
        checkSameCall(*comm_, task.signature);
      comm_->setCall(callHash(task.signature));  // after the check, which names both calls
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
  Stats::instance().recordOp(task.op, std::chrono::duration<double>(ended - started).count(),
                             task.bytes, error != nullptr, getSize());
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

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::enqueue(const char* op, OpType type,
                                                           Tensors outputs, Body body,
                                                           std::chrono::milliseconds timeout,
                                                           const Launch& launch,
                                                           CallSignature signature) {
  const bool asyncOp = launch.asyncOp;
  uint64_t bytes = 0;
  for (const auto& t : outputs) bytes += heldBytes(t);
  const bool sparse = !outputs.empty() && outputs[0].defined() && outputs[0].is_sparse();
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
    const char* dtype =
        signature.dtype >= 0 ? dataTypeName(static_cast<DataType>(signature.dtype)) : "";
    work->recordProfile(
        (std::string("pycomm:") + op).c_str(),
        {{"op", c10::IValue(std::string(op))},
         {"bytes", c10::IValue(static_cast<int64_t>(bytes))},
         {"dtype", c10::IValue(std::string(dtype))},
         {"algorithm", c10::IValue(sparse ? std::string("coo") : expectedAlgorithm(op, bytes))},
         {"seq", c10::IValue(static_cast<int64_t>(sequence_.load()))},
         {"group_size", c10::IValue(static_cast<int64_t>(getSize()))},
         {"async_op", c10::IValue(asyncOp)}});
  }
  Task task{op, launch.beforeBody, std::move(body), launch.afterBody, work, effectiveTimeout(timeout), signature,
            0, bytes};
  {
    std::unique_lock<std::mutex> lock(queueMutex_);
    if (stopping_) usageError(where(op) + "the process group was shut down");
    task.seq = sequence_++;
    recorder_.queued(task.seq, op,
                     signature.dtype >= 0 ? dataTypeName(static_cast<DataType>(signature.dtype)) : "",
                     bytes, Clock::now());
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

void ProcessGroupPycomm::setAlgorithm(const std::string& name) {
  try {
    const AllreduceAlgorithm* setting = findAllreduceAlgorithm(name);
    if (setting != nullptr) checkFits(*setting, topologyOf(*comm_));
    algorithm_ = setting;
  } catch (const Error& e) {
    usageError(e.what());
  }
}

std::string ProcessGroupPycomm::algorithm() const { return settingName(algorithm_.load()); }

std::string ProcessGroupPycomm::selectAlgorithm(size_t bytes) const {
  const AllreduceAlgorithm* setting = algorithm_.load();
  return setting != nullptr ? setting->name : chooseAllreduceAlgorithm(bytes, topologyOf(*comm_)).name;
}

std::string ProcessGroupPycomm::expectedAlgorithm(const std::string& op, uint64_t bytes) const {
  // Mirrors the dispatch: allreduce_registry.cc for all-reduce, dispatch.cc for the rest.
  if (op == "allreduce" || op == "allreduce_coalesced") return selectAlgorithm(bytes);
  if (op == "allreduce_quantized") return "quantized";
  if (op == "allreduce_sparse") return "sparse";
  if (op == kMonitoredBarrier) return "monitored";  // point to point, on one host too
  if (getSize() > 1 && topologyOf(*comm_).oneHost) return "shm";
  if (op == "broadcast" || op == "reduce") return "tree";
  if (op.rfind("allgather", 0) == 0 || op.rfind("reduce_scatter", 0) == 0) return "ring";
  if (op == "gather" || op == "scatter") return "direct";
  if (op == "alltoall") return "pairwise";
  if (op == "barrier") return "dissemination";
  return "";
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
    shared->done = true;
    shared->cv.notify_all();
  }).detach();
  if (!compare) return "";
  std::unique_lock<std::mutex> lock(shared->mutex);
  if (!shared->cv.wait_for(lock, grace + std::chrono::milliseconds(500), [&] { return shared->done; }))
    return "flight recorder: the store did not answer in time to compare the ranks' progress";
  std::vector<std::string> names;
  for (int r = 0; r < n; ++r) names.push_back(group_->transport().rankName(r));
  return compareProgress(me, shared->reports, names);
}

std::string ProcessGroupPycomm::lastAlgorithm() const {
  const AllreduceAlgorithm* last = lastAlgorithm_.load();
  return last == nullptr ? "" : last->name;
}

// ---------------------------------------------------------------- collectives
//
// Each entry point declares its tensors by role once and runs its body through
// runOnDevice (device_seam.h): CPU tensors as they are, a device with a seam (CUDA in
// the CUDA build, PYCOMM_WITH_CUDA: cuda_staging.cc) on host copies. The body checks
// the tensors it is given and enqueues with the Launch it is given.

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::broadcast(Tensors& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  return runOnDevice("broadcast", getRank(), Dispatch::kQueued, opts.asyncOp,
                     declare(role::inout(tensors)),
                     [&](const Launch& launch, Tensors& tensors) {
    const at::Tensor& t = single("broadcast", tensors);
    checkRank("broadcast", static_cast<int>(opts.rootRank), getSize(), "root rank");
    const int root = static_cast<int>(opts.rootRank);
    return enqueue("broadcast", OpType::BROADCAST, tensors,
                   [t, root](Comm& c) {
                     pycomm::broadcast(c, t.data_ptr(), t.nbytes(), root);
                   },
                   opts.timeout, launch,
                   signature("broadcast", &t, -1, -1, root));
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
    return enqueue("allreduce", OpType::ALLREDUCE, tensors,
                   [this, t, dtype, op, premul](Comm& c) {
                     if (premul) t.mul_(*premul);
                     lastAlgorithm_ = &pycomm::allreduce(c, t.data_ptr(), static_cast<size_t>(t.numel()),
                                                         dtype, op, algorithm_.load());
                   },
                   opts.timeout, launch,
                   signature("allreduce", &t, -1, static_cast<int>(op)));
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
    return enqueue("allreduce_coalesced", OpType::ALLREDUCE_COALESCED, tensors,
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
                   },
                   opts.timeout, launch,
                   signature("allreduce_coalesced", &tensors[0], totalNumel(tensors), static_cast<int>(op)));
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
    return enqueue("reduce", OpType::REDUCE, tensors,
                   [t, dtype, op, root, premul](Comm& c) {
                     // Only the root's tensor changes; other ranks reduce in a copy.
                     at::Tensor acc = c.rank() == root ? t : t.clone();
                     if (premul) acc.mul_(*premul);
                     pycomm::reduce(c, acc.data_ptr(), static_cast<size_t>(acc.numel()), dtype, op, root);
                   },
                   opts.timeout, launch,
                   signature("reduce", &t, -1, static_cast<int>(op), root));
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
    return enqueue("allgather", OpType::ALLGATHER, outs,
                   [input, outs](Comm& c) {
                     std::vector<char*> chunks;
                     for (const auto& o : outs) chunks.push_back(ptr(o));
                     if (input.nbytes() > 0 && chunks[c.rank()] != ptr(input))
                       std::memcpy(chunks[c.rank()], ptr(input), input.nbytes());
                     pycomm::allgather(c, chunks, std::vector<size_t>(outs.size(), input.nbytes()));
                   },
                   opts.timeout, launch,
                   signature("allgather", &input));
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
    return enqueue("allgather_into_tensor", OpType::_ALLGATHER_BASE, {output},
                   [in, out](Comm& c) {
                     const size_t bytes = in.nbytes();
                     std::vector<char*> chunks;
                     for (int i = 0; i < c.size(); ++i) chunks.push_back(ptr(out) + i * bytes);
                     if (bytes > 0 && chunks[c.rank()] != ptr(in))
                       std::memmove(chunks[c.rank()], ptr(in), bytes);
                     pycomm::allgather(c, chunks, std::vector<size_t>(c.size(), bytes));
                   },
                   opts.timeout, launch,
                   signature("allgather_into_tensor", &input));
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
    return enqueue(op, OpType::ALLGATHER_COALESCED, flatOutputs,
                   [lists, ins](Comm& c) {
                     for (size_t i = 0; i < ins.size(); ++i) {
                       std::vector<char*> chunks;
                       for (const auto& list : lists) chunks.push_back(ptr(list[i]));
                       const size_t bytes = ins[i].nbytes();
                       if (bytes > 0) std::memcpy(chunks[c.rank()], ptr(ins[i]), bytes);
                       pycomm::allgather(c, chunks, std::vector<size_t>(lists.size(), bytes));
                     }
                   },
                   opts.timeout, launch,
                   signature(op, inputs.empty() ? nullptr : &inputs[0], totalNumel(inputs)));
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
    return enqueue(op, OpType::COALESCED, outs,
                   [ins, outs](Comm& c) {
                     for (size_t i = 0; i < ins.size(); ++i) {
                       const size_t bytes = ins[i].nbytes();
                       std::vector<char*> chunks;
                       for (int r = 0; r < c.size(); ++r) chunks.push_back(ptr(outs[i]) + r * bytes);
                       if (bytes > 0) std::memmove(chunks[c.rank()], ptr(ins[i]), bytes);
                       pycomm::allgather(c, chunks, std::vector<size_t>(c.size(), bytes));
                     }
                   },
                   opts.timeout, launch,
                   signature(op, inputs.empty() ? nullptr : &inputs[0], totalNumel(inputs)));
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
    return enqueue("gather", OpType::GATHER, outs,
                   [input, outs, root](Comm& c) {
                     std::vector<char*> chunks;
                     for (const auto& o : outs) chunks.push_back(ptr(o));
                     pycomm::gather(c, input.data_ptr(), input.nbytes(), chunks, root);
                   },
                   opts.timeout, launch,
                   signature("gather", &input, -1, -1, root));
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
    return enqueue("scatter", OpType::SCATTER, outputs,
                   [output, ins, root](Comm& c) {
                     std::vector<const char*> chunks;
                     for (const auto& i : ins) chunks.push_back(ptr(i));
                     pycomm::scatter(c, chunks, output.data_ptr(), output.nbytes(), root);
                   },
                   opts.timeout, launch,
                   signature("scatter", &output, -1, -1, root));
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
    return enqueue("reduce_scatter", OpType::REDUCE_SCATTER, outputs,
                   [ins, output, dtype, op, premul](Comm& c) {
                     reduceScatterInto(c, ins, output, dtype, op, premul);
                   },
                   opts.timeout, launch,
                   // the inputs' total: the same on every rank when the shares agree
                   signature("reduce_scatter", &output, totalNumel(ins), static_cast<int>(op)));
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
    return enqueue(name, OpType::_REDUCE_SCATTER_BASE, {output},
                   [in, out, dtype, op, premul](Comm& c) {
                     reduceScatterInto(c, equalParts(in, c.size(), out.numel()), out, dtype, op, premul);
                   },
                   opts.timeout, launch,
                   signature(name, &out, -1, static_cast<int>(op)));
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
    return enqueue(name, OpType::COALESCED, outs,
                   [ins, outs, kinds, premul](Comm& c) {
                     for (size_t i = 0; i < ins.size(); ++i)
                       reduceScatterInto(c, equalParts(ins[i], c.size(), outs[i].numel()), outs[i],
                                         kinds[i].first, kinds[i].second, premul);
                   },
                   opts.timeout, launch,
                   signature(name, outputs.empty() ? nullptr : &outputs[0], totalNumel(outputs)));
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
    return enqueue("alltoall", OpType::ALLTOALL_BASE, {output},
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
                   },
                   opts.timeout, launch,
                   signature("alltoall", &input, -2));
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
    return enqueue(name, OpType::ALLTOALL, outs,
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
                   },
                   opts.timeout, launch,
                   signature(name, &inputs[0], -2));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  // No tensors: nothing for a device seam to stage, and a blocking barrier may
  // return no Work, as the CPU calls of runOnDevice do.
  return enqueue("barrier", OpType::BARRIER, {}, [](Comm& c) { pycomm::barrier(c); },
                 opts.timeout, Launch{opts.asyncOp, {}, /*workOptional=*/true, /*afterBody=*/{}},
                 signature("barrier"));
}

void ProcessGroupPycomm::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // Blocking, as gloo's: rank 0 names the ranks that did not arrive within
  // opts.timeout (barrier_monitored.cc). torch's dist.monitored_barrier refuses every
  // backend but gloo before it gets here; pycomm.monitored_barrier calls it directly.
  auto work = enqueue(kMonitoredBarrier, OpType::BARRIER, {},
                      [waitAllRanks](Comm& c) { pycomm::barrierMonitored(c, waitAllRanks); }, opts.timeout,
                      Launch{/*asyncOp=*/false, {}, /*workOptional=*/true, /*afterBody=*/{}},
                      signature(kMonitoredBarrier));
  if (work) work->wait();
}

// ------------------------------------------------------------ point to point

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::pointToPoint(const char* op, OpType type,
                                                                Tensors& tensors, int peer, int tag,
                                                                bool isSend) {
  // Straight to the transport (Dispatch::kDirect); point-to-point is always asynchronous.
  return runOnDevice(op, getRank(), Dispatch::kDirect, /*asyncOp=*/true,
                     declare(Declared<Tensors>{isSend ? Role::kIn : Role::kOut, tensors}),
                     [&](const Launch&, Tensors& tensors) {
    const at::Tensor& t = singleOfAnyDtype(op, tensors);
    if (peer != kAnySource) {
      checkRank(op, peer, getSize(), isSend ? "destination rank" : "source rank");
      if (peer == getRank()) usageError(where(op) + "a rank cannot " + op + " to itself");
    }
    if (tag < 0) usageError(where(op) + "tags must be non-negative");
    auto work = c10::make_intrusive<PointToPointWork>(getRank(), type, op, tensors, group_,
                                                      config_.timeout, peer);
    const std::string earlier = group_->failure();
    if (!earlier.empty()) {
      work->markDone(makeBackendError(where(op) + "the process group is unusable after an earlier failure (" +
                                      earlier + ")"));
      return work;
    }
    Transport& transport = group_->transport();
    RequestPtr request = isSend ? transport.isend(peer, static_cast<uint64_t>(tag), t.data_ptr(), t.nbytes())
                                : transport.irecv(peer, static_cast<uint64_t>(tag), t.data_ptr(), t.nbytes(), /*upTo=*/true);
    work->attach(request, completions_.poster());
    return work;
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::send(Tensors& tensors, int dstRank, int tag) {
  return pointToPoint("send", OpType::SEND, tensors, dstRank, tag, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recv(Tensors& tensors, int srcRank, int tag) {
  return pointToPoint("recv", OpType::RECV, tensors, srcRank, tag, false);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recvAnysource(Tensors& tensors, int tag) {
  return pointToPoint("recv", OpType::RECVANYSOURCE, tensors, kAnySource, tag, false);
}

}  // namespace pycomm
