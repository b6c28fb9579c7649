// TcpTransport's lifecycle: construction (connect the mesh, then hand the
// streams to the I/O threads), abort and destruction. Connection setup is in
// tcp_connect.cc, the I/O threads in tcp_io.cc, posting and matching in tcp_match.cc.
#include "transport/tcp.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "common/error.h"
#include "transport/tcp_socket.h"

namespace pycomm {

TcpTransport::TcpTransport(int rank, int size, KeyValueStore& store, const TcpOptions& options,
                           std::vector<int> globalRanks)
    : rank_(rank), size_(size), maxUnexpectedBytes_(options.maxUnexpectedBytes),
      maxUnexpectedMessages_(options.maxUnexpectedMessages) {
  PYCOMM_CHECK_USAGE(options.socketsPerPeer >= 1 && options.socketsPerPeer <= kMaxStreams,
                     "pycomm: sockets per peer must be in 1..", kMaxStreams, " (PYCOMM_SOCKETS_PER_PEER), not ",
                     options.socketsPerPeer);
  PYCOMM_CHECK_USAGE(options.wire == kWireNone || options.wire == kWireIntegrity, "pycomm: unknown wire mode ",
                     options.wire);
  wire_ = options.wire;
  PYCOMM_CHECK_USAGE(options.ioThreads >= 1 && options.ioThreads <= kMaxIoThreads,
                     "pycomm: I/O threads must be in 1..", kMaxIoThreads, " (PYCOMM_IO_THREADS), not ",
                     options.ioThreads);
  setGlobalRanks(std::move(globalRanks));
  for (int i = 0; i < size; ++i) peers_.push_back(std::make_unique<Peer>());
  auto closeAll = [this] {
    for (auto& peer : peers_)
      for (auto& s : peer->streams)
        if (s->fd >= 0) ::close(s->fd);
    if (listenFd_ >= 0) ::close(listenFd_);
  };
  try {
    connectMesh(store, options);  // sets socketsPerPeer_ and every stream's fd
  } catch (...) {
    closeAll();
    throw;
  }
  // No more threads than streams; streams go round-robin over them, so each
  // peer's streams land on different threads.
  const int streams = (size_ - 1) * socketsPerPeer_;
  io_.resize(static_cast<size_t>(std::max(1, std::min(options.ioThreads, streams))));
  for (auto& t : io_) {
    t.epollFd = epoll_create1(EPOLL_CLOEXEC);
    t.wakeFd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    t.scratch.resize(1 << 16);
    if (t.epollFd < 0 || t.wakeFd < 0) {
      const int err = errno;
      closeAll();
      for (auto& u : io_) {
        if (u.epollFd >= 0) ::close(u.epollFd);
        if (u.wakeFd >= 0) ::close(u.wakeFd);
      }
      PYCOMM_CHECK_INTERNAL(false, "epoll/eventfd: ", errnoText(err));
    }
    epoll_event wakeEvent{};
    wakeEvent.events = EPOLLIN;
    wakeEvent.data.u64 = kWakeId;
    epoll_ctl(t.epollFd, EPOLL_CTL_ADD, t.wakeFd, &wakeEvent);
  }
  int next = 0;
  for (int k = 0; k < socketsPerPeer_; ++k)
    for (int i = 0; i < size_; ++i) {
      if (i == rank_) continue;
      Stream& s = *peers_[i]->streams[k];
      s.thread = next++ % static_cast<int>(io_.size());
      setNonBlocking(s.fd);
      setNoDelay(s.fd);
      // Streams > 0 are read only when stream 0 announced a stripe for them.
      s.readPaused = k > 0;
      epoll_event event{};
      event.events = s.readPaused ? 0 : EPOLLIN;
      event.data.u64 = eventId(i, k);
      epoll_ctl(io_[s.thread].epollFd, EPOLL_CTL_ADD, s.fd, &event);
    }
  for (int t = 0; t < static_cast<int>(io_.size()); ++t) io_[t].thread = std::thread([this, t] { ioLoop(t); });
}

TcpTransport::~TcpTransport() {
  abort("the process group was destroyed");
  if (listenFd_ >= 0) ::close(listenFd_);
}

int TcpTransport::currentIoThread() const {
  const auto self = std::this_thread::get_id();
  for (int t = 0; t < static_cast<int>(io_.size()); ++t)
    if (io_[t].thread.get_id() == self) return t;
  return -1;
}

void TcpTransport::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abortReason_.empty()) abortReason_ = reason.empty() ? "aborted" : reason;
  }
  // Stop the I/O threads first: after this nothing writes into user buffers.
  stop_.store(true, std::memory_order_release);
  wake();
  for (auto& t : io_) {
    if (!t.thread.joinable()) continue;
    if (std::this_thread::get_id() == t.thread.get_id()) {
      t.thread.detach();
    } else {
      t.thread.join();
    }
  }
  sendAbortNotices(abortReason_);
  std::vector<RequestPtr> failed;
  std::string message;
  auto failStripe = [&](const Stripe& stripe) {
    if (stripe.message && stripe.message->request) failed.push_back(stripe.message->request);
  };
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
      for (auto& [order, u] : p.unexpected)
        if (u->claim == Unexpected::Claim::kWaiting) failed.push_back(u->waiter.request);
      p.unexpected.clear();
      p.unclaimedByCall.clear();
      p.unclaimedBySequence.clear();
      p.parked = false;
    }
  }
  for (auto& peerPtr : peers_) {
    for (auto& streamPtr : peerPtr->streams) {
      Stream& s = *streamPtr;
      std::lock_guard<std::mutex> lock(s.mutex);
      // The I/O threads are gone (or this is one, leaving): their stripes too.
      failStripe(s.current);
      s.current = Stripe{};
      for (auto& stripe : s.stripes) failStripe(stripe);
      s.stripes.clear();
      for (auto& send : s.sendQueue) failed.push_back(send.message->request);
      s.sendQueue.clear();
      if (s.fd >= 0) {
        ::close(s.fd);
        s.fd = -1;
      }
    }
  }
  // Nothing polls any more: release the epoll and wake descriptors now, not when
  // the last Work holding this transport goes away.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& t : io_) {
      if (t.epollFd >= 0) ::close(t.epollFd);
      if (t.wakeFd >= 0) ::close(t.wakeFd);
      t.epollFd = t.wakeFd = -1;
    }
  }
  for (auto& r : failed)
    if (r) r->fail(message);
}

}  // namespace pycomm
