// TcpTransport's connection setup: the job secret, the listener, address
// publication in the store, connecting to lower ranks and accepting higher ones
// with a hello (wire.h), all bounded by the connect timeout.
#include "transport/tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "common/error.h"
#include "common/logging.h"
#include "transport/tcp_socket.h"

namespace pycomm {
namespace {

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

int remainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
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

}  // namespace pycomm
