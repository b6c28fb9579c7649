// The strided CPU seam (device_seam.h): a call on CPU tensors of which some are
// strided but not contiguous (a transpose, a column slice, channels_last), as gloo
// takes them. The collectives move flat buffers, so
//  1. each such tensor gets a contiguous twin (an output too: a receive may fill
//     only part of its tensor, and the rest must come back as it was); a tensor
//     declared twice shares one twin. A contiguous output that shares storage with
//     a twinned one gets a twin as well, so that the copies back land in declaration
//     order (a later output wins where outputs overlap, as the collective itself
//     writes them). An output whose elements share memory (expand()) cannot be
//     written back and is refused;
//  2. a queued call (a collective) copies its tensors into the twins right before
//     its body runs and copies the outputs back right after it succeeds, on the thread
//     that runs it (the worker, or the caller for a blocking call run inline): in
//     queue order, as the contiguous tensors of queued calls are read and written, so
//     an async call on x.T behind another on x reads that one's result, and anything
//     queued after it (a barrier) finds the caller's tensors written. A point-to-point
//     call, never queued, copies in on the caller's thread at the call and back when
//     its receive completes;
//  3. the CPU collective runs on the twins and the contiguous tensors as they are,
//     with the caller's asyncOp. The StagedWork torch holds completes after the copies
//     back (its wait() and its Future). A blocking call that ran to completion on the
//     caller's thread returns no Work, as a CPU call does.
// The copies go below autograd and the inference-mode checks (the contiguous path
// writes through raw pointers the same way): an inference tensor (made under
// torch.inference_mode()) is written back from the worker, which is not in that mode.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>

#include <unordered_map>
#include <unordered_set>

#include "backend/device_seam.h"
#include "backend/tensor_checks.h"

namespace pycomm {
namespace {

using Tensors = std::vector<at::Tensor>;

// dst.copy_(src) as a raw write: no autograd record, no version-counter or
// inference-mode checks.
void rawCopy(at::Tensor& dst, const at::Tensor& src) {
  at::NoGradGuard noGrad;
  at::AutoDispatchBelowADInplaceOrView belowAutograd;
  dst.copy_(src);
}

// The caller's tensors and their twins, kept alive until the call completes.
struct StridedState {
  Tensors sources;     // the caller's tensors that have a twin, in declaration order
  Tensors sourceTwins;
  Tensors outputs;     // those written back, in declaration order
  Tensors outputTwins;
  Tensors result;      // the Work's result(): the caller's tensors the collective wrote
  c10::intrusive_ptr<c10::ivalue::Future> future;

  void copyIn() {
    for (size_t i = 0; i < sources.size(); ++i) rawCopy(sourceTwins[i], sources[i]);
  }
  void copyBack() {
    for (size_t i = 0; i < outputs.size(); ++i) rawCopy(outputs[i], outputTwins[i]);
  }
};

const c10::StorageImpl* storageOf(const at::Tensor& t) {
  return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

bool needsTwin(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_contiguous();
}

class StridedCall : public StagedCall {
 public:
  StridedCall(const char* op, int rank, Dispatch dispatch)
      : op_(op), rank_(rank), dispatch_(dispatch), state_(std::make_shared<StridedState>()) {}

  void stage(const std::vector<DeclaredTensor>& tensors) {
    // Storages written through a twin: a contiguous output on one of them is twinned too.
    std::unordered_set<const c10::StorageImpl*> twinnedOut;
    for (const DeclaredTensor& d : tensors)
      if (d.role != Role::kIn && needsTwin(*d.tensor) && storageOf(*d.tensor) != nullptr)
        twinnedOut.insert(storageOf(*d.tensor));
    host.reserve(tensors.size());
    for (const DeclaredTensor& d : tensors) {
      const at::Tensor& t = *d.tensor;
      const bool written = d.role != Role::kIn;
      if (written && t.defined()) state_->result.push_back(t);
      const bool twinned = needsTwin(t) || (written && t.defined() && t.layout() == at::kStrided &&
                                            twinnedOut.count(storageOf(t)) != 0);
      host.push_back(twinned ? twin(t, written) : t);  // as it is: the body's checks judge it
    }
    // A point-to-point call is not queued: its data is taken now.
    if (dispatch_ == Dispatch::kDirect) state_->copyIn();
  }

  Launch launch(bool asyncOp) override {
    if (dispatch_ == Dispatch::kDirect) return Launch{asyncOp, {}, /*workOptional=*/true, /*afterBody=*/{}};
    auto state = state_;
    return Launch{asyncOp, [state] { state->copyIn(); }, /*workOptional=*/true, [state] { state->copyBack(); }};
  }

  c10::intrusive_ptr<c10d::Work> finish(c10::intrusive_ptr<c10d::Work> hostWork) override {
    if (!hostWork) return hostWork;  // a blocking call that completed (and copied back) on this thread
    state_->future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    const bool copyBackHere = dispatch_ == Dispatch::kDirect;  // a queued call's body copied back already
    hostWork->getFuture()->addCallback([state = state_, copyBackHere](c10::ivalue::Future& done) {
      if (done.hasError()) {
        state->future->setError(done.exception_ptr());
        return;
      }
      try {
        if (copyBackHere) state->copyBack();
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
      entry = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
      state_->sources.push_back(t);
      state_->sourceTwins.push_back(entry);
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
  Dispatch dispatch_;
  std::shared_ptr<StridedState> state_;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> twins_;
  std::unordered_set<const c10::TensorImpl*> outputsStaged_;
};

class StridedCpuSeam : public DeviceSeam {
 public:
  std::unique_ptr<StagedCall> stage(const char* op, int rank, at::Device, Dispatch dispatch,
                                    const std::vector<DeclaredTensor>& tensors) override {
    auto call = std::make_unique<StridedCall>(op, rank, dispatch);
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
