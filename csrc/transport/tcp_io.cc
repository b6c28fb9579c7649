// TcpTransport's I/O: the epoll loop of each I/O thread, reading each stream
// (on stream 0 a header, then a stripe; on the others the stripes stream 0
// announced, in order) into the place tcp_match.cc chose, writing the send
// queues, and the abort notices sent to peers.
#include "transport/tcp.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>

#include "common/error.h"
#include "common/stats.h"
#include "common/thread_name.h"
#include "transport/tcp_socket.h"

namespace pycomm {

void TcpTransport::ioLoop(int thread) {
  nameThisThread("pycomm-io" + std::to_string(thread));
  epoll_event events[64];
  const int epollFd = io_[thread].epollFd;
  const int wakeFd = io_[thread].wakeFd;
  while (!stop_.load(std::memory_order_acquire)) {
    const int n = epoll_wait(epollFd, events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kWakeId) {
        uint64_t value;
        ssize_t ignored = ::read(wakeFd, &value, sizeof(value));
        (void)ignored;
        continue;
      }
      const int peer = static_cast<int>(events[i].data.u64 / kMaxStreams);
      const int k = static_cast<int>(events[i].data.u64 % kMaxStreams);
      Stream& s = *peers_[peer]->streams[k];
      if (s.detached) continue;
      if (events[i].events & EPOLLOUT) handleWritable(peer, k);
      if (k == 0 && peers_[peer]->parked) {
        // Reads are paused; only a hang-up or an error is reported.
        if (events[i].events & (EPOLLHUP | EPOLLERR)) failPeer(peer, "the connection failed");
      } else if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        handleReadable(peer, k);
      }
    }
    retryParked(thread);
  }
}

void TcpTransport::handleReadable(int peer, int k) {
  Peer& p = *peers_[peer];
  Stream& s = *p.streams[k];
  std::vector<char>& scratch = io_[s.thread].scratch;
  while (!s.detached) {
    if (k > 0 && !s.current.message) {
      // The next stripe stream 0 announced; none yet: stop reading (the kernel
      // holds what arrives), unless the connection broke.
      bool have = false;
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (!s.stripes.empty()) {
          s.current = std::move(s.stripes.front());
          s.stripes.pop_front();
          s.got = 0;
          have = true;
        }
      }
      if (have && s.recvMac) beginFrame(*s.recvMac, s.recvSequence++, FrameKind::kPayload);
      if (!have) {
        char byte;
        const ssize_t n = ::recv(s.fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
          if (n == 0) failPeer(peer, "the peer closed the connection", false, k);
          else failPeer(peer, errnoText(errno));
          return;
        }
        std::lock_guard<std::mutex> lock(s.mutex);
        if (s.stripes.empty()) pauseReads(s, true);
        else continue;
        return;
      }
    }
    ssize_t n;
    const char* landed = nullptr;  // where payload bytes went (for the frame MAC)
    if (s.inTag) {
      n = ::recv(s.fd, s.tag + s.tagGot, kFrameTagBytes - s.tagGot, MSG_DONTWAIT);
    } else if (k == 0 && !s.inPayload) {
      n = ::recv(s.fd, reinterpret_cast<char*>(&s.header) + s.headerGot, sizeof(WireHeader) - s.headerGot,
                 MSG_DONTWAIT);
    } else if (s.current.message->discarding) {
      landed = scratch.data();
      n = ::recv(s.fd, scratch.data(), std::min(scratch.size(), s.current.bytes - s.got), MSG_DONTWAIT);
    } else {
      landed = s.current.message->dst + s.current.offset + s.got;
      n = ::recv(s.fd, s.current.message->dst + s.current.offset + s.got, s.current.bytes - s.got,
                 MSG_DONTWAIT);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      if (n == 0) failPeer(peer, "the peer closed the connection", false, k);
      else failPeer(peer, errnoText(errno));
      return;
    }
    const bool headerPhase = k == 0 && !s.inPayload;
    if (s.inTag) {
      s.tagGot += static_cast<size_t>(n);
      if (s.tagGot < kFrameTagBytes) continue;
      s.inTag = false;
      s.tagGot = 0;
      if (!checkFrameTag(peer, s)) return;
      if (!headerPhase) {
        finishStripe(peer, s);
        continue;
      }
    } else if (headerPhase) {
      s.headerGot += static_cast<size_t>(n);
      if (s.headerGot < sizeof(WireHeader)) continue;
      s.headerGot = 0;
      if (s.recvMac) {  // the header's tag first: nothing acts on a header before it checks
        beginFrame(*s.recvMac, s.recvSequence++, FrameKind::kHeader);
        s.recvMac->update(&s.header, sizeof(WireHeader));
        s.inTag = true;
        continue;
      }
    } else {
      if (s.recvMac) s.recvMac->update(landed, static_cast<size_t>(n));
      s.got += static_cast<size_t>(n);
      if (s.got == s.current.bytes) {
        if (s.recvMac) s.inTag = true;
        else finishStripe(peer, s);
      }
      continue;
    }
    // A whole header (and its tag, with wire integrity).
    const std::string invalid = checkHeader(s.header);
    if (!invalid.empty()) {
      failPeer(peer, invalid);
      return;
    }
    ++p.messagesIn;
    if (!matchIncoming(peer)) return;  // parked: retryParked() goes on from here
    startPayload(peer, s);
  }
}

