// In-process transport: threads as ranks, for algorithm tests. Every rank of a
// LoopbackFabric lives in this process; a send copies straight into a posted
// receive, or into a queued message when none is posted yet.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/transport.h"

namespace pycomm {

class LoopbackFabric {
 public:
  explicit LoopbackFabric(int size);
  int size() const { return size_; }

 private:
  friend class LoopbackTransport;
  struct Message {
    uint64_t tag;
    std::vector<char> data;
  };
  struct PostedRecv {
    uint64_t tag;
    char* data;
    size_t bytes;
    RequestPtr request;
    bool upTo;  // a message of at most `bytes` fits
  };
  struct Mailbox {  // one per (source, destination) pair
    std::deque<Message> queued;
    std::deque<PostedRecv> posted;
  };
  Mailbox& box(int src, int dst) { return boxes_[static_cast<size_t>(src) * size_ + dst]; }

  const int size_;
  std::mutex mutex_;
  std::vector<Mailbox> boxes_;
  std::string abortReason_;
};

class LoopbackTransport : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric, int rank);

  int rank() const override { return rank_; }
  int size() const override { return fabric_->size(); }
  const char* name() const override { return "loopback"; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo = false) override;
  // Aborts the whole fabric: every rank's pending requests fail.
  void abort(const std::string& reason) override;
  uint64_t bytesSent() const override { return sent_; }
  uint64_t bytesReceived() const override { return received_; }

 private:
  std::shared_ptr<LoopbackFabric> fabric_;
  const int rank_;
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> received_{0};
};

}  // namespace pycomm
