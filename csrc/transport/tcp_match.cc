// TcpTransport's posting and matching: isend/irecv, incoming messages matched
// to posted receives (or buffered until one is posted), and failing what waits
// on a lost peer.
#include "transport/tcp.h"

#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "common/stats.h"

namespace pycomm {
RequestPtr TcpTransport::isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  PYCOMM_CHECK_INTERNAL(peer >= 0 && peer < size_ && peer != rank_, "bad peer ", peer);
  auto request = std::make_shared<Request>(peer, bytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string& failure = !abortReason_.empty() ? abortReason_ : peers_[peer]->failure;
    if (!failure.empty()) {
      request->fail(failure);
      return request;
    }
  }
  std::vector<RequestPtr> done;
  std::string error;
  {
    Peer& p = *peers_[peer];
    std::lock_guard<std::mutex> lock(p.sendMutex);
    p.sendQueue.push_back(
        {request, WireHeader{kDataMagic, 0, tag, bytes}, static_cast<const char*>(data), bytes, 0});
    if (p.sendQueue.size() == 1) error = flushSends(peer, done);
    if (error.empty() && !p.sendQueue.empty() && !p.writeArmed) armWrite(peer, true);
  }
  for (auto& r : done) r->complete();
  if (!error.empty()) failPeer(peer, error);
  return request;
}

RequestPtr TcpTransport::irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  PYCOMM_CHECK_INTERNAL(peer == kAnySource || (peer >= 0 && peer < size_ && peer != rank_),
                        "bad peer ", peer);
  auto request = std::make_shared<Request>(peer, bytes);
  std::string failure;
  // What a message that already arrived (or is arriving) did for this receive.
  enum class Found {
    kNothing,    // no message: the receive is posted
    kDelivered,  // a complete one was copied out: the receive completes now
    kClaimed,    // one still arriving was claimed: completes when the message ends
  };
  Found found = Found::kNothing;
  int deliveredFrom = -1;  // the sender, when kDelivered
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!abortReason_.empty()) {
      failure = abortReason_;
    } else {
      // A message that already arrived (or is arriving) matches first.
      for (int source = 0; source < size_ && found == Found::kNothing && failure.empty(); ++source) {
        if (source == rank_ || (peer != kAnySource && source != peer)) continue;
        auto& queue = peers_[source]->unexpected;
        for (auto it = queue.begin(); it != queue.end(); ++it) {
          Unexpected& u = **it;
          if (u.tag != tag || u.claim != Unexpected::Claim::kNone) continue;
          if (u.data.size() != bytes) {
            failure = strCat(rankName(source), " sent ", u.data.size(), " bytes where ", bytes,
                             " were expected (tensor sizes differ between ranks?)");
            if (u.complete) {
              unexpectedBytes_ -= u.data.size();
              queue.erase(it);
            } else {  // claim it, so the rest of it is read and dropped
              u.claim = Unexpected::Claim::kDropped;
            }
          } else if (u.complete) {
            if (bytes > 0) std::memcpy(data, u.data.data(), bytes);
            unexpectedBytes_ -= u.data.size();
            queue.erase(it);
            found = Found::kDelivered;
            deliveredFrom = source;
          } else {
            u.claim = Unexpected::Claim::kWaiting;
            u.waiter = {tag, static_cast<char*>(data), bytes, request};
            found = Found::kClaimed;
          }
          break;
        }
      }
      if (found == Found::kNothing && failure.empty()) {
        if (peer == kAnySource) {
          anyPosted_.push_back({tag, static_cast<char*>(data), bytes, request});
        } else if (!peers_[peer]->failure.empty()) {
          failure = peers_[peer]->failure;
        } else {
          peers_[peer]->posted.push_back({tag, static_cast<char*>(data), bytes, request});
        }
      }
    }
  }
  if (!failure.empty()) {
    request->fail(failure);
  } else if (found == Found::kDelivered) {
    bytesReceived_ += bytes;
    Stats::instance().addReceived(bytes);
    request->complete(deliveredFrom);
  }
  // A parked stream may be waiting for this receive, or for the budget it freed.
  if (parkedPeers_.load(std::memory_order_acquire) > 0) wake();
  return request;
}

