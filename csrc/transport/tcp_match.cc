// TcpTransport's posting and matching: isend/irecv, incoming messages matched
// to posted receives (or buffered until one is posted), and failing what waits
// on a lost peer.
#include "transport/tcp.h"

#include <sys/epoll.h>
#include <sys/ioctl.h>
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
  // One stripe per stream, queued on all of them under postMutex, so every
  // stream carries the messages in the same order. The caller writes stream 0's
  // stripe itself when nothing is queued ahead of it (no hand-off for a small
  // message); the other stripes are queued first and left to their streams' I/O
  // threads, so a striped message is written by several threads at once rather
  // than by the caller one stripe after another.
  const int count = stripeCount(bytes, socketsPerPeer_);
  auto message = std::make_shared<Outbound>();
  message->request = request;
  message->bytes = bytes;
  message->stripesLeft = count;
  const char* payload = static_cast<const char*>(data);
  std::vector<RequestPtr> done;
  std::string error;
  bool reset = false;
  bool closed = false;
  {
    Peer& p = *peers_[peer];
    std::lock_guard<std::mutex> postLock(p.postMutex);
    for (int i = count - 1; i >= 0 && error.empty() && !closed; --i) {
      Stream& s = *p.streams[i];
      const size_t offset = stripeOffset(bytes, count, i);
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.fd < 0) {  // aborted meanwhile
        closed = true;
        break;
      }
      s.sendQueue.push_back({message, WireHeader{kDataMagic, 0, tag, bytes}, i == 0, payload + offset,
                             stripeOffset(bytes, count, i + 1) - offset, 0});
      if (i == 0 && s.sendQueue.size() == 1) {
        error = flushSends(peer, s, done);
        reset = !s.resetError.empty();
      }
      if (error.empty() && s.resetError.empty() && !s.sendQueue.empty() && !s.writeArmed) armWrite(s, true);
    }
  }
  for (auto& r : done) r->complete();
  if (!error.empty()) sendFailed(peer, error, reset);
  if (closed) {
    std::lock_guard<std::mutex> lock(mutex_);
    request->fail(!abortReason_.empty() ? abortReason_ : peers_[peer]->failure);
  }
  return request;
}

RequestPtr TcpTransport::irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo) {
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
  size_t delivered = 0;    // and its bytes
  const PostedRecv posted{tag, static_cast<char*>(data), bytes, request, upTo};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!abortReason_.empty()) {
      failure = abortReason_;
    } else {
      // A message that already arrived (or is arriving) matches first.
      for (int source = 0; source < size_ && found == Found::kNothing && failure.empty(); ++source) {
        if (source == rank_ || (peer != kAnySource && source != peer)) continue;
        Peer& p = *peers_[source];
        Unexpected* match = firstUnclaimed(p, tag);
        if (match == nullptr) continue;
        Unexpected& u = *match;
        const bool wrongCall = otherCall(u.tag, tag);
        const bool earlier = earlierCall(u.tag, tag);
        unindexUnexpected(p, u);
        if (wrongCall || earlier || !posted.fits(u.data.size())) {
          failure = wrongCall ? otherCallText(rankName(source))
                    : earlier ? earlierCallText(rankName(source), u.tag, tag)
                              : sizeMismatchText(rankName(source), u.data.size(), posted.bytes, posted.upTo);
          if (u.complete) {
            unexpectedBytes_ -= u.data.size();
            p.unexpected.erase(match->order);
          } else {  // claim it, so the rest of it is read and dropped
            u.claim = Unexpected::Claim::kDropped;
          }
        } else if (u.complete) {
          delivered = u.data.size();
          if (delivered > 0) std::memcpy(data, u.data.data(), delivered);
          unexpectedBytes_ -= u.data.size();
          p.unexpected.erase(match->order);
          found = Found::kDelivered;
          deliveredFrom = source;
        } else {
          u.claim = Unexpected::Claim::kWaiting;
          u.waiter = posted;
          found = Found::kClaimed;
        }
      }
      if (found == Found::kNothing && failure.empty()) {
        if (peer == kAnySource) {
          // Nothing can come once every peer is lost: fail now, not at the timeout.
          failure = everyPeerLostLocked();
          if (failure.empty()) anyPosted_.push_back(posted);
        } else if (!peers_[peer]->failure.empty()) {
          failure = peers_[peer]->failure;
        } else {
          peers_[peer]->posted.push_back(posted);
        }
      }
    }
  }
  if (!failure.empty()) {
    request->fail(failure);
  } else if (found == Found::kDelivered) {
    bytesReceived_ += delivered;
    Stats::instance().addReceived(delivered);
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
  const Unexpected* first = nullptr;
  for (const auto& [order, u] : p.unexpected)
    if (u->claim == Unexpected::Claim::kNone && ++unmatched == 1) first = u.get();
  if (unmatched > 0) {
    text = strCat(unmatched, " message(s) from ", rankName(peer), " arrived that no receive matched (first tag ",
                  tagText(first->tag), ", ", first->data.size(), " bytes)");
  } else {
    text = strCat("nothing arrived from ", rankName(peer), " for this operation");
  }
  if (p.parked)
    text += strCat("; ", rankName(peer), " announced a message of ", p.streams[0]->header.bytes, " bytes (tag ",
                   tagText(p.streams[0]->header.tag),
                   ") that no receive matched; it waits unread, since unexpected messages may hold at most ",
                   maxUnexpectedBytes_, " bytes (", unexpectedBytes_, " held)");
  text += strCat("; ", p.messagesIn.load(), " messages in and ", p.messagesOut.load(),
                 " out with it, ", p.posted.size(), " receive(s) posted");
  if (!p.posted.empty()) text += strCat(" (first tag ", tagText(p.posted.front().tag), ")");
  return text;
}

