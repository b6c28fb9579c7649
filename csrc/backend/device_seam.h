// The device seam: how a call on tensors of one device runs through the CPU
// collectives (one seam per device type, in the spirit of ProcessGroupGloo's CUDA
// work classes and torch-ccl's per-device dispatch table).
//
// Each of ProcessGroupPycomm's c10d entry points declares its tensors once, by role
// (role::in / out / inout: single tensors, lists, lists of lists), and hands its
// body to runOnDevice. runOnDevice probes the tensors' device and
//  * on the CPU, or on a device type without a seam (the identity, the default),
//    runs the body on the tensors as they are, with the caller's asyncOp: no copy,
//    no allocation. The CPU checks in the body reject what is not on the CPU;
//  * on the CPU with a strided tensor that is not contiguous among them (as gloo
//    takes them), goes through the strided CPU seam (strided_staging.cc): those
//    tensors are staged into contiguous copies, the outputs copied back at the end
//    (for a queued call both on the thread that runs it, in queue order);
//  * on a device type with a seam (CUDA in the CUDA build: cuda_staging.h), asks
//    the seam to stage the call: the seam gives one host tensor per declared
//    tensor (which the body runs on), a Launch for enqueue (asyncOp forced where
//    the seam needs queued execution, and a step the worker runs before the body),
//    and wraps the CPU collective's Work into the one torch receives.
// A seam registers itself from its own file (registerDeviceSeam at load time), so a
// new device type touches that file, setup.py, and nothing in the entry points.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pycomm {

// What the collective does with a tensor: reads it, writes it, or both.
enum class Role : uint8_t { kIn, kOut, kInOut };

// How the CPU operation behind a call runs: through the worker queue (collectives),
// or straight to the transport on the caller's thread (point-to-point).
enum class Dispatch : uint8_t { kQueued, kDirect };

// How ProcessGroupPycomm::enqueue runs a call's body.
struct Launch {
  bool asyncOp = false;
  // Run right before the body, on the thread that runs it (the worker, or the caller
  // for a blocking call run inline), in queue order (empty: nothing). A seam's wait
  // for the data it staged, or its copies in; a failure there fails the call like the
  // body's own.
  std::function<void()> beforeBody;
  // The caller takes no Work from a blocking call that ran to completion on its own
  // thread: enqueue may return none (a failure is thrown instead). torch's frontend
  // (dist.all_reduce and the rest) calls wait() only on a Work it got. Set by
  // runOnDevice for CPU tensors only: a seam wraps the CPU operation's Work.
  bool workOptional = false;
  // Run right after the body succeeds, on the same thread, before the call's Work
  // reports completion and before the next queued call starts (empty: nothing). The
  // strided seam's copies back.
  std::function<void()> afterBody;
};

// One declared tensor of a staged call, in declaration order.
struct DeclaredTensor {
  Role role;
  const at::Tensor* tensor;
};

// One call staged by a seam; lives while the entry point runs.
class StagedCall {
 public:
  virtual ~StagedCall() = default;
  // The host tensor the CPU operation uses for each declared tensor, in order
  // (an undefined declared tensor stays undefined).
  std::vector<at::Tensor> host;
  // The launch of the CPU collective for a caller who asked for `asyncOp`.
  virtual Launch launch(bool asyncOp) = 0;
  // The Work torch receives, given the CPU operation's.
  virtual c10::intrusive_ptr<c10d::Work> finish(c10::intrusive_ptr<c10d::Work> hostWork) = 0;
};

// The Work torch receives for a staged call: complete when `future` is, which the
// seam completes once its copies back are done (or enqueued, on a device). wait()
// waits for the CPU operation (its timeout and failures apply), then the future.
// `keep` holds what the copies back need until the Work goes.
class StagedWork : public c10d::Work {
 public:
  StagedWork(int rank, const char* op, c10::intrusive_ptr<c10d::Work> hostWork,
             c10::intrusive_ptr<c10::ivalue::Future> future, std::vector<at::Tensor> result,
             std::shared_ptr<void> keep);
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // A receive's source (the host Work raises torch's error for everything else).
  int sourceRank() const override { return hostWork_->sourceRank(); }
  bool wait(std::chrono::milliseconds timeout) override;

 private:
  c10::intrusive_ptr<c10d::Work> hostWork_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> result_;
  std::shared_ptr<void> keep_;
};

// What a device type does with a call on its tensors.
class DeviceSeam {
 public:
  virtual ~DeviceSeam() = default;
  virtual std::unique_ptr<StagedCall> stage(const char* op, int rank, at::Device device,
                                            Dispatch dispatch,
                                            const std::vector<DeclaredTensor>& tensors) = 0;
};

// Registers `seam` (which must outlive the process) for `type`; called once per
// type while the extension loads, before any call.
void registerDeviceSeam(c10::DeviceType type, DeviceSeam* seam);
// The seam of `type`; nullptr for the CPU and every type without one (identity).
DeviceSeam* deviceSeam(c10::DeviceType type);
// "cpu" and every type with a seam (the devices the backend registers for).
std::vector<std::string> seamDevices();

// The CPU's seam for strided tensors that are not contiguous (a transpose, a
// column slice, channels_last; strided_staging.cc): the call runs on contiguous
// copies of those tensors, and the outputs among them are copied back when it
// completes. Contiguous tensors of the same call go as they are.
DeviceSeam& stridedCpuSeam();

