#include "transport/tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "common/error.h"
#include "common/logging.h"
#include "common/stats.h"

namespace pycomm {
namespace {

constexpr uint64_t kWakeId = ~0ull;

std::string toHex(const uint8_t* data, size_t bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string text;
  for (size_t i = 0; i < bytes; ++i) {
    text.push_back(digits[data[i] >> 4]);
    text.push_back(digits[data[i] & 15]);
  }
  return text;
}

bool fromHex(const std::string& text, uint8_t* data, size_t bytes) {
  if (text.size() != 2 * bytes) return false;
  auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < bytes; ++i) {
    const int hi = value(text[2 * i]), lo = value(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    data[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return true;
}

std::string errnoText(int err) { return std::strerror(err); }

int remainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Parses a numeric IPv4/IPv6 address and port into `storage`.
socklen_t makeAddress(const std::string& host, int port, sockaddr_storage& storage) {
  std::memset(&storage, 0, sizeof(storage));
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    return sizeof(sockaddr_in);
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    return sizeof(sockaddr_in6);
  }
  throwError(ErrorKind::kUsage, "pycomm: '", host,
             "' is not a numeric IP address (PYCOMM_SOCKET_IFNAME / bind address)");
}

// Blocking exchange helpers for the bootstrap (deadline-bounded).
void sendAll(int fd, const void* data, size_t bytes, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    pollfd pfd{fd, POLLOUT, 0};
    if (poll(&pfd, 1, remainingMs(deadline)) <= 0)
      throwError(ErrorKind::kTimeout, "timed out sending the connection hello");
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throwError(ErrorKind::kConnection, "send failed during connection setup: ", errnoText(errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

bool recvAll(int fd, void* data, size_t bytes, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, remainingMs(deadline)) <= 0) return false;
    ssize_t n = ::recv(fd, p, bytes, 0);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

TcpTransport::TcpTransport(int rank, int size, KeyValueStore& store, const TcpOptions& options,
                           std::vector<int> globalRanks)
    : rank_(rank), size_(size), scratch_(1 << 16) {
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

void TcpTransport::connectMesh(KeyValueStore& store, const TcpOptions& options) {
  const auto deadline = Clock::now() + options.connectTimeout;
  // The job secret: rank 0 draws it, everyone reads it from the store, and a
  // connection is accepted only from a peer that presents it.
  const std::string secretKey = options.storePrefix + "secret";
  if (rank_ == 0) {
    std::random_device entropy;
    for (size_t i = 0; i < kSecretBytes; ++i) secret_[i] = static_cast<uint8_t>(entropy());
    store.set(secretKey, toHex(secret_, kSecretBytes));
  } else if (!fromHex(store.get(secretKey), secret_, kSecretBytes)) {
    throwError(ErrorKind::kConnection, "pycomm: the job secret in the store is malformed");
  }
  sockaddr_storage address;
  socklen_t length = makeAddress(options.bindAddress, 0, address);
  listenFd_ = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  PYCOMM_CHECK_INTERNAL(listenFd_ >= 0, "socket: ", errnoText(errno));
  int one = 1;
  setsockopt(listenFd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listenFd_, reinterpret_cast<sockaddr*>(&address), length) != 0)
    throwError(ErrorKind::kConnection, "pycomm: cannot listen on ", options.bindAddress, ": ",
               errnoText(errno));
  if (::listen(listenFd_, std::max(size_, 16)) != 0)
    throwError(ErrorKind::kConnection, "pycomm: listen failed: ", errnoText(errno));
  length = sizeof(address);
  getsockname(listenFd_, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = address.ss_family == AF_INET
                       ? ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port)
                       : ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  store.set(options.storePrefix + "addr/" + std::to_string(rank_),
            options.bindAddress + " " + std::to_string(port));

  // Connect to every lower rank (their listeners exist: they published after listen()).
  for (int peer = 0; peer < rank_; ++peer) {
    const std::string entry = store.get(options.storePrefix + "addr/" + std::to_string(peer));
    const auto space = entry.rfind(' ');
    const std::string host = entry.substr(0, space);
    const int peerPort = std::stoi(entry.substr(space + 1));
    sockaddr_storage peerAddress;
    const socklen_t peerLength = makeAddress(host, peerPort, peerAddress);
    int fd = -1;
    while (true) {
      fd = ::socket(peerAddress.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&peerAddress), peerLength) == 0) break;
      const int err = errno;
      ::close(fd);
      if (Clock::now() > deadline)
        throwError(ErrorKind::kTimeout, "pycomm: ", rankName(rank_), " could not connect to ",
                   rankName(peer), " at ", host, ":", peerPort, ": ", errnoText(err));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Hello hello{kHelloMagic, kWireVersion, rank_, size_, {}};
    std::memcpy(hello.secret, secret_, kSecretBytes);
    sendAll(fd, &hello, sizeof(hello), deadline);
    peers_[peer]->fd = fd;
  }
  // Accept every higher rank; connections that do not say a valid hello are dropped.
  int missing = size_ - 1 - rank_;
  while (missing > 0) {
    pollfd pfd{listenFd_, POLLIN, 0};
    if (poll(&pfd, 1, remainingMs(deadline)) <= 0) {
      std::string names;
      for (int peer = rank_ + 1; peer < size_; ++peer)
        if (peers_[peer]->fd < 0) names += (names.empty() ? "" : ", ") + rankName(peer);
      throwError(ErrorKind::kTimeout, "pycomm: ", rankName(rank_),
                 " timed out waiting for connections from ", names);
    }
    int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Hello hello{};
    const auto helloDeadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    std::string rejected = recvAll(fd, &hello, sizeof(hello), helloDeadline)
                               ? checkHello(hello, rank_, size_, secret_)
                               : "no complete hello within 5 s";
    if (rejected.empty() && peers_[hello.rank]->fd >= 0) rejected = "a second connection for one rank";
    if (!rejected.empty()) {
      debugLog(strCat(rankName(rank_), " dropped an incoming connection: ", rejected));
      ::close(fd);
      continue;
    }
    peers_[hello.rank]->fd = fd;
    --missing;
  }
  ::close(listenFd_);
  listenFd_ = -1;
}

std::string TcpTransport::lostMessage(int peer, const std::string& reason) const {
  return strCat(rankName(rank_), " lost the connection to ", rankName(peer), " (", reason, ")");
}

void TcpTransport::wake() {
  std::lock_guard<std::mutex> lock(mutex_);  // abort() closes wakeFd_ under it
  if (wakeFd_ < 0) return;
  uint64_t one = 1;
  ssize_t ignored = ::write(wakeFd_, &one, sizeof(one));
  (void)ignored;
}

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
  event.events = on ? (EPOLLIN | EPOLLOUT) : EPOLLIN;
  event.data.u64 = static_cast<uint64_t>(peer);
  epoll_ctl(epollFd_, EPOLL_CTL_MOD, p.fd, &event);
}

RequestPtr TcpTransport::irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  PYCOMM_CHECK_INTERNAL(peer == kAnySource || (peer >= 0 && peer < size_ && peer != rank_),
                        "bad peer ", peer);
  auto request = std::make_shared<Request>(peer, bytes);
  std::string failure;
  int deliveredFrom = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!abortReason_.empty()) {
      failure = abortReason_;
    } else {
      // A message that already arrived (or is arriving) matches first.
      bool matched = false;
      for (int source = 0; source < size_ && !matched && failure.empty(); ++source) {
        if (source == rank_ || (peer != kAnySource && source != peer)) continue;
        auto& queue = peers_[source]->unexpected;
        for (auto it = queue.begin(); it != queue.end(); ++it) {
          Unexpected& u = **it;
          if (u.tag != tag || u.waiter.request) continue;
          if (u.data.size() != bytes) {
            failure = strCat(rankName(source), " sent ", u.data.size(), " bytes where ", bytes,
                             " were expected (tensor sizes differ between ranks?)");
            if (u.complete) {
              queue.erase(it);
            } else {  // claim it, so the rest of it is read and dropped
              u.waiter = {tag, nullptr, 0, std::make_shared<Request>(source, 0)};
              u.waiterFailed = true;
            }
          } else if (u.complete) {
            if (bytes > 0) std::memcpy(data, u.data.data(), bytes);
            queue.erase(it);
            deliveredFrom = source;
          } else {
            u.waiter = {tag, static_cast<char*>(data), bytes, request};
            deliveredFrom = -3;  // claimed; completes when the message ends
          }
          matched = true;
          break;
        }
      }
      if (deliveredFrom == -1 && failure.empty()) {
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
  } else if (deliveredFrom >= 0) {
    bytesReceived_ += bytes;
    Stats::instance().addReceived(bytes);
    request->complete(deliveredFrom);
  }
  return request;
}

std::string TcpTransport::describePending(int peer) {
  if (peer < 0 || peer >= size_ || peer == rank_) return "";
  std::lock_guard<std::mutex> lock(mutex_);
  const Peer& p = *peers_[peer];
  std::string text;
  size_t unmatched = 0;
  for (const auto& u : p.unexpected)
    if (!u->waiter.request) ++unmatched;
  if (unmatched > 0) {
    text = strCat(unmatched, " message(s) from ", rankName(peer),
                  " arrived that no receive matched (first tag ", p.unexpected.front()->tag & ~(1ull << 63),
                  ", ", p.unexpected.front()->data.size(), " bytes)");
  } else {
    text = strCat("nothing arrived from ", rankName(peer), " for this operation");
  }
  text += strCat("; ", p.messagesIn.load(), " messages in and ", p.messagesOut.load(),
                 " out with it, ", p.posted.size(), " receive(s) posted");
  if (!p.posted.empty()) text += strCat(" (first tag ", p.posted.front().tag & ~(1ull << 63), ")");
  return text;
}

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
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) handleReadable(peer);
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

void TcpTransport::handleReadable(int peer) {
  Peer& p = *peers_[peer];
  while (p.fd >= 0) {
    ssize_t n;
    if (!p.inPayload) {
      n = ::recv(p.fd, reinterpret_cast<char*>(&p.header) + p.headerGot,
                 sizeof(WireHeader) - p.headerGot, MSG_DONTWAIT);
    } else if (!p.discardError.empty()) {
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
      matchIncoming(peer);
      if (p.payloadBytes == 0) finishIncoming(peer);
      else p.inPayload = true;
    } else {
      p.payloadGot += static_cast<size_t>(n);
      if (p.payloadGot == p.payloadBytes) finishIncoming(peer);
    }
  }
}

void TcpTransport::matchIncoming(int peer) {
  Peer& p = *peers_[peer];
  p.payloadBytes = p.header.bytes;
  p.payloadGot = 0;
  p.dst = nullptr;
  if (p.header.flags & kFlagAbort) {  // not data: the peer says why it is leaving
    p.readingAbort = true;
    p.abortText.resize(p.payloadBytes);
    p.dst = p.abortText.data();
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto take = [&](std::deque<PostedRecv>& list) {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->tag != p.header.tag) continue;
      p.recvRequest = it->request;
      if (it->bytes != p.payloadBytes) {
        p.discardError = strCat(rankName(peer), " sent ", p.payloadBytes, " bytes where ",
                                it->bytes, " were expected (tensor sizes differ between ranks?)");
      } else {
        p.dst = it->data;
      }
      list.erase(it);
      return true;
    }
    return false;
  };
  if (take(p.posted) || take(anyPosted_)) return;
  auto buffer = std::make_shared<Unexpected>();
  Stats::instance().addBuffered(p.payloadBytes);
  buffer->tag = p.header.tag;
  buffer->data.resize(p.payloadBytes);
  p.dst = buffer->data.data();
  p.recvBuffer = buffer;
  p.unexpected.push_back(std::move(buffer));
}

