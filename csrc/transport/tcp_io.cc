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
    if (k == 0 && !s.inPayload) {
      n = ::recv(s.fd, reinterpret_cast<char*>(&s.header) + s.headerGot, sizeof(WireHeader) - s.headerGot,
                 MSG_DONTWAIT);
    } else if (s.current.message->discarding) {
      n = ::recv(s.fd, scratch.data(), std::min(scratch.size(), s.current.bytes - s.got), MSG_DONTWAIT);
    } else {
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
    if (k == 0 && !s.inPayload) {
      s.headerGot += static_cast<size_t>(n);
      if (s.headerGot < sizeof(WireHeader)) continue;
      s.headerGot = 0;
      const std::string invalid = checkHeader(s.header);
      if (!invalid.empty()) {
        failPeer(peer, invalid);
        return;
      }
      ++p.messagesIn;
      if (!matchIncoming(peer)) return;  // parked: retryParked() goes on from here
      if (s.current.bytes == 0) finishStripe(peer, s);
      else s.inPayload = true;
    } else {
      s.got += static_cast<size_t>(n);
      if (s.got == s.current.bytes) finishStripe(peer, s);
    }
  }
}

void TcpTransport::finishStripe(int peer, Stream& s) {
  std::shared_ptr<Inbound> message = std::move(s.current.message);
  s.current = Stripe{};
  s.inPayload = false;
  s.got = 0;
  if (!message || message->stripesLeft.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (message->lost) failLostMessage(peer, message);  // another stream lost its stripe
  else finishIncoming(peer, message);
}

void TcpTransport::handleWritable(int peer, int k) {
  std::vector<RequestPtr> done;
  std::string error;
  {
    Stream& s = *peers_[peer]->streams[k];
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.fd < 0) return;
    error = flushSends(peer, s, done);
    if (error.empty() && s.sendQueue.empty() && s.writeArmed) armWrite(s, false);
  }
  for (auto& r : done) r->complete();
  if (!error.empty()) failPeer(peer, error);
}

std::string TcpTransport::flushSends(int peer, Stream& s, std::vector<RequestPtr>& done) {
  Peer& p = *peers_[peer];
  while (!s.sendQueue.empty()) {
    PendingSend& send = s.sendQueue.front();
    iovec iov[2];
    int count = 0;
    const size_t headerBytes = send.withHeader ? sizeof(WireHeader) : 0;
    if (send.written < headerBytes) {
      iov[count].iov_base = reinterpret_cast<char*>(&send.header) + send.written;
      iov[count].iov_len = headerBytes - send.written;
      ++count;
    }
    const size_t payloadDone = send.written > headerBytes ? send.written - headerBytes : 0;
    if (send.bytes > payloadDone) {
      iov[count].iov_base = const_cast<char*>(send.data) + payloadDone;
      iov[count].iov_len = send.bytes - payloadDone;
      ++count;
    }
    ssize_t n = 0;
    if (count > 0) {
      msghdr message{};
      message.msg_iov = iov;
      message.msg_iovlen = count;
      n = ::sendmsg(s.fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
        return errnoText(errno);
      }
    }
    send.written += static_cast<size_t>(n);
    if (send.written == headerBytes + send.bytes) {
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
    if (s.fd < 0 || (!s.sendQueue.empty() && s.sendQueue.front().written > 0)) continue;
    WireHeader header{kDataMagic, kFlagAbort, 0, text.size()};
    iovec iov[2] = {{&header, sizeof(header)}, {const_cast<char*>(text.data()), text.size()}};
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = 2;
    ssize_t ignored = ::sendmsg(s.fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort
    (void)ignored;
  }
}

}  // namespace pycomm
