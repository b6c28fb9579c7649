// TcpTransport's connection setup: the job secret and group id, the listener,
// address publication in the store, and the handshakes (wire.h) with every
// other rank: connecting to lower ranks and accepting higher ones, all in one
// non-blocking poll() loop bounded by the connect timeout. Each incoming
// connection has its own deadline (kHandshakeTimeout), so silent or slow
// connections to the published port delay no legitimate peer.
#include "transport/tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>

#include "common/error.h"
#include "common/logging.h"
#include "transport/hmac.h"
#include "transport/tcp_socket.h"

namespace pycomm {
namespace {

// How long an incoming connection may take to complete its handshake.
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
// Incoming connections in handshake at once; beyond it the oldest is dropped.
constexpr size_t kMaxHalfOpen = 256;
// Pause before a connect that failed (e.g. refused) is tried again.
constexpr auto kConnectRetry = std::chrono::milliseconds(20);

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

int msUntil(Clock::time_point when, Clock::time_point now) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(when - now).count() + 1;
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left, 1 << 30)));
}

std::string seconds(std::chrono::milliseconds duration) {
  return strCat(duration.count() / 1000, ".", (duration.count() % 1000) / 100, " s");
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

// One connection being set up, either way: bytes to write, then bytes to read
// (a fixed-size message), then the next step. Its fd is non-blocking.
struct Handshake {
  bool outgoing = false;
  int fd = -1;
  int peer = -1;  // outgoing: the rank dialled; incoming: the rank claimed, once the hello is read
  int stream = 0;  // which of the pair's streams
  Clock::time_point deadline;
  std::vector<uint8_t> out;
  size_t written = 0;
  std::vector<uint8_t> in;  // the message being read; empty: none expected
  size_t got = 0;
  Hello hello{};          // sent (outgoing) or received (incoming)
  Challenge challenge{};  // received (outgoing) or sent (incoming)
  // Outgoing only.
  sockaddr_storage address{};
  socklen_t addressLength = 0;
  std::string where;  // "host:port"
  bool connecting = false;
  Clock::time_point retryAt;
  std::string lastError;
  bool done = false;

  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  template <typename T>
  void send(const T& message) {
    const auto* p = reinterpret_cast<const uint8_t*>(&message);
    out.assign(p, p + sizeof(T));
    written = 0;
  }
  void expect(size_t bytes) {
    in.assign(bytes, 0);
    got = 0;
  }
  // Writes and reads what the socket allows. Returns "" while the handshake
  // goes on (check messageIn() for a complete message), else what broke.
  std::string pump() {
    while (written < out.size()) {
      const ssize_t n = ::send(fd, out.data() + written, out.size() - written, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
        return strCat("send failed: ", errnoText(errno));
      }
      written += static_cast<size_t>(n);
    }
    while (got < in.size()) {
      const ssize_t n = ::recv(fd, in.data() + got, in.size() - got, 0);
      // A reset is a close too: the peer closed with bytes of ours unread.
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return "the connection was closed";
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
        return strCat("recv failed: ", errnoText(errno));
      }
      got += static_cast<size_t>(n);
    }
    return "";
  }
  bool messageIn() const { return !in.empty() && got == in.size(); }
  bool sent() const { return written == out.size(); }
  short events() const {
    if (outgoing && connecting) return POLLOUT;
    return static_cast<short>((sent() ? 0 : POLLOUT) | (in.size() > got ? POLLIN : 0));
  }
};

// Starts a non-blocking connect. Returns "" when it is under way (or done).
std::string startConnect(Handshake& h) {
  h.fd = ::socket(h.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (h.fd < 0) return strCat("socket: ", errnoText(errno));
  if (::connect(h.fd, reinterpret_cast<sockaddr*>(&h.address), h.addressLength) == 0 || errno == EINPROGRESS) {
    h.connecting = true;
    return "";
  }
  const std::string error = errnoText(errno);
  h.close();
  return error;
}

// Closes every handshake fd it still holds when connectMesh leaves (success or throw).
struct HandshakeSet {
  std::vector<Handshake> outgoing;
  std::list<Handshake> incoming;
  ~HandshakeSet() {
    for (auto& h : outgoing)
      if (!h.done) h.close();
    for (auto& h : incoming) h.close();
  }
};

}  // namespace

