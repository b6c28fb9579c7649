// Where a group's Futures complete, and so where the callbacks attached to them
// run (DDP comm-hook continuations, torch's PowerSGD, user `then` chains): off the
// worker thread, so that a callback which issues a collective and waits on it
// never waits on its own thread (the worker runs the collective meanwhile).
//
// One thread normally, completing Futures in submission order. A completion posted
// while every thread of the pool is inside an earlier callback (a nested wait, or
// just a slow callback) starts another thread, as gloo's several worker threads
// would run it; at most kMaxThreads, past which completions queue.
//
// A point-to-point work completes on a transport I/O thread; once its future has
// been handed out (its callbacks are user code), the future is posted here through
// a Poster, which shares the queue but not the pool, with the work itself: a
// callback that waits on a receive never blocks the thread that would complete it,
// and the I/O thread never drops the last reference to such a work.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace pycomm {

class CompletionPool {
 public:
  static constexpr size_t kMaxThreads = 32;

  CompletionPool() = default;
  ~CompletionPool() { stop(); }
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  void post(std::function<void()> completion);
  // Runs what was posted, then joins the threads. Idempotent; post() after it
  // runs the completion on the caller's thread.
  void stop();

 private:
  struct State;

 public:
  // Posts to this pool without owning it: once the pool has stopped (or is gone),
  // post() runs the completion on the caller's thread, as the pool's own does.
  class Poster {
   public:
    void post(std::function<void()> completion) const { CompletionPool::postTo(state_, std::move(completion)); }

   private:
    friend class CompletionPool;
    explicit Poster(std::shared_ptr<State> state) : state_(std::move(state)) {}
    std::shared_ptr<State> state_;
  };
  Poster poster() const { return Poster(state_); }

 private:
  // Shared with the threads, so a thread that outlives the pool (stop() called
  // from inside one of its completions) still has it.
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    size_t idle = 0;  // threads waiting for a completion
    bool stopping = false;
    std::vector<std::thread> threads;
  };
  static void loop(std::shared_ptr<State> state);
  static void postTo(const std::shared_ptr<State>& state, std::function<void()> completion);

  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace pycomm