std::string TcpTransport::describePending(int peer) {
  if (peer < 0 || peer >= size_ || peer == rank_) return "";
  std::lock_guard<std::mutex> lock(mutex_);
  const Peer& p = *peers_[peer];
  std::string text;
  size_t unmatched = 0;
  for (const auto& u : p.unexpected)
    if (u->claim == Unexpected::Claim::kNone) ++unmatched;
  if (unmatched > 0) {
    text = strCat(unmatched, " message(s) from ", rankName(peer),
                  " arrived that no receive matched (first tag ", p.unexpected.front()->tag & ~(1ull << 63),
                  ", ", p.unexpected.front()->data.size(), " bytes)");
  } else {
    text = strCat("nothing arrived from ", rankName(peer), " for this operation");
  }
  if (p.parked)
    text += strCat("; ", rankName(peer), " announced a message of ", p.header.bytes, " bytes (tag ",
                   p.header.tag & ~(1ull << 63),
                   ") that no receive matched; it waits unread, since unexpected messages may hold at most ",
                   maxUnexpectedBytes_, " bytes (", unexpectedBytes_, " held)");
  text += strCat("; ", p.messagesIn.load(), " messages in and ", p.messagesOut.load(),
                 " out with it, ", p.posted.size(), " receive(s) posted");
  if (!p.posted.empty()) text += strCat(" (first tag ", p.posted.front().tag & ~(1ull << 63), ")");
  return text;
}

bool TcpTransport::matchIncoming(int peer) {
  Peer& p = *peers_[peer];
  p.payloadBytes = p.header.bytes;
  p.payloadGot = 0;
  p.dst = nullptr;
  if (p.header.flags & kFlagAbort) {  // not data: the peer says why it is leaving
    p.readingAbort = true;
    p.abortText.resize(p.payloadBytes);
    p.dst = p.abortText.data();
    return true;
  }
  RequestPtr mismatched;  // a receive of another size: it fails now, the payload is dropped
  std::string mismatch;
  const bool wasParked = p.parked;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto take = [&](std::deque<PostedRecv>& list) {
      for (auto it = list.begin(); it != list.end(); ++it) {
        if (it->tag != p.header.tag) continue;
        if (it->bytes != p.payloadBytes) {
          mismatched = it->request;
          mismatch = strCat(rankName(peer), " sent ", p.payloadBytes, " bytes where ", it->bytes,
                            " were expected (tensor sizes differ between ranks?)");
          p.discarding = true;
        } else {
          p.recvRequest = it->request;
          p.dst = it->data;
        }
        list.erase(it);
        return true;
      }
      return false;
    };
    const bool placed = take(p.posted) || take(anyPosted_);
    const bool overBudget = !placed && p.payloadBytes > maxUnexpectedBytes_ - std::min(unexpectedBytes_, maxUnexpectedBytes_);
    if (overBudget != p.parked) {
      p.parked = overBudget;
      parkedPeers_ += overBudget ? 1 : -1;
    }
    if (!placed && !overBudget) {
      auto buffer = std::make_shared<Unexpected>();
      Stats::instance().addBuffered(p.payloadBytes);
      buffer->tag = p.header.tag;
      buffer->data.resize(p.payloadBytes);
      unexpectedBytes_ += p.payloadBytes;
      p.dst = buffer->data.data();
      p.recvBuffer = buffer;
      p.unexpected.push_back(std::move(buffer));
    }
  }
  if (mismatched) mismatched->fail(mismatch);
  if (p.parked != wasParked) pauseReads(peer, p.parked);
  return !p.parked;
}

void TcpTransport::retryParked() {
  if (parkedPeers_.load(std::memory_order_acquire) == 0) return;
  for (int peer = 0; peer < size_; ++peer) {
    Peer& p = *peers_[peer];
    if (!p.parked) continue;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!p.failure.empty()) continue;  // its hang-up is handled by the I/O loop
    }
    if (!matchIncoming(peer)) continue;  // still no receive and no budget
    if (p.payloadBytes == 0) finishIncoming(peer);
    else p.inPayload = true;
    handleReadable(peer);  // what waited in the socket
  }
}