bool TcpTransport::matchIncoming(int peer) {
  Peer& p = *peers_[peer];
  Stream& s0 = *p.streams[0];
  const size_t bytes = s0.header.bytes;
  auto message = std::make_shared<Inbound>();
  message->bytes = bytes;
  s0.got = 0;
  if (s0.header.flags & kFlagAbort) {  // not data: the peer says why it is leaving
    message->abortNotice = true;
    p.noticeArriving = true;
    p.abortText.resize(bytes);
    message->dst = p.abortText.data();
    s0.current = Stripe{message, 0, bytes};
    return true;
  }
  RequestPtr mismatched;  // a receive of another size: it fails now, the payload is dropped
  std::string mismatch;
  const bool wasParked = p.parked;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto take = [&](std::deque<PostedRecv>& list) {
      for (auto it = list.begin(); it != list.end(); ++it) {
        const bool wrongCall = otherCall(it->tag, s0.header.tag);
        const bool earlier = earlierCall(s0.header.tag, it->tag);
        if (it->tag != s0.header.tag && !wrongCall && !earlier) continue;
        if (wrongCall || earlier || !it->fits(bytes)) {
          mismatched = it->request;
          mismatch = wrongCall ? otherCallText(rankName(peer))
                     : earlier ? earlierCallText(rankName(peer), s0.header.tag, it->tag)
                               : sizeMismatchText(rankName(peer), bytes, it->bytes, it->upTo);
          message->discarding = true;
        } else {
          message->request = it->request;
          message->dst = it->data;
        }
        list.erase(it);
        return true;
      }
      return false;
    };
    const bool placed = take(p.posted) || take(anyPosted_);
    const bool overBudget = !placed && (bytes > maxUnexpectedBytes_ - std::min(unexpectedBytes_, maxUnexpectedBytes_) ||
                                        p.unexpected.size() >= maxUnexpectedMessages_);
    if (overBudget != p.parked) {
      p.parked = overBudget;
      parkedPeers_ += overBudget ? 1 : -1;
    }
    if (!placed && !overBudget) {
      auto buffer = std::make_shared<Unexpected>();
      Stats::instance().addBuffered(bytes);
      buffer->tag = s0.header.tag;
      buffer->order = p.arrivals++;
      buffer->data.resize(bytes);
      unexpectedBytes_ += bytes;
      message->dst = buffer->data.data();
      message->buffer = buffer;
      indexUnexpected(p, buffer);
      p.unexpected.emplace(buffer->order, std::move(buffer));
    }
  }
  if (mismatched) mismatched->fail(mismatch);
  if (p.parked != wasParked) {
    std::lock_guard<std::mutex> lock(s0.mutex);
    pauseReads(s0, p.parked);
  }
  if (p.parked) return false;
  // Stripe 0 is read here; the others are queued on their streams, which read
  // them in this order.
  const int count = stripeCount(bytes, socketsPerPeer_);
  message->stripesLeft = count;
  s0.current = Stripe{message, 0, stripeOffset(bytes, count, 1)};
  for (int i = 1; i < count; ++i) {
    Stream& s = *p.streams[i];
    const size_t offset = stripeOffset(bytes, count, i);
    Stripe stripe{message, offset, stripeOffset(bytes, count, i + 1) - offset};
    bool dropped = false;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.stripesClosed) {
        dropped = true;
      } else {
        s.stripes.push_back(std::move(stripe));
        if (s.readPaused) pauseReads(s, false);
      }
    }
    if (dropped) dropStripe(peer, message);  // its stream is gone with its peer
  }
  return true;
}

