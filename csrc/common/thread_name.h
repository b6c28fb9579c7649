// Names the calling thread, so top -H, py-spy, gdb and /proc/<pid>/task/*/comm
// tell pycomm's threads apart (benchmarks/call_cost.py --threads reads them).
#pragma once

#include <pthread.h>

#include <string>

namespace pycomm {

inline void nameThisThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());  // Linux allows 15 characters
}

}  // namespace pycomm
