#include "transport/transport.h"

namespace pycomm {

bool Request::waitUntil(Clock::time_point deadline) {
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
