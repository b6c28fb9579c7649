// CUDA tensors staged through pinned host memory; the design is in cuda_staging.h.
// Compiled only into the CUDA build (status: docs/architecture.md, "CUDA").
#include "backend/cuda_staging.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <optional>
#include <unordered_map>

#include "kernels/cuda/cuda_check.cuh"

namespace pycomm {
namespace {

using Tensors = std::vector<at::Tensor>;

[[noreturn]] void usage(const std::string& message) { C10_THROW_ERROR(ValueError, message); }

// A CUDA event (no timing) on one device; every call checked.
class Event {
 public:
  Event(const char* op, at::Device device) : op_(op), device_(device) {
    const c10::cuda::CUDAGuard guard(device_);
    PYCOMM_CUDA_CHECK(op_, cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~Event() {
    // A destructor must not throw; a failure here means the context is already gone.
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(cudaStream_t stream) { PYCOMM_CUDA_CHECK(op_, cudaEventRecord(event_, stream)); }
  // Blocks this host thread until the recorded work is done (not the whole device).
  void hostWait() {
    const c10::cuda::CUDAGuard guard(device_);
    PYCOMM_CUDA_CHECK(op_, cudaEventSynchronize(event_));
  }
  // Makes `stream` wait on the device for the recorded work.
  void streamWait(cudaStream_t stream) {
    PYCOMM_CUDA_CHECK(op_, cudaStreamWaitEvent(stream, event_, 0));
  }

 private:
  const char* op_;
  at::Device device_;
  cudaEvent_t event_ = nullptr;
};

// The copy-in event of the call being staged on this thread (see stagedBody).
thread_local std::shared_ptr<Event> tlsCopiedIn;

struct StagingScope {
  explicit StagingScope(std::shared_ptr<Event> event) { tlsCopiedIn = std::move(event); }
  ~StagingScope() { tlsCopiedIn.reset(); }
};

// What a staged call's completion needs: the device outputs, their host twins,
// the caller-stream event, and the CUDA Future handed to torch.
struct StagedState {
  at::Device device;
  std::shared_ptr<Event> copiedIn;
  Tensors deviceOutputs;
  Tensors hostOutputs;
  c10::intrusive_ptr<c10::ivalue::Future> future;
};

// On the thread that completed the CPU collective: the host twins go back to the
// device on a side stream ordered after the caller's stream at the call, and the
// Future completes there (so its events mark the end of those copies).
void copyBack(StagedState& s) {
  at::NoGradGuard noGrad;
  const c10::cuda::CUDAGuard guard(s.device);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, s.device.index());
  s.copiedIn->streamWait(side.stream());
  const c10::cuda::CUDAStreamGuard streamGuard(side);
  for (size_t i = 0; i < s.deviceOutputs.size(); ++i) {
    s.deviceOutputs[i].copy_(s.hostOutputs[i], /*non_blocking=*/true);
    // The caching allocator must not reuse the output before the side stream wrote it.
    c10::cuda::CUDACachingAllocator::recordStream(s.deviceOutputs[i].storage().data_ptr(), side);
  }
  s.future->markCompleted(c10::IValue(s.deviceOutputs));
}

// The Work torch sees for a staged call.
class StagedWork : public c10d::Work {
 public:
  StagedWork(int rank, const char* op, c10::intrusive_ptr<c10d::Work> hostWork,
             std::shared_ptr<StagedState> state)
      : c10d::Work(rank, hostWork->retrieveOpType(), op),
        hostWork_(std::move(hostWork)),
        state_(std::move(state)) {}

  bool isCompleted() override { return state_->future->completed(); }
  bool isSuccess() const override {
    return state_->future->completed() && !state_->future->hasError();
  }
  std::exception_ptr exception() const override {
    return state_->future->completed() ? state_->future->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return state_->deviceOutputs; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return state_->future; }

  // Host: until the CPU collective is done (its timeout and failures apply) and the
  // copies back are enqueued. Device: the current stream waits for those copies.
  bool wait(std::chrono::milliseconds timeout) override {
    hostWork_->wait(timeout);
    state_->future->wait();
    if (state_->future->hasError()) std::rethrow_exception(state_->future->exception_ptr());
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> hostWork_;
  std::shared_ptr<StagedState> state_;
};

// The tensors of one call: all on the CPU (not staged), or all on one CUDA device.
class Probe {
 public:
  explicit Probe(const char* op) : op_(op) {}
  Probe& add(const at::Tensor& t) {
    if (!t.defined()) return *this;  // the CPU path reports it
    if (t.is_cuda()) {
      if (t.layout() != at::kStrided)
        usage(std::string("pycomm ") + op_ + ": sparse tensors are not supported (call .to_dense() first)");
      if (!t.is_contiguous())
        usage(std::string("pycomm ") + op_ + ": tensors must be contiguous (call .contiguous() first)");
      if (device_ && *device_ != t.device())
        usage(std::string("pycomm ") + op_ + ": all tensors of one call must be on one device (got " +
              device_->str() + " and " + t.device().str() + ")");
      device_ = t.device();
    } else {
      sawOther_ = t.device().str();
    }
    return *this;
  }
  Probe& add(const Tensors& ts) {
    for (const auto& t : ts) add(t);
    return *this;
  }
  Probe& add(const std::vector<Tensors>& lists) {
    for (const auto& ts : lists) add(ts);
    return *this;
  }
  // The CUDA device of the call, or nullopt when no tensor is on CUDA.
  std::optional<at::Device> device() const {
    if (device_ && !sawOther_.empty())
      usage(std::string("pycomm ") + op_ + ": all tensors of one call must be on one device (got " +
            device_->str() + " and " + sawOther_ + ")");
    return device_;
  }

 private:
  const char* op_;
  std::optional<at::Device> device_;
  std::string sawOther_;
};

// Host twins of one staged call.
class Stage {
 public:
  Stage(const char* op, at::Device device)
      : op_(op),
        device_(device),
        guard_(device),
        stream_(c10::cuda::getCurrentCUDAStream(device.index())),
        copiedIn_(std::make_shared<Event>(op, device)) {}

  at::Tensor in(const at::Tensor& t) { return twin(t, true, false); }
  at::Tensor out(const at::Tensor& t) { return twin(t, false, true); }
  at::Tensor inout(const at::Tensor& t) { return twin(t, true, true); }
  Tensors in(const Tensors& ts) { return map(ts, &Stage::in); }
  Tensors out(const Tensors& ts) { return map(ts, &Stage::out); }
  Tensors inout(const Tensors& ts) { return map(ts, &Stage::inout); }
  std::vector<Tensors> in(const std::vector<Tensors>& lists) {
    std::vector<Tensors> result;
    for (const auto& ts : lists) result.push_back(in(ts));
    return result;
  }
  std::vector<Tensors> out(const std::vector<Tensors>& lists) {
    std::vector<Tensors> result;
    for (const auto& ts : lists) result.push_back(out(ts));
    return result;
  }

  // Records the copy-in event on the caller's stream, then runs `call` (the CPU
  // collective on the twins): its worker body waits on that event first. With
  // `hostWaitFirst` (send) this thread waits instead, as nothing is queued.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> run(int rank, F&& call, bool hostWaitFirst = false) {
    copiedIn_->record(stream_.stream());
    if (hostWaitFirst) copiedIn_->hostWait();
    c10::intrusive_ptr<c10d::Work> hostWork;
    {
      StagingScope scope(copiedIn_);
      hostWork = call();
    }
    auto state = std::make_shared<StagedState>(StagedState{
        device_, copiedIn_, std::move(deviceOutputs_), std::move(hostOutputs_),
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                 std::vector<c10::Device>{device_})});
    hostWork->getFuture()->addCallback([state](c10::ivalue::Future& done) {
      if (done.hasError()) {
        state->future->setError(done.exception_ptr());
        return;
      }
      try {
        copyBack(*state);
      } catch (...) {
        if (!state->future->completed()) state->future->setError(std::current_exception());
      }
    });
    return c10::make_intrusive<StagedWork>(rank, op_, std::move(hostWork), std::move(state));
  }

 private:
  struct Twin {
    at::Tensor host;
    bool copiedIn = false;
    bool copiedOut = false;
  };

  Tensors map(const Tensors& ts, at::Tensor (Stage::*f)(const at::Tensor&)) {
    Tensors result;
    for (const auto& t : ts) result.push_back((this->*f)(t));
    return result;
  }

  // One pinned twin per device tensor (an input that is also an output shares it).
  at::Tensor twin(const at::Tensor& t, bool copyIn, bool copyOut) {
    if (!t.defined()) return t;
    at::NoGradGuard noGrad;
    Twin& entry = twins_[t.unsafeGetTensorImpl()];
    if (!entry.host.defined())
      entry.host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    if (copyIn && !entry.copiedIn) {
      entry.host.copy_(t, /*non_blocking=*/true);  // on the caller's current stream
      entry.copiedIn = true;
    }
    if (copyOut && !entry.copiedOut) {
      deviceOutputs_.push_back(t);
      hostOutputs_.push_back(entry.host);
      entry.copiedOut = true;
    }
    return entry.host;
  }

  const char* op_;
  at::Device device_;
  c10::cuda::CUDAGuard guard_;
  c10::cuda::CUDAStream stream_;
  std::shared_ptr<Event> copiedIn_;
  std::unordered_map<const c10::TensorImpl*, Twin> twins_;
  Tensors deviceOutputs_;
  Tensors hostOutputs_;
};

template <typename Options>
Options queued(const Options& opts) {
  Options o = opts;
  o.asyncOp = true;  // the worker waits on the copy-in event, never the caller
  return o;
}

}  // namespace

std::function<void(Comm&)> stagedBody(std::function<void(Comm&)> body) {
  if (!tlsCopiedIn) return body;
  std::shared_ptr<Event> event = std::move(tlsCopiedIn);
  tlsCopiedIn.reset();
  return [event, body = std::move(body)](Comm& comm) {
    event->hostWait();
    body(comm);
  };
}

using Work = c10::intrusive_ptr<c10d::Work>;
using Base = ProcessGroupPycomm;

Work ProcessGroupPycommCuda::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  const auto device = Probe("broadcast").add(tensors).device();
  if (!device) return Base::broadcast(tensors, opts);
  Stage stage("broadcast", *device);
  Tensors host = stage.inout(tensors);
  return stage.run(getRank(), [&] { return Base::broadcast(host, queued(opts)); });
}

Work ProcessGroupPycommCuda::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  const auto device = Probe("allreduce").add(tensors).device();
  if (!device) return Base::allreduce(tensors, opts);
  Stage stage("allreduce", *device);
  Tensors host = stage.inout(tensors);
  return stage.run(getRank(), [&] { return Base::allreduce(host, queued(opts)); });
}