void TcpTransport::finishIncoming(int peer) {
  Peer& p = *peers_[peer];
  p.inPayload = false;
  if (p.readingAbort) {
    p.readingAbort = false;
    // The sender's reason comes without its op prefix (Error::detail()); the
    // receiver's own errors add theirs.
    const std::string reason = abortReasonText(p.abortText.data(), p.abortText.size());
    failPeer(peer, strCat(rankName(peer), " aborted the group: ", reason), true);
    return;
  }
  if (p.discarding) {  // its receive failed when the header arrived
    p.discarding = false;
    return;
  }
  RequestPtr request = std::move(p.recvRequest);
  std::shared_ptr<Unexpected> buffer = std::move(p.recvBuffer);
  p.recvRequest.reset();
  p.recvBuffer.reset();
  if (request) {
    bytesReceived_ += p.payloadBytes;
    Stats::instance().addReceived(p.payloadBytes);
    request->complete(peer);
    return;
  }
  RequestPtr waiter;  // a receive that claimed this message while it arrived
  {
    std::lock_guard<std::mutex> lock(mutex_);
    buffer->complete = true;
    if (buffer->claim != Unexpected::Claim::kNone) {
      // Sizes were checked when the receive claimed it; a mismatched one failed
      // then, and so did one whose peer was lost meanwhile (kDropped both).
      if (buffer->claim == Unexpected::Claim::kWaiting) {
        waiter = buffer->waiter.request;
        if (!buffer->data.empty())
          std::memcpy(buffer->waiter.data, buffer->data.data(), buffer->data.size());
      }
      auto& queue = p.unexpected;
      auto it = std::find(queue.begin(), queue.end(), buffer);
      if (it != queue.end()) {
        unexpectedBytes_ -= buffer->data.size();
        queue.erase(it);
      }
    }
  }
  if (waiter) {
    bytesReceived_ += buffer->data.size();
    Stats::instance().addReceived(buffer->data.size());
    waiter->complete(peer);
  }
}

void TcpTransport::failPeer(int peer, const std::string& reason, bool fullMessage) {
  Peer& p = *peers_[peer];
  std::vector<RequestPtr> failed;
  std::string message;
  bool alreadyFailed = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    alreadyFailed = !p.failure.empty();
    if (!alreadyFailed)
      p.failure = !abortReason_.empty() ? abortReason_ : fullMessage ? reason : lostMessage(peer, reason);
    message = p.failure;
    for (auto& posted : p.posted) failed.push_back(posted.request);
    p.posted.clear();
    // Complete messages stay deliverable; partial ones are lost with the peer.
    // The I/O thread may still be reading one (off that thread): a receive that
    // claimed it fails now and is detached, so the rest of the message is
    // dropped and never copied into that receive's buffer.
    for (auto it = p.unexpected.begin(); it != p.unexpected.end();) {
      Unexpected& u = **it;
      if (u.complete) {
        ++it;
        continue;
      }
      if (u.claim == Unexpected::Claim::kWaiting) failed.push_back(u.waiter.request);
      u.claim = Unexpected::Claim::kDropped;
      u.waiter = PostedRecv{};
      unexpectedBytes_ -= u.data.size();
      it = p.unexpected.erase(it);
    }
  }
  if (!alreadyFailed) {
    std::lock_guard<std::mutex> lock(p.sendMutex);
    for (auto& send : p.sendQueue) failed.push_back(send.request);
    p.sendQueue.clear();
    if (p.fd >= 0) ::shutdown(p.fd, SHUT_RDWR);
  }
  if (std::this_thread::get_id() == ioThread_.get_id()) {
    // The I/O thread owns the receive in progress, and stops watching the socket.
    if (p.fd >= 0) epoll_ctl(epollFd_, EPOLL_CTL_DEL, p.fd, nullptr);
    if (p.recvRequest) failed.push_back(p.recvRequest);
    p.recvRequest.reset();
    p.recvBuffer.reset();
    p.inPayload = false;
    p.discarding = false;
    p.headerGot = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (p.parked) {
        p.parked = false;
        --parkedPeers_;
      }
    }
  } else {
    wake();
  }
  for (auto& r : failed)
    if (r) r->fail(message);
}

std::string TcpTransport::lostMessage(int peer, const std::string& reason) const {
  return strCat(rankName(rank_), " lost the connection to ", rankName(peer), " (", reason, ")");
}

}  // namespace pycomm
