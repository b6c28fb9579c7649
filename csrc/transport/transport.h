// Bytes between ranks. Algorithms are written against this interface only;
// transports know nothing of reductions or dtypes.
//
// Semantics every transport keeps:
//  - isend/irecv post an operation and return at once; the Request completes
//    when the buffer may be reused (send) or holds the data (recv).
//  - Messages between one (sender, receiver) pair with the same tag match in
//    posting order (FIFO), so an algorithm may reuse one tag for a sequence of
//    segments as long as both sides post them in the same order.
//  - A receive must be posted with exactly the size that was sent; a mismatch
//    fails the receive with an error naming both sizes and the sender.
//  - Failures (lost peer, abort) complete requests with an error; nothing waits
//    forever: callers wait with a deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pycomm {

using Clock = std::chrono::steady_clock;

constexpr int kAnySource = -1;
// Request::complete's default source rank: the request's own peer().
constexpr int kSourceIsPeer = -2;

// Tag bits set above the transport (the algorithms' Comm and SubTransport);
// the transport only shows them: a collective's tag is its sequence number
// (mod 2^32) with bit 63 set, a sub-group's gets bit 62, a flow-control credit bit 61.
constexpr uint64_t kCreditTagBit = 1ull << 61;
// Bits 32-60 of a collective's tag hash its call (collective, dtype, reduce op,
// root; Comm::setCall). A message whose tag differs from a posted receive's only
// there comes from a rank in another call at the same collective: the receive
// fails (ranks whose calls move the same bytes would otherwise compute garbage).
// User tags (below 2^31) never set them.
constexpr int kCallTagShift = 32;
constexpr uint64_t kCallTagMask = ((1ull << 29) - 1) << kCallTagShift;
inline bool otherCall(uint64_t a, uint64_t b) { return a != b && ((a ^ b) & ~kCallTagMask) == 0; }
// What a receive that met a message of another call fails with.
std::string otherCallText(const std::string& sender);
// Whether `message` is a collective message of an earlier collective than the
// receive `receive` waits for, in the same tag space (bits 61-63 alike; sequence
// numbers compared mod 2^32). A rank posts collective receives only for the
// collective it runs, and finishes one only once every message sent to it there
// has come, so such a message was sent in a call that moved data this rank's call
// did not take (a broadcast whose ranks name different roots): the receive fails.
inline bool earlierCall(uint64_t message, uint64_t receive) {
  constexpr uint64_t kSpace = ~((1ull << 61) - 1);  // the collective, sub-group and credit bits
  if ((message >> 63) == 0 || (message & kSpace) != (receive & kSpace)) return false;
  const uint32_t behind = static_cast<uint32_t>(receive) - static_cast<uint32_t>(message);
  return behind != 0 && behind < (1u << 31);
}
// What a receive that met a message of an earlier collective fails with.
std::string earlierCallText(const std::string& sender, uint64_t message, uint64_t receive);
// Whether a receive of `expected` bytes (at most that many with `upTo`) takes a
// message of `sent`, and what it fails with when not.
inline bool receiveFits(size_t sent, size_t expected, bool upTo) { return upTo ? sent <= expected : sent == expected; }
std::string sizeMismatchText(const std::string& sender, size_t sent, size_t expected, bool upTo);
// A tag as errors print it: the sequence number, then "(a credit)" for one.
std::string tagText(uint64_t tag);

class Request {
 public:
  enum class State { kPending, kDone, kFailed };

  Request(int peer, size_t bytes) : peer_(peer), bytes_(bytes) {}

  int peer() const { return peer_; }
  size_t bytes() const { return bytes_; }

  // Waits until the request completes or `deadline` passes. Returns false on
  // timeout (the request stays pending); true once it is done or failed. Polls
  // (yielding) for up to 300 us before it sleeps (request.cc); where polling is
  // limited, only for a message of 1 byte to 64 KiB.
  bool waitUntil(Clock::time_point deadline);
  // Limits the polling for every later wait in this process, for good: a group
  // found more ranks on this machine than this process may use CPUs (bootstrap.cc).
  static void limitPolling();
  static bool pollingLimited();
  bool completed();
  bool failed();
  std::string error();
  // The rank the data came from (differs from peer() for kAnySource receives).
  int sourceRank();

  // Completion (called by transports, once). Runs the callback, if any, after
  // releasing the request's lock.
  void complete(int sourceRank = kSourceIsPeer);
  void fail(const std::string& message);

  // Runs `callback` once the request completes (at once if it already has).
  void onComplete(std::function<void()> callback);

 private:
  void finishLocked(std::unique_lock<std::mutex>& lock);

  const int peer_;
  const size_t bytes_;
  std::mutex mutex_;
  std::condition_variable cv_;
  // Set (release) with state_ when the request finishes: waitUntil polls it.
  std::atomic<bool> finished_{false};
  State state_ = State::kPending;
  std::string error_;
  int sourceRank_ = -1;
  std::function<void()> callback_;
};

using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;

  // Posts a send of `bytes` bytes at `data` to `peer` (peer != rank()). The
  // buffer must stay valid until the request completes.
  virtual RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  // Posts a receive of exactly `bytes` bytes from `peer` (or kAnySource); with
  // `upTo`, of a message of at most `bytes` bytes (point-to-point, as gloo and MPI
  // receive into a larger buffer; the bytes past the message are left as they were).
  // A message of another size fails the receive (and, on the sender's side, nothing).
  virtual RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo = false) = 0;

  // Fails every pending request with `reason`, stops touching user buffers
  // before returning, and makes every later post fail. Idempotent.
  virtual void abort(const std::string& reason) = 0;

  // A short account of what is pending with `peer` (for timeout messages);
  // "" when there is nothing useful to say.
  virtual std::string describePending(int /*peer*/) { return ""; }

  // Payload bytes moved through this transport (for pycomm.stats()).
  virtual uint64_t bytesSent() const = 0;
  virtual uint64_t bytesReceived() const = 0;

  // How a rank is named in messages: its global rank when the transport
  // serves a subgroup.
  virtual std::string rankName(int groupRank) const {
    if (groupRank >= 0 && static_cast<size_t>(groupRank) < globalRanks_.size())
      return "rank " + std::to_string(globalRanks_[groupRank]);
    return "rank " + std::to_string(groupRank);
  }
  void setGlobalRanks(std::vector<int> globalRanks) { globalRanks_ = std::move(globalRanks); }

 private:
  std::vector<int> globalRanks_;
};

// The tiny key-value interface bootstrap needs. The backend adapts torch's
// c10d::Store to it; tests use an in-memory map.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists (or the store's own timeout, which throws).
  virtual std::string get(const std::string& key) = 0;
};

}  // namespace pycomm