void TcpTransport::connectMesh(KeyValueStore& store, const TcpOptions& options) {
  const auto deadline = Clock::now() + options.connectTimeout;
  // The group id (random, not secret) and the handshake key. Rank 0 draws the
  // id and says whether the key comes from PYCOMM_SECRET ("env": nothing secret
  // in the store) or from a random secret it puts in the store ("store").
  const std::string groupKey = options.storePrefix + "group";
  const std::string secretKey = options.storePrefix + "secret";
  const bool fromEnv = !options.secret.empty();
  PYCOMM_CHECK_USAGE(!fromEnv || options.secret.size() >= kMinSecretBytes, "pycomm: the job secret (PYCOMM_SECRET ",
                     "or PYCOMM_SECRET_FILE) is ", options.secret.size(), " bytes; at least ", kMinSecretBytes,
                     " are required (e.g. python -c 'import secrets; print(secrets.token_hex(16))')");
  uint8_t group[kGroupIdBytes];
  uint8_t storeSecret[kSecretBytes];
  HandshakeKey key;
  if (rank_ == 0) {
    randomBytes(group, sizeof(group));
    if (!fromEnv) {
      randomBytes(storeSecret, sizeof(storeSecret));
      store.set(secretKey, toHex(storeSecret, sizeof(storeSecret)));
    }
    // Rank 0's stream count is everyone's: "<group id> <env|store> <streams>".
    socketsPerPeer_ = options.socketsPerPeer;
    store.set(groupKey, toHex(group, sizeof(group)) + (fromEnv ? " env " : " store ") +
                            std::to_string(socketsPerPeer_));
  } else {
    const std::string entry = store.get(groupKey);
    std::string mode = entry.size() > 2 * kGroupIdBytes ? entry.substr(2 * kGroupIdBytes + 1) : "";
    const auto space = mode.find(' ');
    socketsPerPeer_ = 1;
    if (space != std::string::npos) {
      socketsPerPeer_ = std::atoi(mode.c_str() + space + 1);
      mode.resize(space);
    }
    if (!fromHex(entry.substr(0, 2 * kGroupIdBytes), group, sizeof(group)) || (mode != "env" && mode != "store") ||
        socketsPerPeer_ < 1 || socketsPerPeer_ > kMaxStreams)
      throwError(ErrorKind::kConnection, "pycomm: the group id in the store is malformed");
    if (fromEnv && mode != "env")
      throwError(ErrorKind::kConnection, "pycomm: ", rankName(rank_), " has a job secret (PYCOMM_SECRET or ",
                 "PYCOMM_SECRET_FILE) but ", rankName(0), " has none: set the same one on every rank");
    if (!fromEnv && mode != "store")
      throwError(ErrorKind::kConnection, "pycomm: ", rankName(0), " has a job secret (PYCOMM_SECRET or ",
                 "PYCOMM_SECRET_FILE) but ", rankName(rank_), " has none: set the same one on every rank");
    if (!fromEnv && !fromHex(store.get(secretKey), storeSecret, sizeof(storeSecret)))
      throwError(ErrorKind::kConnection, "pycomm: the job secret in the store is malformed");
  }
  key = fromEnv ? handshakeKey(options.secret.data(), options.secret.size(), group, true)
                : handshakeKey(storeSecret, sizeof(storeSecret), group, false);
  std::memset(storeSecret, 0, sizeof(storeSecret));

  sockaddr_storage address;
  socklen_t length = makeAddress(options.bindAddress, 0, address);
  listenFd_ = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listenFd_ < 0)
    throwError(ErrorKind::kConnection, "pycomm: ", rankName(rank_), " cannot create a socket: ", errnoText(errno));
  int one = 1;
  setsockopt(listenFd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listenFd_, reinterpret_cast<sockaddr*>(&address), length) != 0)
    throwError(ErrorKind::kConnection, "pycomm: cannot listen on ", options.bindAddress, ": ",
               errnoText(errno));
  if (::listen(listenFd_, std::max(size_, 128)) != 0)
    throwError(ErrorKind::kConnection, "pycomm: listen failed: ", errnoText(errno));
  length = sizeof(address);
  getsockname(listenFd_, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = address.ss_family == AF_INET
                       ? ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port)
                       : ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  store.set(options.storePrefix + "addr/" + std::to_string(rank_),
            options.bindAddress + " " + std::to_string(port));

  const int streams = socketsPerPeer_;
  for (int peer = 0; peer < size_; ++peer)
    for (int k = 0; k < streams && peer != rank_; ++k) {
      peers_[peer]->streams.push_back(std::make_unique<Stream>());
      peers_[peer]->streams.back()->peer = peer;
      peers_[peer]->streams.back()->index = k;
    }
  auto connected = [&](int peer) {
    for (auto& s : peers_[peer]->streams)
      if (s->fd < 0) return false;
    return true;
  };
  HandshakeSet set;
  // Connect to every lower rank (their listeners exist: they published after
  // listen()), `streams` times each.
  set.outgoing.resize(static_cast<size_t>(rank_ * streams));
  for (size_t i = 0; i < set.outgoing.size(); ++i) {
    const int peer = static_cast<int>(i) / streams;
    Handshake& h = set.outgoing[i];
    h.stream = static_cast<int>(i) % streams;
    const std::string entry = store.get(options.storePrefix + "addr/" + std::to_string(peer));
    const auto space = entry.rfind(' ');
    const std::string host = entry.substr(0, space);
    const int peerPort = space == std::string::npos ? -1 : std::atoi(entry.c_str() + space + 1);
    if (peerPort <= 0 || peerPort > 65535)
      throwError(ErrorKind::kConnection, "pycomm: the address of ", rankName(peer), " in the store is malformed");
    h.outgoing = true;
    h.peer = peer;
    h.deadline = deadline;
    h.where = strCat(host, ":", peerPort);
    h.addressLength = makeAddress(host, peerPort, h.address);
    h.retryAt = Clock::now();
  }
  auto outgoingFailure = [&](const Handshake& h, const std::string& what) {
    return strCat("pycomm: ", rankName(rank_), " ", what, " ", rankName(h.peer), " at ", h.where);
  };
  // Why the last connection claiming each higher rank was dropped (for the timeout message).
  std::map<int, std::string> dropped;
  auto drop = [&](std::list<Handshake>::iterator it, const std::string& why) {
    debugLog(strCat(rankName(rank_), " dropped an incoming connection: ", why));
    if (it->peer > rank_ && it->peer < size_) dropped[it->peer] = why;
    it->close();
    return set.incoming.erase(it);
  };
  int pendingOut = rank_ * streams;
  int missingIn = (size_ - 1 - rank_) * streams;
  Clock::time_point acceptPausedUntil;
  std::vector<pollfd> fds;
  std::vector<Handshake*> owners;
  while (pendingOut > 0 || missingIn > 0) {
    auto now = Clock::now();
    if (now >= deadline) {
      for (auto& h : set.outgoing) {
        if (h.done) continue;
        const std::string why = h.lastError.empty() ? "no answer" : h.lastError;
        if (h.connecting || h.fd < 0)
          throwError(ErrorKind::kTimeout, outgoingFailure(h, "could not connect to"), " within ",
                     seconds(options.connectTimeout), " (", why, ")");
        throwError(ErrorKind::kTimeout, outgoingFailure(h, "connected to"), " but the handshake did not complete within ",
                   seconds(options.connectTimeout), h.lastError.empty() ? "" : " (earlier attempt: " + why + ")");
      }
      std::string names, notes;
      for (int peer = rank_ + 1; peer < size_; ++peer) {
        if (connected(peer)) continue;
        names += (names.empty() ? "" : ", ") + rankName(peer);
        auto it = dropped.find(peer);
        if (it != dropped.end())
          notes += strCat("; a connection claiming ", rankName(peer), " was dropped: ", it->second);
      }
      throwError(ErrorKind::kTimeout, "pycomm: ", rankName(rank_), " timed out waiting for connections from ",
                 names, notes);
    }
    // Incoming connections past their own deadline are dropped; failed connects retried.
    for (auto it = set.incoming.begin(); it != set.incoming.end();) {
      if (now >= it->deadline) it = drop(it, strCat("no complete handshake within ", seconds(kHandshakeTimeout)));
      else ++it;
    }
    Clock::time_point wakeAt = deadline;
    for (auto& h : set.outgoing) {
      if (h.done || h.fd >= 0) continue;
      if (now >= h.retryAt) {
        const std::string error = startConnect(h);
        if (!error.empty()) {
          h.lastError = error;
          h.retryAt = now + kConnectRetry;
        }
      }
      if (h.fd < 0) wakeAt = std::min(wakeAt, h.retryAt);
    }
    for (auto& h : set.incoming) wakeAt = std::min(wakeAt, h.deadline);
    fds.clear();
    owners.clear();
    const bool listening = missingIn > 0 && now >= acceptPausedUntil;
    if (missingIn > 0 && !listening) wakeAt = std::min(wakeAt, acceptPausedUntil);
    if (listening) {
      fds.push_back({listenFd_, POLLIN, 0});
      owners.push_back(nullptr);
    }
    for (auto& h : set.outgoing)
      if (!h.done && h.fd >= 0) {
        fds.push_back({h.fd, h.events(), 0});
        owners.push_back(&h);
      }
    for (auto& h : set.incoming) {
      fds.push_back({h.fd, h.events(), 0});
      owners.push_back(&h);
    }
    const int ready = ::poll(fds.data(), fds.size(), msUntil(wakeAt, now));
    if (ready < 0 && errno != EINTR)
      throwError(ErrorKind::kConnection, "pycomm: ", rankName(rank_), " poll failed during connection setup: ",
                 errnoText(errno));
    if (ready <= 0) continue;
    now = Clock::now();
    // Progress on the connections that have events (before accepting: the list may grow).
    for (size_t i = 0; i < fds.size(); ++i) {
      Handshake* h = owners[i];
      if (h == nullptr || fds[i].revents == 0) continue;
      if (h->outgoing) {
        std::string error;
        if (h->connecting) {
          int err = 0;
          socklen_t len = sizeof(err);
          getsockopt(h->fd, SOL_SOCKET, SO_ERROR, &err, &len);
          if (err != 0) {
            error = errnoText(err);
          } else {
            h->connecting = false;
            h->hello = Hello{kHelloMagic, kWireVersion, rank_, size_, h->peer, static_cast<uint32_t>(h->stream),
                             {}, {}, wire_, 0};
            std::memcpy(h->hello.group, group, sizeof(group));
            randomBytes(h->hello.nonce, sizeof(h->hello.nonce));
            h->send(h->hello);
            h->expect(sizeof(Challenge));
          }
        }
        if (error.empty() && !h->connecting) error = h->pump();
        if (error.empty() && h->messageIn()) {  // the challenge: the acceptor proves itself first
          std::memcpy(&h->challenge, h->in.data(), sizeof(Challenge));
          const std::string refused = checkChallenge(h->challenge, h->hello, key);
          if (!refused.empty())
            throwError(ErrorKind::kConnection, outgoingFailure(*h, "could not authenticate"), ": ", refused);
          Proof proof{kProofMagic, 0, {}};
          handshakeMac(key, HandshakeRole::kConnector, group, size_, rank_, h->peer, h->hello.nonce,
                       h->challenge.nonce, wire_, proof.mac);
          h->send(proof);
          h->in.clear();
          error = h->pump();
        }
        if (!error.empty()) {
          // Refused, reset or dropped (e.g. evicted by a flood): try again until the deadline.
          h->lastError = error;
          h->close();
          h->connecting = false;
          h->retryAt = now + kConnectRetry;
        } else if (!h->connecting && h->in.empty() && h->sent()) {
          h->done = true;
          Stream& st = *peers_[h->peer]->streams[h->stream];
          st.fd = h->fd;
          if (wire_ == kWireIntegrity) {
            SessionKeys keys = sessionKeys(key, HandshakeRole::kConnector, h->hello, h->challenge.nonce);
            st.sendMac = std::make_unique<HmacSha256>(keys.send, sizeof(keys.send));
            st.recvMac = std::make_unique<HmacSha256>(keys.recv, sizeof(keys.recv));
            std::memset(&keys, 0, sizeof(keys));
          }
          --pendingOut;
        }
        continue;
      }
      auto it = std::find_if(set.incoming.begin(), set.incoming.end(), [h](const Handshake& x) { return &x == h; });
      std::string error = h->pump();
      if (error.empty() && h->messageIn() && h->in.size() == sizeof(Hello)) {
        std::memcpy(&h->hello, h->in.data(), sizeof(Hello));
        error = checkHello(h->hello, rank_, size_, group);
        if (error.empty() && h->hello.stream >= static_cast<uint32_t>(streams))
          error = strCat("peer opened stream ", h->hello.stream, " but rank 0 chose ", streams, " per peer");
        if (error.empty() && h->hello.wire != wire_) {
          h->peer = h->hello.rank;  // named in the timeout's message
          error = strCat("peer runs PYCOMM_WIRE=", h->hello.wire == kWireNone ? "none" : "integrity",
                         ", this rank ", wire_ == kWireNone ? "none" : "integrity");
        }
        if (error.empty()) {
          h->peer = h->hello.rank;
          h->stream = static_cast<int>(h->hello.stream);
          h->challenge = Challenge{kChallengeMagic, kWireVersion, {}, {}};
          randomBytes(h->challenge.nonce, sizeof(h->challenge.nonce));
          handshakeMac(key, HandshakeRole::kAcceptor, group, size_, h->peer, rank_, h->hello.nonce,
                       h->challenge.nonce, wire_, h->challenge.mac);
          h->send(h->challenge);
          h->expect(sizeof(Proof));
          error = h->pump();
        }
      }
      if (error.empty() && h->messageIn() && h->in.size() == sizeof(Proof)) {
        Proof proof;
        std::memcpy(&proof, h->in.data(), sizeof(Proof));
        error = checkProof(proof, h->hello, h->challenge, rank_, key);
        Stream& claimed = *peers_[h->peer]->streams[h->stream];
        if (error.empty() && claimed.fd >= 0) error = "a second connection for one rank";
        if (error.empty()) {  // only an authenticated connection claims its rank
          claimed.fd = h->fd;
          if (wire_ == kWireIntegrity) {
            SessionKeys keys = sessionKeys(key, HandshakeRole::kAcceptor, h->hello, h->challenge.nonce);
            claimed.sendMac = std::make_unique<HmacSha256>(keys.send, sizeof(keys.send));
            claimed.recvMac = std::make_unique<HmacSha256>(keys.recv, sizeof(keys.recv));
            std::memset(&keys, 0, sizeof(keys));
          }
          h->fd = -1;
          --missingIn;
          set.incoming.erase(it);
          continue;
        }
      }
      if (!error.empty()) {
        if (h->peer >= 0 && !h->in.empty() && h->got == 0 && error == "the connection was closed")
          error = "it closed the connection on seeing this rank's challenge (it could not authenticate this rank: "
                  "is PYCOMM_SECRET the same on every rank?)";
        drop(it, error);
      }
    }
    if (listening && fds[0].revents != 0) {
      while (true) {
        const int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            // Out of descriptors: make room by dropping the oldest half-open connection.
            if (!set.incoming.empty()) drop(set.incoming.begin(), "dropped to make room (out of file descriptors)");
            else acceptPausedUntil = now + kConnectRetry;
          }
          break;  // EAGAIN: nothing more to accept now
        }
        if (set.incoming.size() >= kMaxHalfOpen) drop(set.incoming.begin(), "too many connections in handshake");
        Handshake h;
        h.fd = fd;
        h.deadline = std::min(deadline, now + kHandshakeTimeout);
        h.expect(sizeof(Hello));
        set.incoming.push_back(std::move(h));
      }
    }
  }
  ::close(listenFd_);
  listenFd_ = -1;
}

}  // namespace pycomm
