#include "backend/completion_pool.h"

namespace pycomm {

void CompletionPool::post(std::function<void()> completion) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopping_) {
      queue_.push_back(std::move(completion));
      // Each queued completion needs a thread that is not inside a callback.
      if (queue_.size() > idle_ && threads_.size() < kMaxThreads) threads_.emplace_back([this] { loop(); });
      else cv_.notify_one();
      return;
    }
  }
  completion();
}

void CompletionPool::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    ++idle_;
    cv_.wait(lock, [&] { return !queue_.empty() || stopping_; });
    --idle_;
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<void()> completion = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    completion();
    lock.lock();
  }
}

void CompletionPool::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads)
    if (t.joinable()) t.join();
}

size_t CompletionPool::threads() {
  std::lock_guard<std::mutex> lock(mutex_);
  return threads_.size();
}

}  // namespace pycomm