// The device of one call's tensors. Tensors on a device with a seam must be
// strided, contiguous and on one device; any other tensor of the call may not
// sit beside them (usage errors name the op). Undefined tensors are left to the
// CPU checks. A call whose tensors are all on the CPU (or on devices without a
// seam) takes the strided CPU seam when one of them is strided but not contiguous.
class DeviceProbe {
 public:
  explicit DeviceProbe(const char* op) : op_(op) {}
  void add(const at::Tensor& t) {
    if (!t.defined()) return;
    if (t.device().is_cpu()) {
      other_ = t.device();
      // is_contiguous() is cached on the tensor; sparse layouts have none.
      if (t.layout() == at::kStrided && !t.is_contiguous()) nonContiguous_ = true;
      return;
    }
    addNonCpu(t);
  }
  void add(const std::vector<at::Tensor>& ts) {
    for (const auto& t : ts) add(t);
  }
  void add(const std::vector<std::vector<at::Tensor>>& lists) {
    for (const auto& ts : lists) add(ts);
  }
  // The seam of the call (nullptr: the tensors go as they are); throws on a mix.
  DeviceSeam* seam() const {
    if (seam_ != nullptr && other_) mixed(*device_, *other_);
    if (seam_ == nullptr && nonContiguous_) return &stridedCpuSeam();
    return seam_;
  }
  at::Device device() const { return device_.value_or(at::Device(at::kCPU)); }

 private:
  void addNonCpu(const at::Tensor& t);
  [[noreturn]] void mixed(const at::Device& a, const at::Device& b) const;

  const char* op_;
  DeviceSeam* seam_ = nullptr;
  std::optional<at::Device> device_;  // of the tensors with a seam
  std::optional<at::Device> other_;   // the last tensor's without one
  bool nonContiguous_ = false;        // a strided CPU tensor that is not contiguous
};

template <typename T>
struct Declared {
  Role role;
  T& tensors;
};

// The roles an entry point declares: role::in(inputs), role::out(output), ...
namespace role {
template <typename T>
Declared<T> in(T& t) { return {Role::kIn, t}; }
template <typename T>
Declared<T> out(T& t) { return {Role::kOut, t}; }
template <typename T>
Declared<T> inout(T& t) { return {Role::kInOut, t}; }
}  // namespace role

namespace seam_detail {

inline void flatten(std::vector<DeclaredTensor>& flat, Role role, const at::Tensor& t) {
  flat.push_back({role, &t});
}
inline void flatten(std::vector<DeclaredTensor>& flat, Role role, const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) flatten(flat, role, t);
}
inline void flatten(std::vector<DeclaredTensor>& flat, Role role,
                    const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& ts : lists) flatten(flat, role, ts);
}

// The host counterpart of a declared argument, in its shape.
inline at::Tensor rebuild(const at::Tensor&, const std::vector<at::Tensor>& host, size_t& next) {
  return host[next++];
}
inline std::vector<at::Tensor> rebuild(const std::vector<at::Tensor>& ts,
                                       const std::vector<at::Tensor>& host, size_t& next) {
  std::vector<at::Tensor> result;
  result.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) result.push_back(host[next++]);
  return result;
}
inline std::vector<std::vector<at::Tensor>> rebuild(const std::vector<std::vector<at::Tensor>>& lists,
                                                    const std::vector<at::Tensor>& host, size_t& next) {
  std::vector<std::vector<at::Tensor>> result;
  result.reserve(lists.size());
  for (const auto& ts : lists) result.push_back(rebuild(ts, host, next));
  return result;
}

}  // namespace seam_detail

// The declared tensors of one call, in order: declare(role::out(outputs), role::in(inputs)).
template <typename... T>
std::tuple<Declared<T>...> declare(Declared<T>... declared) {
  return {declared...};
}

// Runs `body(const Launch&, T&... tensors)` for the call `op` on the device of the
// declared tensors: on them as they are (CPU, identity), or on their host
// counterparts through the device's seam. `body` returns the CPU operation's Work.
template <typename Body, typename... T>
c10::intrusive_ptr<c10d::Work> runOnDevice(const char* op, int rank, Dispatch dispatch,
                                           bool asyncOp, std::tuple<Declared<T>...> declared,
                                           Body&& body) {
  return std::apply(
      [&](Declared<T>&... d) -> c10::intrusive_ptr<c10d::Work> {
        DeviceProbe probe(op);
        (probe.add(d.tensors), ...);
        DeviceSeam* seam = probe.seam();
        if (seam == nullptr)
          return body(Launch{asyncOp, {}, /*workOptional=*/true, /*afterBody=*/{}}, d.tensors...);
        std::vector<DeclaredTensor> flat;
        (seam_detail::flatten(flat, d.role, d.tensors), ...);
        std::unique_ptr<StagedCall> call = seam->stage(op, rank, probe.device(), dispatch, flat);
        size_t next = 0;
        // Braced initialisation evaluates left to right: the declaration order.
        std::tuple<T...> host{seam_detail::rebuild(d.tensors, call->host, next)...};
        const Launch launch = call->launch(asyncOp);
        c10::intrusive_ptr<c10d::Work> hostWork =
            std::apply([&](T&... tensors) { return body(launch, tensors...); }, host);
        return call->finish(std::move(hostWork));
      },
      declared);
}

}  // namespace pycomm