namespace {

// A collective message's place for earlierCall: its tag space (bits 61-63) and
// sequence number (bits 0-31).
uint64_t sequenceKey(uint64_t tag) { return (tag >> 61) << 32 | (tag & 0xffffffffull); }

}  // namespace

void TcpTransport::indexUnexpected(Peer& p, const std::shared_ptr<Unexpected>& u) {
  p.unclaimedByCall[u->tag & ~kCallTagMask].push_back(u.get());
  if (u->tag >> 63) p.unclaimedBySequence.emplace(sequenceKey(u->tag), u.get());
  u->indexed = true;
}

void TcpTransport::unindexUnexpected(Peer& p, Unexpected& u) {
  if (!u.indexed) return;
  u.indexed = false;
  auto group = p.unclaimedByCall.find(u.tag & ~kCallTagMask);
  if (group != p.unclaimedByCall.end()) {
    auto& list = group->second;
    // Receives take messages in arrival order: the front, but for failures.
    auto it = std::find(list.begin(), list.end(), &u);
    if (it != list.end()) list.erase(it);
    if (list.empty()) p.unclaimedByCall.erase(group);
  }
  if (u.tag >> 63) {
    auto range = p.unclaimedBySequence.equal_range(sequenceKey(u.tag));
    for (auto it = range.first; it != range.second; ++it)
      if (it->second == &u) {
        p.unclaimedBySequence.erase(it);
        break;
      }
  }
}

TcpTransport::Unexpected* TcpTransport::firstUnclaimed(Peer& p, uint64_t tag) {
  Unexpected* first = nullptr;
  auto group = p.unclaimedByCall.find(tag & ~kCallTagMask);
  if (group != p.unclaimedByCall.end() && !group->second.empty()) first = group->second.front();
  if ((tag >> 63) && !p.unclaimedBySequence.empty()) {
    // Earlier collectives of the same space: sequence numbers 1 .. 2^31 - 1 behind
    // (mod 2^32), at most two ranges of keys.
    const uint64_t space = (tag >> 61) << 32;
    const uint32_t seq = static_cast<uint32_t>(tag);
    const uint32_t lo = seq - 0x7fffffffu, hi = seq - 1;
    auto earliest = [&](uint32_t from, uint32_t to) {
      auto it = p.unclaimedBySequence.lower_bound(space | from);
      if (it != p.unclaimedBySequence.end() && it->first <= (space | to) && earlierCall(it->second->tag, tag) &&
          (first == nullptr || it->second->order < first->order))
        first = it->second;
    };
    if (lo <= hi) {
      earliest(lo, hi);
    } else {
      earliest(lo, 0xffffffffu);
      earliest(0, hi);
    }
  }
  return first;
}

void TcpTransport::retryParked(int thread) {
  if (parkedPeers_.load(std::memory_order_acquire) == 0) return;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Peer& p = *peers_[peer];
    Stream& s0 = *p.streams[0];
    if (!p.parked || s0.thread != thread || s0.detached) continue;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!p.failure.empty()) continue;  // its hang-up is handled by the I/O loop
    }
    if (!matchIncoming(peer)) continue;  // still no receive and no budget
    startPayload(peer, s0);
    handleReadable(peer, 0);  // what waited in the socket
  }
}

