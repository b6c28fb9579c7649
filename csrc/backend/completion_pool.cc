#include "backend/completion_pool.h"

#include "common/thread_name.h"

namespace pycomm {

void CompletionPool::post(std::function<void()> completion) { postTo(state_, std::move(completion)); }

void CompletionPool::postTo(const std::shared_ptr<State>& state, std::function<void()> completion) {
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    State& s = *state;
    if (!s.stopping) {
      s.queue.push_back(std::move(completion));
      // Each queued completion needs a thread that is not inside a callback.
      if (s.queue.size() > s.idle && s.threads.size() < kMaxThreads) s.threads.emplace_back(loop, state);
      else s.cv.notify_one();
      return;
    }
  }
  completion();
}

void CompletionPool::loop(std::shared_ptr<State> state) {
  nameThisThread("pycomm-done");
  State& s = *state;  // owned by this thread too: it may outlive the pool (see stop)
  std::unique_lock<std::mutex> lock(s.mutex);
  while (true) {
    ++s.idle;
    s.cv.wait(lock, [&] { return !s.queue.empty() || s.stopping; });
    --s.idle;
    if (s.queue.empty()) return;  // stopping, nothing left
    std::function<void()> completion = std::move(s.queue.front());
    s.queue.pop_front();
    lock.unlock();
    completion();
    completion = nullptr;  // what it held (Python objects, the group itself) goes here, unlocked
    lock.lock();
  }
}

void CompletionPool::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
    threads.swap(state_->threads);
  }
  state_->cv.notify_all();
  for (auto& t : threads) {
    // A completion may drop the last reference to the group, whose destructor
    // stops the pool from that very thread: it finishes on its own, on the
    // shared state, after the completion returns.
    if (t.get_id() == std::this_thread::get_id()) t.detach();
    else if (t.joinable()) t.join();
  }
}

}  // namespace pycomm
