// An in-process KeyValueStore (threads as ranks: the loopback harness and the
// C++ tests). get() blocks until the key is set, at most `timeout`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "common/error.h"
#include "transport/transport.h"

namespace pycomm {

class MemoryStore : public KeyValueStore {
 public:
  explicit MemoryStore(std::chrono::milliseconds timeout = std::chrono::seconds(60)) : timeout_(timeout) {}

  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      values_[key] = value;
    }
    cv_.notify_all();
  }

  std::string get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout_, [&] { return values_.count(key) > 0; }))
      throwError(ErrorKind::kTimeout, "store: timed out waiting for key ", key);
    return values_.at(key);
  }

 private:
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

}  // namespace pycomm
