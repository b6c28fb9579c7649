// Process-wide counters behind pycomm.stats(): payload bytes through every
// transport, and per-operation counts and times.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace pycomm {

struct OpStats {
  uint64_t count = 0;
  uint64_t failures = 0;
  double seconds = 0.0;
  uint64_t bytes = 0;  // bytes of the tensors the op was called on
};

class Stats {
 public:
  static Stats& instance() {
    static Stats stats;
    return stats;
  }
  void addSent(uint64_t bytes) { sent_.fetch_add(bytes, std::memory_order_relaxed); }
  void addReceived(uint64_t bytes) { received_.fetch_add(bytes, std::memory_order_relaxed); }
  uint64_t sent() const { return sent_.load(std::memory_order_relaxed); }
  uint64_t received() const { return received_.load(std::memory_order_relaxed); }
  // Bytes that arrived before their receive was posted (buffered, then copied).
  void addBuffered(uint64_t bytes) { buffered_.fetch_add(bytes, std::memory_order_relaxed); }
  uint64_t buffered() const { return buffered_.load(std::memory_order_relaxed); }

  void recordOp(const std::string& op, double seconds, uint64_t bytes, bool failed) {
    std::lock_guard<std::mutex> lock(mutex_);
    OpStats& entry = ops_[op];
    ++entry.count;
    entry.failures += failed ? 1 : 0;
    entry.seconds += seconds;
    entry.bytes += bytes;
  }
  std::map<std::string, OpStats> ops() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ops_;
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.clear();
    sent_ = 0;
    received_ = 0;
    buffered_ = 0;
  }

 private:
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> buffered_{0};
  std::mutex mutex_;
  std::map<std::string, OpStats> ops_;
};

}  // namespace pycomm
