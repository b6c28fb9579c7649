// ProcessGroupPycomm's lifecycle (bootstrap, start, shutdown, abort), its algorithm
// setting, the barriers and point-to-point. The tensor collectives' entry points are
// in process_group_collectives.cc (and _compressed.cc, _sparse.cc), the work queue
// they go through in work_queue.cc, the call check in call_check.cc.
#include "backend/process_group.h"

#include <Python.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "backend/call_check.h"
#include "backend/store_adapter.h"
#include "backend/tensor_checks.h"
#include "common/logging.h"
#include "transport/bootstrap.h"

namespace pycomm {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;

ProcessGroupPycomm::ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, GroupConfig config)
    : c10d::Backend(rank, size), config_(std::move(config)), store_(store) {
  setDebugEnabled(config_.debug);
  GroupTransport bootstrapped;
  const AllreduceAlgorithm* setting = nullptr;
  try {
    setting = findAllreduceAlgorithm(config_.algorithm);  // a bad PYCOMM_ALGO fails before connecting
    StoreAdapter adapter(store);
    bootstrapped = bootstrapGroup(adapter, rank, size, config_);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUsage) usageError(e.what());
    C10_THROW_ERROR(DistNetworkError, e.what());
  }
  hostLeaders_ = std::move(bootstrapped.hostLeaders);
  group_ = std::make_shared<GroupState>(std::move(bootstrapped.transport));
  group_->setArena(std::move(bootstrapped.arena));
  start(setting);
}

ProcessGroupPycomm::ProcessGroupPycomm(std::shared_ptr<Transport> transport, GroupConfig config)
    : c10d::Backend(transport->rank(), transport->size()), config_(std::move(config)) {
  setDebugEnabled(config_.debug);
  transport->setGlobalRanks(config_.globalRanks);
  group_ = std::make_shared<GroupState>(std::move(transport));
  const AllreduceAlgorithm* setting = nullptr;
  try {
    setting = findAllreduceAlgorithm(config_.algorithm);
  } catch (const Error& e) {
    usageError(strCat(e.what(), " (PYCOMM_ALGO=", config_.algorithm, ")"));
  }
  start(setting);
}

void ProcessGroupPycomm::start(const AllreduceAlgorithm* setting) {
  comm_ = std::make_unique<Comm>(group_->transport(), config_.timeout, config_.segmentBytes);
  comm_->setArena(group_->arena());
  comm_->setCostModel(config_.cost);
  comm_->setHostLeaders(hostLeaders_);
  try {
    applySetting(setting);
  } catch (const Error& e) {
    usageError(strCat(e.what(), " (PYCOMM_ALGO=", config_.algorithm, ")"));
  }
  worker_ = std::thread([this] { workerLoop(); });
}

ProcessGroupPycomm::~ProcessGroupPycomm() { shutdown(); }

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
  group_->fail(errorPrefix("") + ": " + reason, reason);
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

void ProcessGroupPycomm::applySetting(const AllreduceAlgorithm* setting) {
  if (setting != nullptr) checkFits(*setting, comm_->topology());
  algorithm_ = setting;
}

void ProcessGroupPycomm::setAlgorithm(const std::string& name) {
  try {
    applySetting(findAllreduceAlgorithm(name));
  } catch (const Error& e) {
    usageError(e.what());
  }
}

std::string ProcessGroupPycomm::algorithm() const { return settingName(algorithm_.load()); }

std::string ProcessGroupPycomm::selectAlgorithm(size_t bytes) const {
  return planAlgorithm(Collective::kAllreduce, bytes, comm_->topology(), algorithm_.load());
}

std::string ProcessGroupPycomm::expectedAlgorithm(const CallDescriptor& call) const {
  return planAlgorithm(call.collective, call.bytes, comm_->topology(), algorithm_.load());
}

std::string ProcessGroupPycomm::lastAlgorithm() const {
  const AllreduceAlgorithm* last = lastAlgorithm_.load();
  return last == nullptr ? "" : last->name;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  // No tensors: nothing for a device seam to stage, and a blocking barrier may
  // return no Work, as the CPU calls of runOnDevice do.
  return enqueue(describeCall("barrier", Collective::kBarrier, opts.timeout), OpType::BARRIER, {},
                 [](Comm& c) { pycomm::barrier(c); },
                 Launch{opts.asyncOp, {}, /*workOptional=*/true, /*afterBody=*/{}});
}

void ProcessGroupPycomm::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // Blocking, as gloo's: rank 0 names the ranks that did not arrive within
  // opts.timeout (barrier_monitored.cc). torch's dist.monitored_barrier refuses every
  // backend but gloo before it gets here; pycomm.monitored_barrier calls it directly.
  auto work = enqueue(describeCall(kMonitoredBarrier, Collective::kMonitoredBarrier, opts.timeout), OpType::BARRIER, {},
                      [waitAllRanks](Comm& c) { pycomm::barrierMonitored(c, waitAllRanks); },
                      Launch{/*asyncOp=*/false, {}, /*workOptional=*/true, /*afterBody=*/{}});
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
