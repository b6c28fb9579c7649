// The strided CPU seam (device_seam.h): a call on CPU tensors of which some are
// strided but not contiguous (a transpose, a column slice, channels_last), as gloo
// takes them. The collectives move flat buffers, so
//  1. each such tensor gets a contiguous twin, a copy of it made on the caller's
//     thread when the call is made (an output too: a receive may fill only part
//     of its tensor, and the rest must come back as it was); a tensor declared
//     twice shares one twin. An output whose elements share memory (expand())
//     cannot be written back and is refused;
//  2. the CPU collective runs on the twins and the contiguous tensors as they are,
//     with the caller's asyncOp;
//  3. when it completes, the output twins are copied back into the caller's
//     tensors, before the StagedWork torch holds reports completion (its wait()
//     and its Future). A blocking call that ran to completion on the caller's thread
//     copies back there and returns no Work, as a CPU call does.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>

#include <unordered_map>
#include <unordered_set>

#include "backend/device_seam.h"
#include "backend/tensor_checks.h"

namespace pycomm {
namespace {

using Tensors = std::vector<at::Tensor>;

// The caller's output tensors, their twins, and every twin kept alive until the
// call completes.
struct StridedState {
  Tensors outputs;
  Tensors outputTwins;
  Tensors twins;
  Tensors result;  // the Work's result(): the caller's tensors the collective wrote
  c10::intrusive_ptr<c10::ivalue::Future> future;

  void copyBack() {
    at::NoGradGuard noGrad;
    for (size_t i = 0; i < outputs.size(); ++i) outputs[i].copy_(outputTwins[i]);
  }
};

class StridedCall : public StagedCall {
 public:
  StridedCall(const char* op, int rank) : op_(op), rank_(rank), state_(std::make_shared<StridedState>()) {}

  void stage(const std::vector<DeclaredTensor>& tensors) {
    at::NoGradGuard noGrad;
    host.reserve(tensors.size());
    for (const DeclaredTensor& d : tensors) {
      const at::Tensor& t = *d.tensor;
      if (d.role != Role::kIn && t.defined()) state_->result.push_back(t);
      if (!t.defined() || t.layout() != at::kStrided || t.is_contiguous()) {
        host.push_back(t);  // as it is; the body's checks judge it
        continue;
      }
      host.push_back(twin(t, d.role != Role::kIn));
    }
  }

  // The caller's asyncOp; a blocking call may go without a Work (finish copies back).
  Launch launch(bool asyncOp) override { return Launch{asyncOp, {}, /*workOptional=*/true}; }

  c10::intrusive_ptr<c10d::Work> finish(c10::intrusive_ptr<c10d::Work> hostWork) override {
    if (!hostWork) {  // a blocking call that completed on this thread
      state_->copyBack();
      return hostWork;
    }
    state_->future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    hostWork->getFuture()->addCallback([state = state_](c10::ivalue::Future& done) {
      if (done.hasError()) {
        state->future->setError(done.exception_ptr());
        return;
      }
      try {
        state->copyBack();
        state->future->markCompleted(c10::IValue(state->result));
      } catch (...) {
        if (!state->future->completed()) state->future->setError(std::current_exception());
      }
    });
    return c10::make_intrusive<StagedWork>(rank_, op_, std::move(hostWork), state_->future, state_->result,
                                           state_);
  }

 private:
  at::Tensor twin(const at::Tensor& t, bool copyOut) {
    at::Tensor& entry = twins_[t.unsafeGetTensorImpl()];
    if (!entry.defined()) {
      entry = t.contiguous();
      state_->twins.push_back(entry);
    }
    if (copyOut && outputsStaged_.insert(t.unsafeGetTensorImpl()).second) {
      if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
        usageError(where(op_) + "an output tensor has elements that share memory (from expand()?), so "
                   "the result cannot be written into it; pass a tensor that owns each element");
      state_->outputs.push_back(t);
      state_->outputTwins.push_back(entry);
    }
    return entry;
  }

  const char* op_;
  int rank_;
  std::shared_ptr<StridedState> state_;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> twins_;
  std::unordered_set<const c10::TensorImpl*> outputsStaged_;
};

class StridedCpuSeam : public DeviceSeam {
 public:
  std::unique_ptr<StagedCall> stage(const char* op, int rank, at::Device, Dispatch,
                                    const std::vector<DeclaredTensor>& tensors) override {
    auto call = std::make_unique<StridedCall>(op, rank);
    call->stage(tensors);
    return call;
  }
};

}  // namespace

DeviceSeam& stridedCpuSeam() {
  static StridedCpuSeam seam;
  return seam;
}

}  // namespace pycomm
