// CUDA tensors staged through pinned host memory: the CUDA device seam; the design
// is in cuda_staging.h. Compiled only into the CUDA build (status:
// docs/architecture.md, "CUDA").
#include "backend/cuda_staging.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <unordered_map>

#include "kernels/cuda/cuda_check.cuh"

namespace pycomm {
namespace {

using Tensors = std::vector<at::Tensor>;

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

// One call on CUDA tensors: the pinned host twins, the copy-in event on the
// caller's stream, and the completion that copies the outputs back.
class CudaStagedCall : public StagedCall {
 public:
  CudaStagedCall(const char* op, int rank, at::Device device)
      : op_(op),
        rank_(rank),
        device_(device),
        guard_(device),
        stream_(c10::cuda::getCurrentCUDAStream(device.index())),
        copiedIn_(std::make_shared<Event>(op, device)) {}

  // The twins of `tensors` (in `host`), then the copy-in event recorded on the
  // caller's stream. With Dispatch::kDirect (send) this thread waits for the copies,
  // as nothing is queued to wait for them.
  void stage(Dispatch dispatch, const std::vector<DeclaredTensor>& tensors) {
    bool copied = false;
    host.reserve(tensors.size());
    for (const DeclaredTensor& d : tensors) {
      // A receive (the only direct call with an output) may fill only part of its
      // tensor, and the rest must come back as it was: its twin starts as a copy.
      const bool copyIn = d.role != Role::kOut || dispatch == Dispatch::kDirect;
      copied = copied || copyIn;
      host.push_back(twin(*d.tensor, copyIn, d.role != Role::kIn));
    }
    copiedIn_->record(stream_.stream());
    if (dispatch == Dispatch::kDirect && copied) copiedIn_->hostWait();
  }

  // Always queued: the worker waits on the copy-in event, never the caller.
  Launch launch(bool) override {
    return Launch{true, [event = copiedIn_] { event->hostWait(); }, /*workOptional=*/false, /*afterBody=*/{}};
  }

  c10::intrusive_ptr<c10d::Work> finish(c10::intrusive_ptr<c10d::Work> hostWork) override {
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
    // wait(): the host until the CPU collective is done and the copies back are
    // enqueued; the device's current stream waits for those copies (the Future's events).
    auto future = state->future;
    auto outputs = state->deviceOutputs;
    return c10::make_intrusive<StagedWork>(rank_, op_, std::move(hostWork), std::move(future),
                                           std::move(outputs), std::move(state));
  }

 private:
  struct Twin {
    at::Tensor host;
    bool copiedIn = false;
    bool copiedOut = false;
  };

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
  int rank_;
  at::Device device_;
  c10::cuda::CUDAGuard guard_;  // the call's device, while the entry point runs
  c10::cuda::CUDAStream stream_;
  std::shared_ptr<Event> copiedIn_;
  std::unordered_map<const c10::TensorImpl*, Twin> twins_;
  Tensors deviceOutputs_;
  Tensors hostOutputs_;
};

class CudaSeam : public DeviceSeam {
 public:
  std::unique_ptr<StagedCall> stage(const char* op, int rank, at::Device device, Dispatch dispatch,
                                    const std::vector<DeclaredTensor>& tensors) override {
    auto call = std::make_unique<CudaStagedCall>(op, rank, device);
    call->stage(dispatch, tensors);
    return call;
  }
};

// Registered while the extension loads, before torch can make a call.
[[maybe_unused]] const bool registered = (registerDeviceSeam(c10::DeviceType::CUDA, &cudaSeam()), true);

}  // namespace

DeviceSeam& cudaSeam() {
  static CudaSeam seam;
  return seam;
}

}  // namespace pycomm
