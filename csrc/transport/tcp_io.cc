// TcpTransport's I/O: the epoll loop of the I/O thread, reading each peer's
// stream (header, then payload into the place tcp_match.cc chose), writing the
// send queues, and the abort notices sent to peers.
#include "transport/tcp.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>

#include "common/stats.h"
#include "transport/tcp_socket.h"

namespace pycomm {

void TcpTransport::ioLoop() {
  epoll_event events[64];
  while (!stop_.load(std::memory_order_acquire)) {
    const int n = epoll_wait(epollFd_, events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kWakeId) {
        uint64_t value;
        ssize_t ignored = ::read(wakeFd_, &value, sizeof(value));
        (void)ignored;
        continue;
      }
      const int peer = static_cast<int>(events[i].data.u64);
      if (events[i].events & EPOLLOUT) handleWritable(peer);
      if (peers_[peer]->parked) {
        // Reads are paused; only a hang-up or an error is reported.
        if (events[i].events & (EPOLLHUP | EPOLLERR)) failPeer(peer, "the connection failed");
      } else if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        handleReadable(peer);
      }
    }
    retryParked();
  }
}

void TcpTransport::handleReadable(int peer) {
  Peer& p = *peers_[peer];
  while (p.fd >= 0) {
    ssize_t n;
    if (!p.inPayload) {
      n = ::recv(p.fd, reinterpret_cast<char*>(&p.header) + p.headerGot,
                 sizeof(WireHeader) - p.headerGot, MSG_DONTWAIT);
    } else if (p.discarding) {
      n = ::recv(p.fd, scratch_.data(), std::min(scratch_.size(), p.payloadBytes - p.payloadGot),
                 MSG_DONTWAIT);
    } else {
      n = ::recv(p.fd, p.dst + p.payloadGot, p.payloadBytes - p.payloadGot, MSG_DONTWAIT);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      failPeer(peer, n == 0 ? "the peer closed the connection" : errnoText(errno));
      return;
    }
    if (!p.inPayload) {
      p.headerGot += static_cast<size_t>(n);
      if (p.headerGot < sizeof(WireHeader)) continue;
      p.headerGot = 0;
      const std::string invalid = checkHeader(p.header);
      if (!invalid.empty()) {
        failPeer(peer, invalid);
        return;
      }
      ++p.messagesIn;
      if (!matchIncoming(peer)) return;  // parked: retryParked() goes on from here
      if (p.payloadBytes == 0) finishIncoming(peer);
      else p.inPayload = true;
    } else {
      p.payloadGot += static_cast<size_t>(n);
      if (p.payloadGot == p.payloadBytes) finishIncoming(peer);
    }
  }
}

void TcpTransport::handleWritable(int peer) {
  std::vector<RequestPtr> done;
  std::string error;
  {
    Peer& p = *peers_[peer];
    std::lock_guard<std::mutex> lock(p.sendMutex);
    if (p.fd < 0) return;
    error = flushSends(peer, done);
    if (error.empty() && p.sendQueue.empty() && p.writeArmed) armWrite(peer, false);
  }
  for (auto& r : done) r->complete();
  if (!error.empty()) failPeer(peer, error);
}

std::string TcpTransport::flushSends(int peer, std::vector<RequestPtr>& done) {
  Peer& p = *peers_[peer];
  while (!p.sendQueue.empty()) {
    PendingSend& s = p.sendQueue.front();
    iovec iov[2];
    int count = 0;
    const size_t headerBytes = sizeof(WireHeader);
    if (s.written < headerBytes) {
      iov[count].iov_base = reinterpret_cast<char*>(&s.header) + s.written;
      iov[count].iov_len = headerBytes - s.written;
      ++count;
    }
    const size_t payloadDone = s.written > headerBytes ? s.written - headerBytes : 0;
    if (s.bytes > payloadDone) {
      iov[count].iov_base = const_cast<char*>(s.data) + payloadDone;
      iov[count].iov_len = s.bytes - payloadDone;
      ++count;
    }
    ssize_t n = 0;
    if (count > 0) {
      msghdr message{};
      message.msg_iov = iov;
      message.msg_iovlen = count;
      n = ::sendmsg(p.fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
        return errnoText(errno);
      }
    }
    s.written += static_cast<size_t>(n);
    if (s.written == headerBytes + s.bytes) {
      bytesSent_ += s.bytes;
      Stats::instance().addSent(s.bytes);
      ++p.messagesOut;
      done.push_back(std::move(s.request));
      p.sendQueue.pop_front();
    }
  }
  return "";
}

void TcpTransport::armWrite(int peer, bool on) {
  Peer& p = *peers_[peer];
  p.writeArmed = on;
  epoll_event event{};
  event.events = (p.readPaused ? 0 : EPOLLIN) | (on ? EPOLLOUT : 0);
  event.data.u64 = static_cast<uint64_t>(peer);
  epoll_ctl(epollFd_, EPOLL_CTL_MOD, p.fd, &event);
}

void TcpTransport::pauseReads(int peer, bool paused) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lock(p.sendMutex);
  if (p.fd < 0) return;
  p.readPaused = paused;
  armWrite(peer, p.writeArmed);
}

void TcpTransport::wake() {
  std::lock_guard<std::mutex> lock(mutex_);  // abort() closes wakeFd_ under it
  if (wakeFd_ < 0) return;
  uint64_t one = 1;
  ssize_t ignored = ::write(wakeFd_, &one, sizeof(one));
  (void)ignored;
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
    std::lock_guard<std::mutex> lock(p.sendMutex);
    // Only between messages: a notice inside a half-written payload would be garbage.
    if (p.fd < 0 || (!p.sendQueue.empty() && p.sendQueue.front().written > 0)) continue;
    WireHeader header{kDataMagic, kFlagAbort, 0, text.size()};
    iovec iov[2] = {{&header, sizeof(header)}, {const_cast<char*>(text.data()), text.size()}};
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = 2;
    ssize_t ignored = ::sendmsg(p.fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort
    (void)ignored;
  }
}

}  // namespace pycomm