Work ProcessGroupPycommCuda::allreduce_coalesced(Tensors& tensors,
                                                 const c10d::AllreduceCoalescedOptions& opts) {
  const auto device = Probe("allreduce_coalesced").add(tensors).device();
  if (!device) return Base::allreduce_coalesced(tensors, opts);
  Stage stage("allreduce_coalesced", *device);
  Tensors host = stage.inout(tensors);
  return stage.run(getRank(), [&] { return Base::allreduce_coalesced(host, queued(opts)); });
}

Work ProcessGroupPycommCuda::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  const auto device = Probe("reduce").add(tensors).device();
  if (!device) return Base::reduce(tensors, opts);
  Stage stage("reduce", *device);
  Tensors host = stage.inout(tensors);
  return stage.run(getRank(), [&] { return Base::reduce(host, queued(opts)); });
}

Work ProcessGroupPycommCuda::allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                       const c10d::AllgatherOptions& opts) {
  const auto device = Probe("allgather").add(outputs).add(inputs).device();
  if (!device) return Base::allgather(outputs, inputs, opts);
  Stage stage("allgather", *device);
  Tensors in = stage.in(inputs);
  std::vector<Tensors> out = stage.out(outputs);
  return stage.run(getRank(), [&] { return Base::allgather(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::_allgather_base(at::Tensor& output, at::Tensor& input,
                                             const c10d::AllgatherOptions& opts) {
  const auto device = Probe("allgather_into_tensor").add(output).add(input).device();
  if (!device) return Base::_allgather_base(output, input, opts);
  Stage stage("allgather_into_tensor", *device);
  at::Tensor in = stage.in(input);
  at::Tensor out = stage.out(output);
  return stage.run(getRank(), [&] { return Base::_allgather_base(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::allgather_coalesced(std::vector<Tensors>& outputLists,
                                                 Tensors& inputs,
                                                 const c10d::AllgatherOptions& opts) {
  const auto device = Probe("allgather_coalesced").add(outputLists).add(inputs).device();
  if (!device) return Base::allgather_coalesced(outputLists, inputs, opts);
  Stage stage("allgather_coalesced", *device);
  Tensors in = stage.in(inputs);
  std::vector<Tensors> out = stage.out(outputLists);
  return stage.run(getRank(), [&] { return Base::allgather_coalesced(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_into_tensor_coalesced";
  const auto device = Probe(op).add(outputs).add(inputs).device();
  if (!device) return Base::allgather_into_tensor_coalesced(outputs, inputs, opts);
  Stage stage(op, *device);
  Tensors in = stage.in(inputs);
  Tensors out = stage.out(outputs);
  return stage.run(getRank(),
                   [&] { return Base::allgather_into_tensor_coalesced(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::gather(std::vector<Tensors>& outputs, Tensors& inputs,
                                    const c10d::GatherOptions& opts) {
  const auto device = Probe("gather").add(outputs).add(inputs).device();
  if (!device) return Base::gather(outputs, inputs, opts);
  Stage stage("gather", *device);
  Tensors in = stage.in(inputs);
  std::vector<Tensors> out = stage.out(outputs);
  return stage.run(getRank(), [&] { return Base::gather(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                     const c10d::ScatterOptions& opts) {
  const auto device = Probe("scatter").add(outputs).add(inputs).device();
  if (!device) return Base::scatter(outputs, inputs, opts);
  Stage stage("scatter", *device);
  std::vector<Tensors> in = stage.in(inputs);
  Tensors out = stage.out(outputs);
  return stage.run(getRank(), [&] { return Base::scatter(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                            const c10d::ReduceScatterOptions& opts) {
  const auto device = Probe("reduce_scatter").add(outputs).add(inputs).device();
  if (!device) return Base::reduce_scatter(outputs, inputs, opts);
  Stage stage("reduce_scatter", *device);
  std::vector<Tensors> in = stage.in(inputs);
  Tensors out = stage.out(outputs);
  return stage.run(getRank(), [&] { return Base::reduce_scatter(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                  const c10d::ReduceScatterOptions& opts) {
  const auto device = Probe("reduce_scatter_tensor").add(output).add(input).device();
  if (!device) return Base::_reduce_scatter_base(output, input, opts);
  Stage stage("reduce_scatter_tensor", *device);
  at::Tensor in = stage.in(input);
  at::Tensor out = stage.out(output);
  return stage.run(getRank(), [&] { return Base::_reduce_scatter_base(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::reduce_scatter_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  const auto device = Probe(op).add(outputs).add(inputs).device();
  if (!device) return Base::reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  Stage stage(op, *device);
  Tensors in = stage.in(inputs);
  Tensors out = stage.out(outputs);
  return stage.run(getRank(),
                   [&] { return Base::reduce_scatter_tensor_coalesced(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::alltoall_base(at::Tensor& output, at::Tensor& input,
                                           std::vector<int64_t>& outputSplits,
                                           std::vector<int64_t>& inputSplits,
                                           const c10d::AllToAllOptions& opts) {
  const auto device = Probe("alltoall").add(output).add(input).device();
  if (!device) return Base::alltoall_base(output, input, outputSplits, inputSplits, opts);
  Stage stage("alltoall", *device);
  at::Tensor in = stage.in(input);
  at::Tensor out = stage.out(output);
  return stage.run(getRank(), [&] {
    return Base::alltoall_base(out, in, outputSplits, inputSplits, queued(opts));
  });
}

Work ProcessGroupPycommCuda::alltoall(Tensors& outputs, Tensors& inputs,
                                      const c10d::AllToAllOptions& opts) {
  const auto device = Probe("alltoall").add(outputs).add(inputs).device();
  if (!device) return Base::alltoall(outputs, inputs, opts);
  Stage stage("alltoall", *device);
  Tensors in = stage.in(inputs);
  Tensors out = stage.out(outputs);
  return stage.run(getRank(), [&] { return Base::alltoall(out, in, queued(opts)); });
}

Work ProcessGroupPycommCuda::send(Tensors& tensors, int dstRank, int tag) {
  const auto device = Probe("send").add(tensors).device();
  if (!device) return Base::send(tensors, dstRank, tag);
  Stage stage("send", *device);
  Tensors in = stage.in(tensors);
  // Point-to-point goes straight to the transport: the data must be on the host now.
  return stage.run(getRank(), [&] { return Base::send(in, dstRank, tag); }, /*hostWaitFirst=*/true);
}

Work ProcessGroupPycommCuda::recv(Tensors& tensors, int srcRank, int tag) {
  const auto device = Probe("recv").add(tensors).device();
  if (!device) return Base::recv(tensors, srcRank, tag);
  Stage stage("recv", *device);
  Tensors out = stage.out(tensors);
  return stage.run(getRank(), [&] { return Base::recv(out, srcRank, tag); });
}

Work ProcessGroupPycommCuda::recvAnysource(Tensors& tensors, int tag) {
  const auto device = Probe("recv").add(tensors).device();
  if (!device) return Base::recvAnysource(tensors, tag);
  Stage stage("recv", *device);
  Tensors out = stage.out(tensors);
  return stage.run(getRank(), [&] { return Base::recvAnysource(out, tag); });
}

}  // namespace pycomm
