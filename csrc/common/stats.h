// Process-wide counters behind pycomm.stats(): payload bytes through every
// transport, and per-operation counts and times.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

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

  // One call of `op` on a group of `groupSize` ranks: also counted in its size
  // bucket (pycomm.comm_summary()), the power of two at or below `bytes`.
  void recordOp(const std::string& op, double seconds, uint64_t bytes, bool failed,
                int groupSize = 1) {
    std::lock_guard<std::mutex> lock(mutex_);
    add(ops_[op], seconds, bytes, failed);
    // Looked up without building a key: no allocation once the bucket exists.
    const int bucket = sizeBucket(bytes);
    auto found = buckets_.find(std::forward_as_tuple(op, groupSize, bucket));
    if (found == buckets_.end()) found = buckets_.emplace(BucketKey(op, groupSize, bucket), OpStats{}).first;
    add(found->second, seconds, bytes, failed);
  }
  // (op, group size, bucket): the bucket holds sizes in [2^bucket, 2^(bucket+1)); -1 holds 0 bytes.
  using BucketKey = std::tuple<std::string, int, int>;
  static int sizeBucket(uint64_t bytes) {
    int bucket = -1;
    while (bytes != 0) {
      bytes >>= 1;
      ++bucket;
    }
    return bucket;
  }
  std::map<BucketKey, OpStats, std::less<>> buckets() {
    std::lock_guard<std::mutex> lock(mutex_);
    return buckets_;
  }
  std::map<std::string, OpStats> ops() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ops_;
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.clear();
    buckets_.clear();
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
  std::map<BucketKey, OpStats, std::less<>> buckets_;

  static void add(OpStats& entry, double seconds, uint64_t bytes, bool failed) {
    ++entry.count;
    entry.failures += failed ? 1 : 0;
    entry.seconds += seconds;
    entry.bytes += bytes;
  }
};

}  // namespace pycomm
