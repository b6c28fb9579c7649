// TcpTransport's lifecycle: construction (connect the mesh, then hand the
// sockets to the I/O thread), abort and destruction. Connection setup is in
// tcp_connect.cc, the I/O thread in tcp_io.cc, posting and matching in tcp_match.cc.
#include "transport/tcp.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "common/error.h"
#include "transport/tcp_socket.h"

namespace pycomm {

TcpTransport::TcpTransport(int rank, int size, KeyValueStore& store, const TcpOptions& options,
                           std::vector<int> globalRanks)
    : rank_(rank), size_(size), maxUnexpectedBytes_(options.maxUnexpectedBytes), scratch_(1 << 16) {
  setGlobalRanks(std::move(globalRanks));
  for (int i = 0; i < size; ++i) peers_.push_back(std::make_unique<Peer>());
  epollFd_ = epoll_create1(EPOLL_CLOEXEC);
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  PYCOMM_CHECK_INTERNAL(epollFd_ >= 0 && wakeFd_ >= 0, "epoll/eventfd: ", errnoText(errno));
  epoll_event wakeEvent{};
  wakeEvent.events = EPOLLIN;
  wakeEvent.data.u64 = kWakeId;
  epoll_ctl(epollFd_, EPOLL_CTL_ADD, wakeFd_, &wakeEvent);
  try {
    connectMesh(store, options);
  } catch (...) {
    for (auto& peer : peers_)
      if (peer->fd >= 0) ::close(peer->fd);
    if (listenFd_ >= 0) ::close(listenFd_);
    ::close(epollFd_);
    ::close(wakeFd_);
    throw;
  }
  for (int i = 0; i < size_; ++i) {
    if (i == rank_) continue;
    setNonBlocking(peers_[i]->fd);
    setNoDelay(peers_[i]->fd);
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = static_cast<uint64_t>(i);
    epoll_ctl(epollFd_, EPOLL_CTL_ADD, peers_[i]->fd, &event);
  }
  ioThread_ = std::thread([this] { ioLoop(); });
}

TcpTransport::~TcpTransport() {
  abort("the process group was destroyed");
  if (listenFd_ >= 0) ::close(listenFd_);
}

void TcpTransport::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abortReason_.empty()) abortReason_ = reason.empty() ? "aborted" : reason;
  }
  // Stop the I/O thread first: after this nothing writes into user buffers.
  stop_.store(true, std::memory_order_release);
  wake();
  if (ioThread_.joinable()) {
    if (std::this_thread::get_id() == ioThread_.get_id()) ioThread_.detach();
    else ioThread_.join();
  }
  sendAbortNotices(abortReason_);
  std::vector<RequestPtr> failed;
  std::string message;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    message = abortReason_;
    for (auto& posted : anyPosted_) failed.push_back(posted.request);
    anyPosted_.clear();
    unexpectedBytes_ = 0;
    parkedPeers_ = 0;
    for (auto& peerPtr : peers_) {
      Peer& p = *peerPtr;
      if (p.failure.empty()) p.failure = message;
      for (auto& posted : p.posted) failed.push_back(posted.request);
      p.posted.clear();
      for (auto& u : p.unexpected)
        if (u->claim == Unexpected::Claim::kWaiting) failed.push_back(u->waiter.request);
      p.unexpected.clear();
      p.parked = false;
      if (p.recvRequest) failed.push_back(p.recvRequest);
      p.recvRequest.reset();
      p.recvBuffer.reset();
    }
  }
  for (auto& peerPtr : peers_) {
    Peer& p = *peerPtr;
    std::lock_guard<std::mutex> lock(p.sendMutex);
    for (auto& send : p.sendQueue) failed.push_back(send.request);
    p.sendQueue.clear();
    if (p.fd >= 0) {
      ::close(p.fd);
      p.fd = -1;
    }
  }
  // Nothing polls any more: release the epoll and wake descriptors now, not when
  // the last Work holding this transport goes away.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (epollFd_ >= 0 && !ioThread_.joinable()) {
      ::close(epollFd_);
      ::close(wakeFd_);
      epollFd_ = wakeFd_ = -1;
    }
  }
  for (auto& r : failed)
    if (r) r->fail(message);
}

}  // namespace pycomm
