// The per-device-type table of seams and the device probe (device_seam.h).
#include "backend/device_seam.h"

#include <array>

#include "backend/tensor_checks.h"

namespace pycomm {
namespace {

constexpr size_t kDeviceTypes = static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

// Filled while the extension loads (static registration), read-only afterwards.
std::array<DeviceSeam*, kDeviceTypes>& seams() {
  static std::array<DeviceSeam*, kDeviceTypes> table{};
  return table;
}

}  // namespace

void registerDeviceSeam(c10::DeviceType type, DeviceSeam* seam) {
  seams()[static_cast<size_t>(type)] = seam;
}

DeviceSeam* deviceSeam(c10::DeviceType type) {
  const auto index = static_cast<size_t>(type);
  return index < kDeviceTypes && type != c10::DeviceType::CPU ? seams()[index] : nullptr;
}

std::vector<std::string> seamDevices() {
  std::vector<std::string> devices{"cpu"};
  for (size_t i = 0; i < kDeviceTypes; ++i)
    if (seams()[i] != nullptr && static_cast<c10::DeviceType>(i) != c10::DeviceType::CPU)
      devices.push_back(c10::DeviceTypeName(static_cast<c10::DeviceType>(i), /*lower_case=*/true));
  return devices;
}

StagedWork::StagedWork(int rank, const char* /*op*/, c10::intrusive_ptr<c10d::Work> hostWork,
                       c10::intrusive_ptr<c10::ivalue::Future> future, std::vector<at::Tensor> result,
                       std::shared_ptr<void> keep)
    // No profiling title: c10d::Work would begin an event that only its own finish()
    // ends (never called here); the host Work records the call's event.
    : c10d::Work(rank, hostWork->retrieveOpType(), nullptr),
      hostWork_(std::move(hostWork)),
      future_(std::move(future)),
      result_(std::move(result)),
      keep_(std::move(keep)) {}

bool StagedWork::wait(std::chrono::milliseconds timeout) {
  hostWork_->wait(timeout);
  future_->wait();  // on a device: makes the current stream wait for the copies back
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

void DeviceProbe::addNonCpu(const at::Tensor& t) {
  DeviceSeam* seam = deviceSeam(t.device().type());
  if (seam == nullptr) {
    other_ = t.device();  // the CPU checks report it
    return;
  }
  checkStrided(op_, t);
  checkContiguous(op_, t);
  if (device_ && *device_ != t.device()) mixed(*device_, t.device());
  device_ = t.device();
  seam_ = seam;
}

void DeviceProbe::mixed(const at::Device& a, const at::Device& b) const {
  usageError(where(op_) + "all tensors of one call must be on one device (got " + a.str() + " and " +
             b.str() + ")");
}

}  // namespace pycomm
