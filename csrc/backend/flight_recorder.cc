#include "backend/flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace pycomm {

namespace {

template <size_t N>
void copyName(char (&dst)[N], const char* src) {
  if (src == nullptr) src = "";
  std::strncpy(dst, src, N - 1);
  dst[N - 1] = '\0';
}

std::string joinRanks(const std::vector<int>& ranks, const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i == 8) return text + ", ...";
    text += (i ? ", " : "") + names[ranks[i]];
  }
  return text;
}

}  // namespace

const char* callStateName(CallState state) {
  switch (state) {
    case CallState::kQueued: return "queued";
    case CallState::kStarted: return "started";
    case CallState::kCompleted: return "completed";
    case CallState::kFailed: return "failed";
  }
  return "?";
}

int64_t FlightRecorder::steadyUs(TimePoint t) {
  // +1: a reading is never 0, which marks "not yet".
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count() + 1;
}

FlightRecorder::FlightRecorder(size_t capacity)
    : wallOffsetUs_(std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count() -
                    steadyUs(std::chrono::steady_clock::now())),
      ring_(std::max<size_t>(capacity, 1)) {}

void FlightRecorder::queued(uint64_t seq, const CallDescriptor& call, TimePoint when) {
  const int64_t now = steadyUs(when);
  std::lock_guard<std::mutex> lock(mutex_);
  CallRecord& r = ring_[seq % ring_.size()];
  r.seq = seq;
  copyName(r.op, call.op);
  copyName(r.dtype, call.dtypeName());
  r.algorithm[0] = '\0';
  r.bytes = call.bytes;
  r.state = CallState::kQueued;
  r.queuedUs = now;
  r.startedUs = 0;
  r.endedUs = 0;
  next_ = std::max(next_, seq + 1);
}

void FlightRecorder::started(uint64_t seq, TimePoint when) {
  const int64_t now = steadyUs(when);
  std::lock_guard<std::mutex> lock(mutex_);
  CallRecord& r = ring_[seq % ring_.size()];
  if (r.seq != seq) return;
  r.state = CallState::kStarted;
  r.startedUs = now;
}

void FlightRecorder::finished(uint64_t seq, const std::string& algorithm, bool failed,
                              TimePoint when) {
  const int64_t now = steadyUs(when);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failed) lastCompleted_ = std::max(lastCompleted_, static_cast<int64_t>(seq));
  CallRecord& r = ring_[seq % ring_.size()];
  if (r.seq != seq) return;
  r.state = failed ? CallState::kFailed : CallState::kCompleted;
  copyName(r.algorithm, algorithm.c_str());
  r.endedUs = now;
}

std::vector<CallRecord> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CallRecord> calls;
  const uint64_t n = std::min<uint64_t>(next_, ring_.size());
  calls.reserve(n);
  for (uint64_t seq = next_ - n; seq < next_; ++seq) {
    const CallRecord& r = ring_[seq % ring_.size()];
    if (r.seq != seq || r.queuedUs == 0) continue;
    calls.push_back(r);
    CallRecord& c = calls.back();
    for (int64_t* t : {&c.queuedUs, &c.startedUs, &c.endedUs})
      if (*t != 0) *t += wallOffsetUs_;
  }
  return calls;
}

bool FlightRecorder::find(uint64_t seq, CallRecord* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const CallRecord& r = ring_[seq % ring_.size()];
  if (r.seq != seq || r.queuedUs == 0) return false;
  *out = r;
  return true;
}

int64_t FlightRecorder::lastCompleted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lastCompleted_;
}

std::string describeRecord(const CallRecord& record) {
  std::string text = record.op;
  if (record.dtype[0] != '\0') text += std::string(" ") + record.dtype;
  text += " " + std::to_string(record.bytes) + " B";
  return text;
}

std::string encodeProgress(const ProgressReport& report) {
  return std::to_string(report.seq) + " " + std::to_string(report.lastCompleted) + " " + report.call;
}

bool decodeProgress(const std::string& text, ProgressReport* out) {
  std::istringstream in(text);
  ProgressReport report;
  if (!(in >> report.seq >> report.lastCompleted)) return false;
  std::getline(in, report.call);
  if (!report.call.empty() && report.call[0] == ' ') report.call.erase(0, 1);
  report.reported = true;
  *out = report;
  return true;
}

std::string compareProgress(int myRank, const std::vector<ProgressReport>& reports,
                            const std::vector<std::string>& names) {
  int64_t front = -1;
  std::string frontCall;
  for (const auto& r : reports)
    if (r.reported && r.seq > front) {
      front = r.seq;
      frontCall = r.call;
    }
  if (front < 0) return "";
  std::vector<int> there, absent;
  std::vector<std::string> behind;
  std::vector<std::string> disagree;
  for (int rank = 0; rank < static_cast<int>(reports.size()); ++rank) {
    const ProgressReport& r = reports[rank];
    if (!r.reported) {
      absent.push_back(rank);
    } else if (r.seq < front) {
      behind.push_back(names[rank] + " is at call #" + std::to_string(r.seq) + " (" + r.call +
                       "), last completed #" + std::to_string(r.lastCompleted));
    } else {
      there.push_back(rank);
      if (r.call != frontCall) disagree.push_back(names[rank] + ": " + r.call);
    }
  }
  std::string text = "flight recorder: ";
  if (!absent.empty()) {
    text += joinRanks(absent, names) + (absent.size() == 1 ? " is" : " are") +
            " behind: never reached call #" + std::to_string(front) + " (" + frontCall +
            ") (not inside a collective of this group when the others failed)";
  }
  for (const auto& b : behind) text += (text.back() == ' ' ? "" : "; ") + b + ", behind call #" + std::to_string(front);
  if (!absent.empty() || !behind.empty()) {
    text += "; at call #" + std::to_string(front) + ": " + joinRanks(there, names);
  } else {
    text += "every rank reached call #" + std::to_string(front) + " (" + frontCall + ")";
  }
  if (!disagree.empty()) {
    std::string list;
    for (size_t i = 0; i < disagree.size() && i < 8; ++i) list += (i ? "; " : "") + disagree[i];
    text += "; ranks made different calls #" + std::to_string(front) + ": " + list;
  }
  (void)myRank;
  return text;
}

}  // namespace pycomm
