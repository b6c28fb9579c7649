// Debug logging, enabled with PYCOMM_DEBUG=1 (read once per process).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace pycomm {

inline bool debugEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("PYCOMM_DEBUG");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
  }();
  return enabled;
}

inline void debugLog(const std::string& line) {
  if (debugEnabled()) std::fprintf(stderr, "[pycomm] %s\n", line.c_str());
}

}  // namespace pycomm