void TcpTransport::dropStripe(int peer, const std::shared_ptr<Inbound>& message) {
  message->lost = true;
  if (message->stripesLeft.fetch_sub(1, std::memory_order_acq_rel) == 1) failLostMessage(peer, message);
}

void TcpTransport::failLostMessage(int peer, const std::shared_ptr<Inbound>& message) {
  // No stream writes into the message any more, so its receive may fail.
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Peer& p = *peers_[peer];
    failure = p.failure;
    if (message->buffer) {
      auto it = p.unexpected.find(message->buffer->order);
      if (it != p.unexpected.end() && it->second == message->buffer) {
        unindexUnexpected(p, *message->buffer);
        unexpectedBytes_ -= message->buffer->data.size();
        if (message->buffer->claim == Unexpected::Claim::kWaiting && !message->request)
          message->request = message->buffer->waiter.request;
        message->buffer->claim = Unexpected::Claim::kDropped;
        message->buffer->waiter = PostedRecv{};
        p.unexpected.erase(it);
      }
    }
  }
  if (message->request)
    message->request->fail(failure.empty() ? lostMessage(peer, "part of a message was lost") : failure);
}

void TcpTransport::finishIncoming(int peer, const std::shared_ptr<Inbound>& message) {
  Peer& p = *peers_[peer];
  if (message->abortNotice) {
    // The sender's reason comes without its op prefix (Error::detail()); the
    // receiver's own errors add theirs.
    const std::string reason = abortReasonText(p.abortText.data(), p.abortText.size());
    failPeer(peer, strCat(rankName(peer), " aborted the group: ", reason), true, 0);  // notices come on stream 0
    return;
  }
  if (message->discarding) return;  // its receive failed when the header arrived
  if (message->request) {
    bytesReceived_ += message->bytes;
    Stats::instance().addReceived(message->bytes);
    message->request->complete(peer);
    return;
  }
  const std::shared_ptr<Unexpected>& buffer = message->buffer;
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
      auto it = queue.find(buffer->order);
      if (it != queue.end() && it->second == buffer) {
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

void TcpTransport::detachStream(int peer, Stream& s) {
  Peer& p = *peers_[peer];
  s.detached = true;
  if (s.fd >= 0) epoll_ctl(io_[s.thread].epollFd, EPOLL_CTL_DEL, s.fd, nullptr);
  std::deque<Stripe> queued;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stripesClosed = true;
    queued.swap(s.stripes);
  }
  std::shared_ptr<Inbound> current = std::move(s.current.message);
  s.current = Stripe{};
  s.inPayload = false;
  s.inTag = false;
  s.tagGot = 0;
  s.headerGot = 0;
  s.got = 0;
  if (current) dropStripe(peer, current);
  for (auto& stripe : queued) dropStripe(peer, stripe.message);
  if (s.index == 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (p.parked) {
      p.parked = false;
      --parkedPeers_;
    }
  }
}

void TcpTransport::failPeer(int peer, const std::string& reason, bool fullMessage, int endedStream) {
  Peer& p = *peers_[peer];
  const bool leaving = endedStream >= 0;
  if (leaving && endedStream > 0) {
    // Headers come on stream 0 only: until it ends, the peer may still announce
    // (and send whole) messages there. Only this stream is done; a stripe it
    // was reading, or is yet to be given, is lost with it.
    bool failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed = !p.failure.empty();
    }
    if (!failed) {
      Stream& s = *p.streams[endedStream];
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (s.fd >= 0) ::shutdown(s.fd, SHUT_RDWR);
      }
      detachStream(peer, s);  // called by its own I/O thread
      return;
    }
  }
  std::vector<RequestPtr> failed;
  std::string message;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (p.failure.empty())
      p.failure = !abortReason_.empty() ? abortReason_ : fullMessage ? reason : lostMessage(peer, reason);
    message = p.failure;
    for (auto& posted : p.posted) failed.push_back(posted.request);
    p.posted.clear();
    // The last peer lost: receives from any source can no longer be met (a leaving
    // peer's complete messages were matched to them when they arrived or were posted).
    if (!everyPeerLostLocked().empty()) {
      for (auto& posted : anyPosted_) failed.push_back(posted.request);
      anyPosted_.clear();
    }
    // Complete messages stay deliverable; partial ones are lost with the peer.
    // An I/O thread may still be reading one (off that thread): a receive that
    // claimed it fails now and is detached, so the rest of the message is
    // dropped and never copied into that receive's buffer. A peer that is
    // leaving had written them whole or not: they complete, or fail when the
    // stream that carries their rest ends (failLostMessage).
    for (auto it = p.unexpected.begin(); it != p.unexpected.end() && !leaving;) {
      Unexpected& u = *it->second;
      if (u.complete) {
        ++it;
        continue;
      }
      if (u.claim == Unexpected::Claim::kWaiting) failed.push_back(u.waiter.request);
      unindexUnexpected(p, u);
      u.claim = Unexpected::Claim::kDropped;
      u.waiter = PostedRecv{};
      unexpectedBytes_ -= u.data.size();
      it = p.unexpected.erase(it);
    }
  }
  // Every stream: nothing more is written, and reads see the end (a leaving
  // peer's other streams: once it closes them, after what they still carry).
  for (auto& streamPtr : p.streams) {
    Stream& s = *streamPtr;
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto& send : s.sendQueue) failed.push_back(send.message->request);
    s.sendQueue.clear();
    if (s.fd >= 0) ::shutdown(s.fd, leaving && s.index != endedStream ? SHUT_WR : SHUT_RDWR);
  }
  // Each I/O thread gives up the receives in progress on the streams it owns
  // (a stripe's receive fails once no stream writes into it); the others are
  // woken by the hang-up and come here too.
  const int thread = currentIoThread();
  for (auto& streamPtr : p.streams) {
    Stream& s = *streamPtr;
    if (thread < 0 || s.thread != thread || s.detached) continue;
    if (leaving && s.index != endedStream) {
      bool carrying = s.current.message != nullptr;  // this thread's own reading state
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        carrying = carrying || !s.stripes.empty();
      }
      if (carrying) continue;  // read on; its end detaches it
    }
    detachStream(peer, s);
  }
  if (thread < 0) wake();
  for (auto& r : failed)
    if (r) r->fail(message);
}