void TcpTransport::finishIncoming(int peer) {
  Peer& p = *peers_[peer];
  p.inPayload = false;
  if (p.readingAbort) {
    p.readingAbort = false;
    std::string reason = abortReasonText(p.abortText.data(), p.abortText.size());
    // Drop the sender's "pycomm <op> (<algorithm>): " prefix; the receiver adds its own.
    if (reason.rfind("pycomm", 0) == 0 && reason.find(": ") != std::string::npos)
      reason = reason.substr(reason.find(": ") + 2);
    failPeer(peer, strCat(rankName(peer), " aborted the group: ", reason), true);
    return;
  }
  RequestPtr request = std::move(p.recvRequest);
  std::shared_ptr<Unexpected> buffer = std::move(p.recvBuffer);
  std::string discardError = std::move(p.discardError);
  p.recvRequest.reset();
  p.recvBuffer.reset();
  p.discardError.clear();
  if (request) {
    if (!discardError.empty()) {
      request->fail(discardError);
    } else {
      bytesReceived_ += p.payloadBytes;
      Stats::instance().addReceived(p.payloadBytes);
      request->complete(peer);
    }
    return;
  }
  RequestPtr waiter;  // a receive that claimed this message while it arrived
  {
    std::lock_guard<std::mutex> lock(mutex_);
    buffer->complete = true;
    if (buffer->waiter.request) {
      // Sizes were checked when the receive claimed it; a mismatched one failed then.
      if (!buffer->waiterFailed) {
        waiter = buffer->waiter.request;
        if (!buffer->data.empty())
          std::memcpy(buffer->waiter.data, buffer->data.data(), buffer->data.size());
      }
      auto& queue = p.unexpected;
      auto it = std::find(queue.begin(), queue.end(), buffer);
      if (it != queue.end()) queue.erase(it);
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
    for (auto it = p.unexpected.begin(); it != p.unexpected.end();) {
      if ((*it)->complete) {
        ++it;
        continue;
      }
      if ((*it)->waiter.request) failed.push_back((*it)->waiter.request);
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
    p.headerGot = 0;
  } else {
    wake();
  }
  for (auto& r : failed)
    if (r) r->fail(message);
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
    for (auto& peerPtr : peers_) {
      Peer& p = *peerPtr;
      if (p.failure.empty()) p.failure = message;
      for (auto& posted : p.posted) failed.push_back(posted.request);
      p.posted.clear();
      for (auto& u : p.unexpected)
        if (u->waiter.request) failed.push_back(u->waiter.request);
      p.unexpected.clear();
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