void TcpTransport::startPayload(int peer, Stream& s) {
  if (s.recvMac) {
    beginFrame(*s.recvMac, s.recvSequence++, FrameKind::kPayload);
    s.inPayload = true;
    if (s.current.bytes == 0) s.inTag = true;  // an empty payload still has its tag
    return;
  }
  if (s.current.bytes == 0) finishStripe(peer, s);
  else s.inPayload = true;
}

bool TcpTransport::checkFrameTag(int peer, Stream& s) {
  uint8_t expected[kFrameTagBytes];
  s.recvMac->final(expected);
  if (constantTimeEqual(expected, s.tag, kFrameTagBytes)) return true;
  failPeer(peer,
           strCat(rankName(rank_), " received bytes from ", rankName(peer), " (stream ", s.index, ", frame ",
                  s.recvSequence - 1, ") that fail their integrity check: altered, dropped or replayed in transit; ",
                  "the connection to ", rankName(peer), " is closed"),
           true);
  return false;
}

void TcpTransport::finishStripe(int peer, Stream& s) {
  std::shared_ptr<Inbound> message = std::move(s.current.message);
  s.current = Stripe{};
  s.inPayload = false;
  s.inTag = false;
  s.got = 0;
  if (!message || message->stripesLeft.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (message->lost) failLostMessage(peer, message);  // another stream lost its stripe
  else finishIncoming(peer, message);
}

void TcpTransport::handleWritable(int peer, int k) {
  std::vector<RequestPtr> done;
  std::string error;
  bool reset = false;
  {
    Stream& s = *peers_[peer]->streams[k];
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.fd < 0) return;
    error = flushSends(peer, s, done);
    reset = !s.resetError.empty();
    if ((s.sendQueue.empty() || reset) && s.writeArmed) armWrite(s, false);
  }
  for (auto& r : done) r->complete();
  if (!error.empty()) sendFailed(peer, error, reset);
}

