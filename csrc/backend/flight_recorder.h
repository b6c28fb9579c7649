// The flight recorder: a fixed-size ring of a group's last collectives (sequence
// number, op, dtype, bytes, algorithm, state, timestamps), read by
// pycomm.flight_recorder() and, after a failure, compared between ranks through
// the store to say which rank is behind and at which call (process_group.cc).
//
// Torch-free. The hot path costs one uncontended mutex and a fixed-size copy per
// state change: entries are preallocated, nothing is allocated per call, and the
// times are the caller's steady-clock readings (the backend reads the clock once
// per step anyway), turned into wall-clock time only when read.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/call.h"

namespace pycomm {

enum class CallState : uint8_t { kQueued = 0, kStarted = 1, kCompleted = 2, kFailed = 3 };

const char* callStateName(CallState state);

struct CallRecord {
  uint64_t seq = 0;          // the group's collective sequence number, from 0
  char op[40] = {};          // "allreduce", "broadcast", ...
  char dtype[16] = {};       // "float32"; "" when the call has no tensor
  char algorithm[24] = {};   // what ran ("ring", "shm", ...); "" until it ran
  uint64_t bytes = 0;        // bytes of the tensors the op was called on (outputs)
  CallState state = CallState::kQueued;
  // Wall-clock microseconds since the epoch (in snapshots; steady-clock inside the
  // ring); 0 while the step has not happened.
  int64_t queuedUs = 0;
  int64_t startedUs = 0;
  int64_t endedUs = 0;
};

class FlightRecorder {
 public:
  static constexpr size_t kDefaultCapacity = 256;
  explicit FlightRecorder(size_t capacity = kDefaultCapacity);

  size_t capacity() const { return ring_.size(); }
  // State changes of call `seq`; started/finished are ignored when the call's entry
  // was already overwritten (more than capacity() calls queued behind it).
  using TimePoint = std::chrono::steady_clock::time_point;
  // `call`: its op, dtype and bytes (common/call.h).
  void queued(uint64_t seq, const CallDescriptor& call, TimePoint now);
  void started(uint64_t seq, TimePoint now);
  void finished(uint64_t seq, const std::string& algorithm, bool failed, TimePoint now);
  // The recorded calls, oldest first.
  std::vector<CallRecord> snapshot() const;
  // Call `seq` when it is still in the ring (false otherwise).
  bool find(uint64_t seq, CallRecord* out) const;
  // The highest sequence number completed so far, -1 before any.
  int64_t lastCompleted() const;

 private:
  static int64_t steadyUs(TimePoint t);
  // system_clock - steady_clock at construction, in microseconds (snapshot's conversion).
  const int64_t wallOffsetUs_;
  mutable std::mutex mutex_;
  std::vector<CallRecord> ring_;
  uint64_t next_ = 0;  // one past the highest seq queued
  int64_t lastCompleted_ = -1;
};

// "allreduce float32 4096 B" (the short form error messages use).
std::string describeRecord(const CallRecord& record);

// What each rank reports through the store after a failure, and its comparison.
struct ProgressReport {
  bool reported = false;  // false: no report came (the rank is not inside a collective)
  int64_t seq = -1;       // the call it was inside
  int64_t lastCompleted = -1;
  std::string call;       // describeRecord of that call
};
std::string encodeProgress(const ProgressReport& report);
bool decodeProgress(const std::string& text, ProgressReport* out);
// The verdict appended to a failure: which ranks are behind, and at which call.
// `mine` is this rank's report (inside call mine.seq); `names[r]` is rank r's
// name in messages ("rank 3").
std::string compareProgress(int myRank, const std::vector<ProgressReport>& reports,
                            const std::vector<std::string>& names);

}  // namespace pycomm