void TcpTransport::sendFailed(int peer, const std::string& error, bool reset) {
  if (reset && noticeMayWait(peer)) return;
  failPeer(peer, error);
}

// A peer that aborts sends its notice on stream 0, then closes its sockets; one
// that still held bytes of ours unread resets the connection, and a write here
// can meet that reset before stream 0's I/O thread has read the notice. Linux
// hands a socket's queued bytes to recv before it reports the reset, so while
// stream 0 holds unread bytes and its reader is free to read them, the peer is
// left to that reader: it fails the peer with the notice's reason, or at the
// end of the stream if no notice came, and failPeer fails the sends queued here
// (which wait unwritten, resetError). The reset keeps stream 0 readable, so the
// reader gets there; if it parks before the end, the hang-up fails the peer.
// The reader may also have taken the notice's last bytes already and not yet
// failed the peer (noticeArriving, set before it reads the reason). When stream
// 0 holds nothing, or is parked, or the peer failed already, the peer fails now,
// as for any error (a send queued after failPeer emptied the queue gets here
// too: its flush returns the reset again).
bool TcpTransport::noticeMayWait(int peer) {
  Peer& p = *peers_[peer];
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!p.failure.empty() || p.parked) return false;
  }
  Stream& s0 = *p.streams[0];
  {
    std::lock_guard<std::mutex> lock(s0.mutex);
    int unread = 0;
    if (s0.fd >= 0 && !s0.readPaused && ::ioctl(s0.fd, FIONREAD, &unread) == 0 && unread > 0) return true;
  }
  // Checked after the socket: its last bytes are read only once this is set.
  return p.noticeArriving.load();
}

std::string TcpTransport::everyPeerLostLocked() const {
  std::string failure;
  for (int i = 0; i < size_; ++i) {
    if (i == rank_) continue;
    if (peers_[i]->failure.empty()) return "";
    if (failure.empty()) failure = peers_[i]->failure;
  }
  return failure;
}

std::string TcpTransport::lostMessage(int peer, const std::string& reason) const {
  return strCat(rankName(rank_), " lost the connection to ", rankName(peer), " (", reason, ")");
}

}  // namespace pycomm
