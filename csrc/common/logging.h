// Debug logging to stderr, switched on for the process by a group whose config
// says so (GroupConfig::debug, from PYCOMM_DEBUG in pycomm/config.py).
#pragma once

#include <atomic>
#include <cstdio>
#include <string>

namespace pycomm {

inline std::atomic<bool>& debugSwitch() {
  static std::atomic<bool> enabled{false};
  return enabled;
}

inline bool debugEnabled() { return debugSwitch().load(std::memory_order_relaxed); }
inline void setDebugEnabled(bool on) { debugSwitch().store(on, std::memory_order_relaxed); }

inline void debugLog(const std::string& line) {
  if (debugEnabled()) std::fprintf(stderr, "[pycomm] %s\n", line.c_str());
}

}  // namespace pycomm
