#include "transport/transport.h"

#include <algorithm>
#include <thread>

namespace pycomm {

namespace {
// A wait polls the request this long (yielding the core between looks) before it
// sleeps on the condition variable. A message's completion on the TCP I/O thread
// then reaches a waiter that is awake, without a second thread wake-up: on the
// 2-core VM an 8-byte round trip of send/recv took 168-241 us with two wake-ups
// per message and 69-142 us with one (benchmarks/results/p2p_latency.txt), so
// about 50 us per wake-up. Bounded, and yielding; only for small messages where
// ranks outnumber the CPUs (gLimited, below). Not done in
// waits for the group's worker (PycommWork::wait, the worker's queue): there the
// waited-for thread computes, and a poller on its core made four queued 256 KiB
// all-reduces over shared memory 1.5-2x slower, for no gain on 8-byte ones.
constexpr int kPollMicros = 300;
// A yield that kept the waiter off the core this long means the core is busy with
// other work (the peer computing, other jobs): polling stops and the waiter sleeps.
constexpr int kLongYieldMicros = 500;

// Limited once a group of this process has more ranks on this machine than CPUs to
// run them: then only a wait for a message of 1 byte to kCrowdedPollMaxBytes polls.
// Such a wait is short (a small call's message), and a wake-up is much of its call;
// a long one (a large segment in transfer, a 0-byte credit or barrier token that
// waits on another rank's progress) takes the core a poller yields from a rank with
// work. Measured on the 2-core VM, 2-5 runs each, alternating:
//   8 ranks in 8 network namespaces, 16 MiB tree all-reduce over TCP: every wait
//   polling 122-181 ms, none 100-113, small messages only 106-133 (0-byte ones too:
//   127);
//   4 ranks over loopback TCP, 8-byte ring / tree all-reduce back to back: every wait
//   284-322 / 226-253 us, none 394-408 / 308-326, small messages only 267-268 / 196-233.
constexpr size_t kCrowdedPollMaxBytes = 64 << 10;
std::atomic<bool> gLimited{false};
}  // namespace

void Request::limitPolling() { gLimited.store(true, std::memory_order_relaxed); }
bool Request::pollingLimited() { return gLimited.load(std::memory_order_relaxed); }

bool Request::waitUntil(Clock::time_point deadline) {
  if (finished_.load(std::memory_order_acquire)) return true;
  auto before = Clock::now();
  const bool poll = !pollingLimited() || (bytes_ > 0 && bytes_ <= kCrowdedPollMaxBytes);
  const int pollMicros = poll ? kPollMicros : 0;
  const auto pollEnd = std::min<Clock::time_point>(before + std::chrono::microseconds(pollMicros), deadline);
  while (before < pollEnd) {
    std::this_thread::yield();
    if (finished_.load(std::memory_order_acquire)) return true;
    const auto now = Clock::now();
    if (now - before >= std::chrono::microseconds(kLongYieldMicros)) break;
    before = now;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_until(lock, deadline, [&] { return state_ != State::kPending; });
}

bool Request::completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ != State::kPending;
}

bool Request::failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == State::kFailed;
}

std::string Request::error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

int Request::sourceRank() {
  std::lock_guard<std::mutex> lock(mutex_);
  return sourceRank_;
}

void Request::finishLocked(std::unique_lock<std::mutex>& lock) {
  finished_.store(true, std::memory_order_release);
  std::function<void()> callback = std::move(callback_);
  callback_ = nullptr;
  lock.unlock();
  cv_.notify_all();
  if (callback) callback();
}

void Request::complete(int sourceRank) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ != State::kPending) return;
  state_ = State::kDone;
  sourceRank_ = sourceRank == kSourceIsPeer ? peer_ : sourceRank;
  finishLocked(lock);
}

void Request::fail(const std::string& message) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ != State::kPending) return;
  state_ = State::kFailed;
  error_ = message;
  finishLocked(lock);
}

void Request::onComplete(std::function<void()> callback) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ == State::kPending) {
    callback_ = std::move(callback);
    return;
  }
  lock.unlock();
  callback();
}

std::string otherCallText(const std::string& sender) {
  return sender + " is in another call at this collective (ranks called different collectives, or with "
                  "different dtypes, reduce ops or roots? PYCOMM_CHECK=1 names each rank's call)";
}

std::string earlierCallText(const std::string& sender, uint64_t message, uint64_t receive) {
  return sender + " sent a message in collective #" + std::to_string(static_cast<uint32_t>(message)) +
         " that this rank finished without it, and it met this rank's receive in collective #" +
         std::to_string(static_cast<uint32_t>(receive)) +
         " (the ranks made different calls there, such as a broadcast with different roots? "
         "PYCOMM_CHECK=1 names each rank's call)";
}

std::string sizeMismatchText(const std::string& sender, size_t sent, size_t expected, bool upTo) {
  return sender + " sent " + std::to_string(sent) + " bytes where " + (upTo ? "at most " : "") +
         std::to_string(expected) + " were expected (tensor sizes differ between ranks?)";
}

std::string tagText(uint64_t tag) {
  std::string text = std::to_string(tag & (kCreditTagBit - 1) & ~kCallTagMask);
  if (tag & kCreditTagBit) text += " (a credit)";
  return text;
}

}  // namespace pycomm