std::string TcpTransport::flushSends(int peer, Stream& s, std::vector<RequestPtr>& done) {
  Peer& p = *peers_[peer];
  HmacSha256* mac = s.sendMac.get();
  const size_t tagBytes = mac ? kFrameTagBytes : 0;
  if (!s.resetError.empty()) return s.resetError;
  while (!s.sendQueue.empty()) {
    PendingSend& send = s.sendQueue.front();
    // On the wire: [header, its tag] (stream 0), payload, [its tag] (tags with wire integrity).
    const size_t headerBytes = send.withHeader ? sizeof(WireHeader) + tagBytes : 0;
    const size_t total = headerBytes + send.bytes + tagBytes;
    if (mac && !send.macStarted) {
      send.macStarted = true;
      if (send.withHeader) {
        beginFrame(*mac, s.sendSequence++, FrameKind::kHeader);
        mac->update(&send.header, sizeof(WireHeader));
        mac->final(send.headerTag);
      }
      beginFrame(*mac, s.sendSequence++, FrameKind::kPayload);
    }
    if (mac && !send.tagReady && send.macked == send.bytes) {
      mac->final(send.payloadTag);
      send.tagReady = true;
    }
    iovec iov[4];
    int count = 0;
    // The part of wire bytes [begin, end) not yet written, from `base`.
    auto add = [&](const void* base, size_t begin, size_t end) {
      if (send.written >= end || begin == end) return;
      const size_t from = std::max(send.written, begin);
      iov[count].iov_base = const_cast<char*>(static_cast<const char*>(base)) + (from - begin);
      iov[count].iov_len = end - from;
      ++count;
    };
    if (send.withHeader) {
      add(&send.header, 0, sizeof(WireHeader));
      if (mac) add(send.headerTag, sizeof(WireHeader), headerBytes);
    }
    add(send.data, headerBytes, headerBytes + send.bytes);
    if (mac && send.tagReady) add(send.payloadTag, headerBytes + send.bytes, total);
    ssize_t n = 0;
    if (count > 0) {
      msghdr message{};
      message.msg_iov = iov;
      message.msg_iovlen = count;
      n = ::sendmsg(s.fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
        if (errno != EPIPE && errno != ECONNRESET) return errnoText(errno);
        s.resetError = errnoText(errno);
        return s.resetError;
      }
    }
    send.written += static_cast<size_t>(n);
    if (mac) {  // the payload bytes just written, into its MAC (still in cache)
      const size_t payloadDone =
          send.written > headerBytes ? std::min(send.written - headerBytes, send.bytes) : 0;
      if (payloadDone > send.macked) {
        mac->update(send.data + send.macked, payloadDone - send.macked);
        send.macked = payloadDone;
      }
    }
    if (send.written == total) {
      std::shared_ptr<Outbound> message = std::move(send.message);
      s.sendQueue.pop_front();
      if (message->stripesLeft.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        bytesSent_ += message->bytes;
        Stats::instance().addSent(message->bytes);
        ++p.messagesOut;
        done.push_back(std::move(message->request));
      }
    }
  }
  return "";
}

void TcpTransport::armWrite(Stream& s, bool on) {
  s.writeArmed = on;
  if (s.fd < 0) return;
  epoll_event event{};
  event.events = (s.readPaused ? 0 : EPOLLIN) | (on ? EPOLLOUT : 0);
  event.data.u64 = eventId(s.peer, s.index);
  epoll_ctl(io_[s.thread].epollFd, EPOLL_CTL_MOD, s.fd, &event);
}

void TcpTransport::pauseReads(Stream& s, bool paused) {
  if (s.fd < 0) return;
  s.readPaused = paused;
  armWrite(s, s.writeArmed);
}

void TcpTransport::wake() {
  std::lock_guard<std::mutex> lock(mutex_);  // abort() closes the wake descriptors under it
  for (auto& t : io_) {
    if (t.wakeFd < 0) continue;
    uint64_t one = 1;
    ssize_t ignored = ::write(t.wakeFd, &one, sizeof(one));
    (void)ignored;
  }
}

void TcpTransport::sendAbortNotices(const std::string& reason) {
  const std::string text = reason.substr(0, kMaxAbortReasonBytes);
  for (int i = 0; i < size_; ++i) {
    if (i == rank_) continue;
    Peer& p = *peers_[i];
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!p.failure.empty()) continue;  // it is gone, or told us it is leaving
    }
    Stream& s = *p.streams[0];  // headers travel on stream 0
    std::lock_guard<std::mutex> lock(s.mutex);
    // Only between messages: a notice inside a half-written payload would be garbage.
    if (s.fd < 0 || (!s.sendQueue.empty() && (s.sendQueue.front().written > 0 || s.sendQueue.front().macStarted)))
      continue;
    WireHeader header{kDataMagic, kFlagAbort, 0, text.size()};
    uint8_t headerTag[kFrameTagBytes], textTag[kFrameTagBytes];
    if (s.sendMac) {  // the same frames as any message's, with their tags
      beginFrame(*s.sendMac, s.sendSequence++, FrameKind::kHeader);
      s.sendMac->update(&header, sizeof(header));
      s.sendMac->final(headerTag);
      beginFrame(*s.sendMac, s.sendSequence++, FrameKind::kPayload);
      s.sendMac->update(text.data(), text.size());
      s.sendMac->final(textTag);
    }
    iovec iov[4] = {{&header, sizeof(header)}, {headerTag, kFrameTagBytes},
                    {const_cast<char*>(text.data()), text.size()}, {textTag, kFrameTagBytes}};
    if (!s.sendMac) iov[1] = iov[2];
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = s.sendMac ? 4 : 2;
    ssize_t ignored = ::sendmsg(s.fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort
    (void)ignored;
  }
}

}  // namespace pycomm
