#include "transport/loopback.h"

#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/stats.h"

namespace pycomm {

LoopbackFabric::LoopbackFabric(int size)
    : size_(size), boxes_(static_cast<size_t>(size) * size) {}

LoopbackTransport::LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric, int rank)
    : fabric_(std::move(fabric)), rank_(rank) {}

RequestPtr LoopbackTransport::isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  PYCOMM_CHECK_INTERNAL(peer >= 0 && peer < size() && peer != rank_, "bad peer ", peer);
  auto request = std::make_shared<Request>(peer, bytes);
  RequestPtr matched;
  std::string mismatch;
  {
    std::lock_guard<std::mutex> lock(fabric_->mutex_);
    if (!fabric_->abortReason_.empty()) {
      mismatch = fabric_->abortReason_;
    } else {
      auto& box = fabric_->box(rank_, peer);
      for (auto it = box.posted.begin(); it != box.posted.end(); ++it) {
        if (it->tag != tag) continue;
        if (!receiveFits(bytes, it->bytes, it->upTo)) {
          mismatch = sizeMismatchText(rankName(rank_), bytes, it->bytes, it->upTo);
        } else if (bytes > 0) {
          std::memcpy(it->data, data, bytes);
        }
        matched = it->request;
        box.posted.erase(it);
        break;
      }
      if (!matched && mismatch.empty()) {
        const char* begin = static_cast<const char*>(data);
        box.queued.push_back({tag, std::vector<char>(begin, begin + bytes)});
      }
    }
  }
  if (!mismatch.empty()) {
    if (matched) matched->fail(mismatch);
    request->fail(mismatch);
    return request;
  }
  sent_ += bytes;
  Stats::instance().addSent(bytes);
  if (matched) Stats::instance().addReceived(bytes);  // the receiver's share, delivered now
  if (matched) matched->complete(rank_);
  request->complete();
  return request;
}

RequestPtr LoopbackTransport::irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo) {
  PYCOMM_CHECK_INTERNAL(peer >= 0 && peer < size() && peer != rank_,
                        "loopback receives need a definite peer, got ", peer);
  auto request = std::make_shared<Request>(peer, bytes);
  std::string failure;
  bool done = false;
  size_t delivered = 0;
  {
    std::lock_guard<std::mutex> lock(fabric_->mutex_);
    if (!fabric_->abortReason_.empty()) {
      failure = fabric_->abortReason_;
    } else {
      auto& box = fabric_->box(peer, rank_);
      for (auto it = box.queued.begin(); it != box.queued.end(); ++it) {
        if (it->tag != tag) continue;
        delivered = it->data.size();
        if (!receiveFits(delivered, bytes, upTo)) {
          failure = sizeMismatchText(rankName(peer), delivered, bytes, upTo);
        } else if (delivered > 0) {
          std::memcpy(data, it->data.data(), delivered);
        }
        box.queued.erase(it);
        done = true;
        break;
      }
      if (!done) box.posted.push_back({tag, static_cast<char*>(data), bytes, request, upTo});
    }
  }
  if (!failure.empty()) {
    request->fail(failure);
  } else if (done) {
    received_ += delivered;
    Stats::instance().addReceived(delivered);
    request->complete();
  }
  return request;
}

void LoopbackTransport::abort(const std::string& reason) {
  std::vector<RequestPtr> pending;
  {
    std::lock_guard<std::mutex> lock(fabric_->mutex_);
    if (fabric_->abortReason_.empty()) fabric_->abortReason_ = reason.empty() ? "aborted" : reason;
    for (auto& box : fabric_->boxes_) {
      for (auto& posted : box.posted) pending.push_back(posted.request);
      box.posted.clear();
      box.queued.clear();
    }
  }
  for (auto& request : pending) request->fail(reason);
}

}  // namespace pycomm
