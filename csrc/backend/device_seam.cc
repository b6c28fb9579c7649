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
