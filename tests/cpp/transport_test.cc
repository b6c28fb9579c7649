// Torch-free tests of the TCP transport, several ranks as threads of one
// process. Built and run by tests/transport/test_transport_cpp.py; prints one line per
// check and exits non-zero on the first failure.
#include <algorithm>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <poll.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/memory_store.h"
#include "transport/tcp.h"
#include "transport/wire.h"

using namespace pycomm;

namespace pycomm {
// What the tests below need from inside a transport (tcp.h befriends it).
struct TcpTransportProbe {
  // Stream 0 (headers) of the pair.
  static std::mutex& sendMutex(TcpTransport& t, int peer) { return t.peers_[peer]->streams[0]->mutex; }
  static int fd(TcpTransport& t, int peer) { return t.peers_[peer]->streams[0]->fd; }
  // The first message from `peer` that arrived before its receive, and whether it
  // is complete and claimed by a waiting receive.
  static std::shared_ptr<void> firstUnexpected(TcpTransport& t, int peer, bool* complete, bool* waiting) {
    std::lock_guard<std::mutex> lock(t.mutex_);
    auto& queue = t.peers_[peer]->unexpected;
    if (queue.empty()) return nullptr;
    const auto& front = queue.begin()->second;
    *complete = front->complete;
    *waiting = front->claim == TcpTransport::Unexpected::Claim::kWaiting;
    return front;
  }
  // Whether that message still hands its data to a receive when it ends.
  static bool stillAttached(TcpTransport& t, const std::shared_ptr<void>& message) {
    std::lock_guard<std::mutex> lock(t.mutex_);
    auto& u = *std::static_pointer_cast<TcpTransport::Unexpected>(message);
    return u.claim == TcpTransport::Unexpected::Claim::kWaiting || u.waiter.request != nullptr;
  }
  static int socketsPerPeer(TcpTransport& t) { return t.socketsPerPeer_; }
  static int ioThreads(TcpTransport& t) { return static_cast<int>(t.io_.size()); }
  // Writes `header` on stream 0 to `peer` as the transport would (with its frame
  // tag under wire integrity), or with a wrong tag when `forge`; returns the bytes sent.
  static ssize_t sendHeader(TcpTransport& t, int peer, WireHeader header, bool forge = false) {
    auto& s = *t.peers_[peer]->streams[0];
    std::lock_guard<std::mutex> lock(s.mutex);
    uint8_t frame[sizeof(WireHeader) + kFrameTagBytes] = {};
    std::memcpy(frame, &header, sizeof(header));
    size_t bytes = sizeof(header);
    if (s.sendMac) {
      beginFrame(*s.sendMac, s.sendSequence++, FrameKind::kHeader);
      s.sendMac->update(&header, sizeof(header));
      s.sendMac->final(frame + sizeof(header));
      if (forge) frame[sizeof(header)] ^= 1;
      bytes += kFrameTagBytes;
    }
    return ::send(s.fd, frame, bytes, MSG_NOSIGNAL);
  }
  // As the posting thread does when a send fails: off the I/O thread.
  static void failPeer(TcpTransport& t, int peer, const std::string& reason) { t.failPeer(peer, reason); }
};
}  // namespace pycomm

namespace {

// How long a rank waits for a key in the store the tests rendezvous through.
constexpr std::chrono::seconds kStoreTimeout{20};

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

// Builds `n` connected transports in parallel (their constructors rendezvous).
std::vector<std::unique_ptr<TcpTransport>> mesh(int n, MemoryStore& store,
                                                std::function<void()> whileConnecting = {},
                                                TcpOptions options = {}) {
  std::vector<std::unique_ptr<TcpTransport>> transports(n);
  std::vector<std::thread> threads;
  options.connectTimeout = std::chrono::milliseconds(20000);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      if (r > 0 && whileConnecting) {
        // Higher ranks wait until the intruder has had its go at rank 0's listener.
        store.get("test/intruder-done");
      }
      transports[r] = std::make_unique<TcpTransport>(r, n, store, options);
    });
  if (whileConnecting) {
    whileConnecting();
    store.set("test/intruder-done", "1");
  }
  for (auto& t : threads) t.join();
  return transports;
}

int connectTo(const std::string& entry) {
  const auto space = entry.rfind(' ');
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(std::stoi(entry.substr(space + 1))));
  inet_pton(AF_INET, entry.substr(0, space).c_str(), &address.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool waitOk(const RequestPtr& request) {
  return request->waitUntil(Clock::now() + std::chrono::seconds(10)) && !request->failed();
}

// Like mesh(), but every rank's construction error is caught: transports[r] is
// null and errors[r] says why. Ranks above 0 start once `beforeOthers` returned.
struct Built {
  std::vector<std::unique_ptr<TcpTransport>> transports;
  std::vector<std::string> errors;
};
Built meshOrErrors(int n, MemoryStore& store, std::chrono::milliseconds timeout,
                   std::function<void()> beforeOthers = {}, std::vector<TcpOptions> perRank = {}) {
  Built built;
  built.transports.resize(n);
  built.errors.resize(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      TcpOptions options = perRank.empty() ? TcpOptions{} : perRank[r];
      options.connectTimeout = timeout;
      if (r > 0 && beforeOthers) store.get("test/others-go");
      try {
        built.transports[r] = std::make_unique<TcpTransport>(r, n, store, options);
      } catch (const std::exception& e) {
        built.errors[r] = e.what();
      }
    });
  if (beforeOthers) {
    beforeOthers();
    store.set("test/others-go", "1");
  }
  for (auto& t : threads) t.join();
  return built;
}

// A TCP listener on 127.0.0.1 (fd, port), nothing accepted unless the test does.
std::pair<int, int> listener(int backlog) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  ::listen(fd, backlog);
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return {fd, ntohs(address.sin_port)};
}

// What rank 0 leaves in the store for the others (store-secret mode): its
// address, the job secret (hex) and the group id.
const char kSecretHex[] = "00112233445566778899aabbccddeeff";
void publishRankZero(MemoryStore& store, int port) {
  store.set("addr/0", "127.0.0.1 " + std::to_string(port));
  store.set("secret", kSecretHex);
  store.set("group", "0123456789abcdef0123456789abcdef store");
}

// Rank 1 of a 2-rank group, constructed on a detached thread (it may block
// past the test, so it owns what it uses); the future gets its error ("" if it
// connected).
std::future<std::string> rankOneInBackground(std::shared_ptr<MemoryStore> store,
                                             std::chrono::milliseconds timeout) {
  auto result = std::make_shared<std::promise<std::string>>();
  auto future = result->get_future();
  std::thread([store, result, timeout] {
    TcpOptions options;
    options.connectTimeout = timeout;
    try {
      TcpTransport transport(1, 2, *store, options);
      result->set_value("");
    } catch (const std::exception& e) {
      result->set_value(e.what());
    }
  }).detach();
  return future;
}

// Item: startup cannot be stalled. Silent and slow (partial hello) connections
// to rank 0's port, opened before the real peers connect, cost them nothing;
// rank 0 drops them.
void silentConnectionsDoNotStallStartup() {
  MemoryStore store(kStoreTimeout);
  std::vector<int> silent;
  Clock::time_point opened;
  auto built = meshOrErrors(3, store, std::chrono::milliseconds(10000), [&] {
    const std::string rank0 = store.get("addr/0");
    for (int i = 0; i < 8; ++i) {
      int fd = connectTo(rank0);
      if (i % 4 == 3) {  // a slow loris: the first bytes of a hello, then nothing
        const uint32_t magic = kHelloMagic;
        ssize_t sent = ::send(fd, &magic, sizeof(magic), MSG_NOSIGNAL);
        (void)sent;
      }
      silent.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    opened = Clock::now();
  });
  const double seconds = std::chrono::duration<double>(Clock::now() - opened).count();
  bool ok = true;
  for (auto& e : built.errors) ok = ok && e.empty();
  expect(ok && seconds < 3.0, "8 silent or slow connections do not delay the real peers (init took " +
                                  std::to_string(seconds) + " s after them; errors: " + built.errors[0] +
                                  built.errors[1] + built.errors[2] + ")");
  // Once rank 0 is connected it has dropped them: each reads end-of-stream (or a reset).
  int dropped = 0;
  for (int fd : silent) {
    pollfd pfd{fd, POLLIN, 0};
    char byte;
    if (::poll(&pfd, 1, 2000) == 1 && ::recv(fd, &byte, 1, MSG_DONTWAIT) <= 0) ++dropped;
    ::close(fd);
  }
  expect(dropped == 8, "rank 0 dropped the 8 silent connections (" + std::to_string(dropped) + " of 8)");
  if (ok) {
    int value = 3, received = 0;
    auto recv = built.transports[0]->irecv(2, 1, &received, sizeof(received));
    auto send = built.transports[2]->isend(0, 1, &value, sizeof(value));
    expect(waitOk(recv) && waitOk(send) && received == 3, "the group runs after the stall attempt");
  }
}

// Item: connect honours the timeout. Rank 0's published address is a listener
// whose accept queue is full, so the kernel drops rank 1's SYNs: without a
// deadline connect() would block for minutes.
void connectHonoursTheTimeout() {
  auto store = std::make_shared<MemoryStore>(kStoreTimeout);
  auto [fd, port] = listener(0);
  std::vector<int> filling;
  for (int i = 0; i < 4; ++i) {  // fill the accept queue (backlog 0 holds one)
    int c = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
    int rc = ::connect(c, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    (void)rc;
    filling.push_back(c);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  publishRankZero(*store, port);
  const auto start = Clock::now();
  auto error = rankOneInBackground(store, std::chrono::milliseconds(1500));
  const bool finished = error.wait_for(std::chrono::seconds(6)) == std::future_status::ready;
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string text = finished ? error.get() : "(still connecting after 6 s)";
  const std::string where = "127.0.0.1:" + std::to_string(port);
  expect(finished && seconds < 3.0 && text.find("rank 1") != std::string::npos &&
             text.find("rank 0") != std::string::npos && text.find(where) != std::string::npos,
         "a connect that is never answered fails within the 1.5 s timeout (" + std::to_string(seconds) +
             " s), naming both ranks and " + where + ": " + text);
  for (int c : filling) ::close(c);
  ::close(fd);
}

// Item: mutual authentication. A fake rank 0 (the test) reads what rank 1 sends
// and answers with a challenge it cannot have computed (it does not know the
// secret): the secret never crosses the wire and rank 1 refuses the fake.
void connectorAuthenticatesTheAcceptor() {
  auto store = std::make_shared<MemoryStore>(kStoreTimeout);
  auto [fd, port] = listener(16);
  publishRankZero(*store, port);
  auto error = rankOneInBackground(store, std::chrono::milliseconds(3000));
  pollfd pfd{fd, POLLIN, 0};
  int conn = ::poll(&pfd, 1, 3000) == 1 ? ::accept(fd, nullptr, nullptr) : -1;
  std::string received;
  char buffer[256];
  pollfd cfd{conn, POLLIN, 0};
  while (conn >= 0 && ::poll(&cfd, 1, 300) == 1) {  // whatever rank 1 says first
    ssize_t n = ::recv(conn, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    received.append(buffer, static_cast<size_t>(n));
  }
  uint8_t secret[16];
  for (int i = 0; i < 16; ++i) secret[i] = static_cast<uint8_t>(std::stoi(std::string(kSecretHex + 2 * i, 2), nullptr, 16));
  const bool leaked = received.find(std::string(reinterpret_cast<char*>(secret), 16)) != std::string::npos;
  expect(!received.empty() && !leaked, "the job secret never crosses the wire (rank 1 sent " +
                                           std::to_string(received.size()) + " bytes" +
                                           (leaked ? ", the secret among them)" : ")"));
  // A well-formed challenge ("PCMC", version, nonce, MAC) made without the secret.
  std::string challenge(56, '\x5a');
  const uint32_t head[2] = {0x50434d43u, kWireVersion};
  std::memcpy(&challenge[0], head, sizeof(head));
  ssize_t sent = ::send(conn, challenge.data(), challenge.size(), MSG_NOSIGNAL);
  (void)sent;
  const bool finished = error.wait_for(std::chrono::seconds(6)) == std::future_status::ready;
  const std::string text = finished ? error.get() : "(still waiting after 6 s)";
  expect(finished && text.find("rank 1") != std::string::npos && text.find("rank 0") != std::string::npos &&
             text.find("authenticat") != std::string::npos,
         "rank 1 refuses a rank 0 that cannot prove the secret: " + (text.empty() ? "(it connected)" : text));
  if (conn >= 0) ::close(conn);
  ::close(fd);
}

// A store that remembers every key and value set in it.
class RecordingStore : public MemoryStore {
 public:
  using MemoryStore::MemoryStore;
  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(recordMutex_);
      written_ += key + "=" + value + "\n";
    }
    MemoryStore::set(key, value);
  }
  std::string written() {
    std::lock_guard<std::mutex> lock(recordMutex_);
    return written_;
  }

 private:
  std::mutex recordMutex_;
  std::string written_;
};

std::vector<TcpOptions> secrets(const std::vector<std::string>& texts) {
  std::vector<TcpOptions> options(texts.size());
  for (size_t r = 0; r < texts.size(); ++r) options[r].secret = texts[r];
  return options;
}

// Opens a connection to rank 0 claiming rank 1 of a 2-rank group (group id from
// the store) and reads rank 0's challenge; returns the fd (-1 if no challenge came).
int claimRankOne(MemoryStore& store) {
  int fd = connectTo(store.get("addr/0"));
  Hello hello{kHelloMagic, kWireVersion, 1, 2, 0, 0, {}, {}, kWireIntegrity, 0};
  const std::string group = store.get("group");
  for (size_t i = 0; i < kGroupIdBytes; ++i)
    hello.group[i] = static_cast<uint8_t>(std::stoi(group.substr(2 * i, 2), nullptr, 16));
  for (size_t i = 0; i < kNonceBytes; ++i) hello.nonce[i] = static_cast<uint8_t>(i);
  ssize_t sent = ::send(fd, &hello, sizeof(hello), MSG_NOSIGNAL);
  (void)sent;
  Challenge challenge{};
  size_t got = 0;
  pollfd pfd{fd, POLLIN, 0};
  while (got < sizeof(challenge) && ::poll(&pfd, 1, 2000) == 1) {
    ssize_t n = ::recv(fd, reinterpret_cast<char*>(&challenge) + got, sizeof(challenge) - got, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (got != sizeof(challenge) || challenge.magic != kChallengeMagic) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Item: only an authenticated connection claims a rank. Two impostors that know
// the group id (public, in the store) but not the secret claim rank 1 before it
// connects: one sends a wrong proof, one holds its claim in silence. The real
// rank 1 gets in at once; the first impostor is dropped.
void unprovenClaimsBlockNobody() {
  MemoryStore store(kStoreTimeout);
  int wrong = -1, holding = -1;
  Clock::time_point claimed;
  auto built = meshOrErrors(2, store, std::chrono::milliseconds(10000), [&] {
    wrong = claimRankOne(store);
    holding = claimRankOne(store);
    Proof proof{kProofMagic, 0, {}};
    ssize_t sent = ::send(wrong, &proof, sizeof(proof), MSG_NOSIGNAL);
    (void)sent;
    claimed = Clock::now();
  }, secrets({"one secret, long enough", "one secret, long enough"}));
  const double seconds = std::chrono::duration<double>(Clock::now() - claimed).count();
  expect(wrong >= 0 && holding >= 0, "impostors claiming rank 1 get a challenge (and nothing else)");
  expect(built.errors[0].empty() && built.errors[1].empty() && seconds < 3.0,
         "the real rank 1 connects at once despite two unproven claims (" + std::to_string(seconds) + " s) " +
             built.errors[0] + built.errors[1]);
  char byte;
  pollfd pfd{wrong, POLLIN, 0};
  expect(::poll(&pfd, 1, 2000) == 1 && ::recv(wrong, &byte, 1, MSG_DONTWAIT) <= 0,
         "the impostor with a wrong proof is dropped");
  if (built.errors[0].empty() && built.errors[1].empty()) {
    int value = 11, received = 0;
    auto recv = built.transports[0]->irecv(1, 2, &received, sizeof(received));
    auto send = built.transports[1]->isend(0, 2, &value, sizeof(value));
    expect(waitOk(recv) && waitOk(send) && received == 11, "messages flow between the authenticated ranks");
  }
  ::close(wrong);
  ::close(holding);
}

// A job secret shorter than kMinSecretBytes is refused at construction, naming the
// knob, before anything touches the network (a short secret is cheap to guess offline).
void shortSecretsAreRefused() {
  MemoryStore store(kStoreTimeout);
  auto built = meshOrErrors(2, store, std::chrono::milliseconds(3000), {}, secrets({"fifteen bytes!!", "fifteen bytes!!"}));
  expect(built.errors[0].find("PYCOMM_SECRET") != std::string::npos &&
             built.errors[0].find("at least 16") != std::string::npos &&
             built.errors[0].find("fifteen") == std::string::npos,
         "a 15-byte secret is refused naming PYCOMM_SECRET, not showing it: " + built.errors[0]);
}

// Item: a secret that is not in the store. With the same secret on every rank
// the group connects and the store holds nothing secret; a rank with another
// secret fails at once naming the rank it could not authenticate, the others
// within the timeout, and no message shows either secret.
void secretsOutsideTheStore() {
  {
    RecordingStore store(kStoreTimeout);
    auto built = meshOrErrors(3, store, std::chrono::milliseconds(10000), {},
                              secrets({"correct horse battery staple", "correct horse battery staple", "correct horse battery staple"}));
    const std::string written = store.written();
    expect(built.errors[0].empty() && built.errors[1].empty() && built.errors[2].empty(),
           "three ranks with the same secret connect " + built.errors[0] + built.errors[1] + built.errors[2]);
    expect(written.find("secret") == std::string::npos && written.find("correct horse battery staple") == std::string::npos &&
               written.find("group=") != std::string::npos,
           "with a secret set, the store holds no secret key:\n" + written);
  }
  {
    RecordingStore store(kStoreTimeout);
    auto built = meshOrErrors(2, store, std::chrono::milliseconds(10000));
    expect(built.errors[0].empty() && built.errors[1].empty() && store.written().find("secret=") != std::string::npos,
           "without one, rank 0 puts a random secret in the store");
  }
  {
    MemoryStore store(kStoreTimeout);
    const auto start = Clock::now();
    std::vector<double> took(3);
    auto built = meshOrErrors(3, store, std::chrono::milliseconds(3000), {},
                              secrets({"alpha secret of the job", "alpha secret of the job", "beta secret of the job"}));
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const std::string& odd = built.errors[2];
    expect(odd.find("rank 2 could not authenticate rank ") != std::string::npos &&
               odd.find("PYCOMM_SECRET") != std::string::npos,
           "the rank with another secret fails naming the peer it could not authenticate: " + odd);
    expect(built.errors[0].find("rank 0 timed out waiting for connections from rank 2") != std::string::npos &&
               built.errors[0].find("a connection claiming rank 2 was dropped: it closed the connection on seeing this "
                                   "rank's challenge") != std::string::npos,
           "rank 0 fails within its timeout, saying rank 2's claim was not proven: " + built.errors[0]);
    bool quiet = seconds < 6.0;
    for (auto& e : built.errors) quiet = quiet && e.find("alpha") == std::string::npos && e.find("beta") == std::string::npos;
    expect(quiet, "nobody waits past the timeout (" + std::to_string(seconds) + " s) and no error shows a secret");
  }
  {
    MemoryStore store(kStoreTimeout);
    auto built = meshOrErrors(2, store, std::chrono::milliseconds(3000), {}, secrets({"", "a secret long enough"}));
    expect(built.errors[1].find("rank 1 has a job secret (PYCOMM_SECRET or PYCOMM_SECRET_FILE) but rank 0 has none") !=
               std::string::npos,
           "a secret on some ranks only is named at once: " + built.errors[1]);
  }
}

void strayConnectionsAreRejected() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store, [&] {
    const std::string rank0 = store.get("addr/0");
    // 1: garbage bytes; 2: a well-formed hello of another group; 3: silence, then close.
    int garbage = connectTo(rank0);
    const char junk[32] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    ssize_t sent = ::send(garbage, junk, sizeof(junk), MSG_NOSIGNAL);
    (void)sent;
    int impostor = connectTo(rank0);
    Hello hello{kHelloMagic, kWireVersion, 1, 2, 0, 0, {}, {}, kWireIntegrity, 0};
    sent = ::send(impostor, &hello, sizeof(hello), MSG_NOSIGNAL);
    int silent = connectTo(rank0);
    ::close(silent);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::close(garbage);
    ::close(impostor);
  });
  int value = 42, received = 0;
  auto recv = transports[0]->irecv(1, 7, &received, sizeof(received));
  auto send = transports[1]->isend(0, 7, &value, sizeof(value));
  expect(waitOk(recv) && waitOk(send) && received == 42,
         "garbage, secret-less and silent connections are dropped; the job connects and runs");
}

void abortNoticeNamesTheFirstFailure() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(3, store);
  char buffer[8];
  auto waiting = transports[0]->irecv(2, 1, buffer, sizeof(buffer));
  // The group aborts with the failure's detail (Error::detail(), no op prefix);
  // the notice carries it verbatim.
  transports[2]->abort("rank 2 lost the connection to rank 9 (boom)");
  waiting->waitUntil(Clock::now() + std::chrono::seconds(10));
  const std::string error = waiting->error();
  expect(waiting->failed() &&
             error.find("rank 2 aborted the group: rank 2 lost the connection to rank 9 (boom)") !=
                 std::string::npos,
         "a survivor learns why its peer aborted: " + error);
  // Rank 1 learns it too (its receive from rank 2 fails once the notice is read)...
  auto learned = transports[1]->irecv(2, 1, buffer, sizeof(buffer));
  learned->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(learned->failed() && learned->error().find("rank 2 aborted the group") != std::string::npos,
         "every survivor hears the notice: " + learned->error());
  // ...and from then on, a send to the aborted rank fails at once, without waiting.
  auto later = transports[1]->isend(2, 1, buffer, sizeof(buffer));
  expect(later->completed() && later->failed(), "later sends to the aborted rank fail at once: " + later->error());
}

// Waits for `recv` and expects it to have failed with `text` in its error.
void expectFailed(const RequestPtr& recv, const std::string& text, const std::string& what) {
  recv->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(recv->failed() && recv->error().find(text) != std::string::npos, what + ": " + recv->error());
}

// After a failed receive the pair still carries a message intact (on `tag`).
void expectInStep(std::vector<std::unique_ptr<TcpTransport>>& transports, uint64_t tag, const std::string& what) {
  int value = static_cast<int>(tag), received = 0;
  auto next = transports[0]->irecv(1, tag, &received, sizeof(received));
  transports[1]->isend(0, tag, &value, sizeof(value));
  expect(waitOk(next) && received == value, what);
}

// Posts a receive (`recv`) before its message is sent (`send`), or once the message
// has arrived (held as unexpected). Returns {receive, send}.
std::pair<RequestPtr, RequestPtr> postAround(bool postedFirst, const std::function<RequestPtr()>& recv,
                                             const std::function<RequestPtr()>& send) {
  RequestPtr received = postedFirst ? recv() : nullptr;
  RequestPtr sent = send();
  if (!postedFirst) {
    waitOk(sent);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // arrived: unexpected
    received = recv();
  }
  return {received, sent};
}

// Rank 1 sends 16 bytes on `sendTag` to a receive on `recvTag`, posted before or after
// the message arrived: the receive fails with `text` and writes nothing.
void expectRefused(std::vector<std::unique_ptr<TcpTransport>>& transports, bool postedFirst, uint64_t recvTag,
                   uint64_t sendTag, const std::string& text, const std::string& what) {
  float buffer[4] = {}, sent[4] = {1, 2, 3, 4};
  auto [recv, send] = postAround(postedFirst, [&] { return transports[0]->irecv(1, recvTag, buffer, sizeof(buffer)); },
                                 [&] { return transports[1]->isend(0, sendTag, sent, sizeof(sent)); });
  expectFailed(recv, text, what + (postedFirst ? " (posted first)" : " (unexpected)"));
  expect(buffer[0] == 0, what + ": and writes nothing into it");
  expect(waitOk(send), what + ": the send completes (`sent` is about to go)");
}

// irecv(..., upTo): a message of at most the buffer's size is received into its
// start, posted before the message or after it arrived, striped or not; a larger one
// fails like any size mismatch and the stream stays in step.
void receivesUpToTheBufferSize() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  for (size_t sent : {size_t(0), size_t(12), size_t(3) << 20}) {
    for (bool postedFirst : {true, false}) {
      std::vector<char> message(sent, 7), buffer(sent + 4096, 1);
      auto [recv, send] = postAround(
          postedFirst, [&] { return transports[0]->irecv(1, 5, buffer.data(), buffer.size(), /*upTo=*/true); },
          [&] { return transports[1]->isend(0, 5, message.data(), message.size()); });
      const bool ok = waitOk(recv) && waitOk(send);
      const bool head = std::all_of(buffer.begin(), buffer.begin() + sent, [](char c) { return c == 7; });
      const bool tail = std::all_of(buffer.begin() + sent, buffer.end(), [](char c) { return c == 1; });
      expect(ok && head && tail && recv->sourceRank() == 1,
             "a " + std::to_string(sent) + "-byte message into a larger buffer (" +
                 (postedFirst ? "posted first" : "unexpected") + ")" + (ok ? "" : ": " + recv->error()));
    }
  }
  std::vector<char> big(800), small(400);
  auto recv = transports[0]->irecv(1, 6, small.data(), small.size(), /*upTo=*/true);
  transports[1]->isend(0, 6, big.data(), big.size());
  expectFailed(recv, "rank 1 sent 800 bytes where at most 400 were expected", "a larger message fails an upTo receive");
  expectInStep(transports, 7, "the connection survives it");
}

// A collective's tag carries a hash of its call (kCallTagMask): a message whose tag
// differs from a receive's only there fails the receive, whether the receive was
// posted first or the message arrived first; the stream stays in step.
void anotherCallFailsTheReceive() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  const uint64_t collective = 1ull << 63;
  for (bool postedFirst : {true, false}) {
    const uint64_t seq = postedFirst ? 7 : 8;
    expectRefused(transports, postedFirst, collective | (uint64_t(0x1234) << kCallTagShift) | seq,
                  collective | (uint64_t(0x4321) << kCallTagShift) | seq,
                  "rank 1 is in another call at this collective", "a message of another call fails the receive");
  }
  expectInStep(transports, 9, "the connection stays in step after it");
}

// A message of an earlier collective (a lower sequence number, mod 2^32, in the same
// tag space) fails the receive it meets, posted first or arrived first: its sender
// was in a call this rank finished without it. A peer that is ahead (a later
// collective's message waiting) fails nothing.
void earlierCallFailsTheReceive() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  const uint64_t collective = 1ull << 63;
  for (bool postedFirst : {true, false}) {
    for (uint64_t seq : {uint64_t(20), uint64_t(0)}) {  // 0: the earlier one is 2^32 - 1
      const uint64_t earlier = (seq - 1) & 0xffffffffull;
      expectRefused(transports, postedFirst, collective | seq, collective | earlier,
                    "rank 1 sent a message in collective #" + std::to_string(earlier) + " that this rank finished without it",
                    "a message of an earlier collective fails the receive (seq " + std::to_string(seq) + ")");
    }
  }
  // The peer is one collective ahead: its message waits for the receive that takes it.
  float ahead[4] = {5, 6, 7, 8}, now[4] = {1, 2, 3, 4}, got[4] = {}, later[4] = {};
  waitOk(transports[1]->isend(0, collective | 31, ahead, sizeof(ahead)));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // arrived: unexpected
  auto current = transports[0]->irecv(1, collective | 30, got, sizeof(got));
  transports[1]->isend(0, collective | 30, now, sizeof(now));
  auto next = transports[0]->irecv(1, collective | 31, later, sizeof(later));
  expect(waitOk(current) && waitOk(next) && got[0] == 1 && later[0] == 5,
         "a later collective's message fails nothing and is received in its turn");
  expectInStep(transports, 9, "the connection stays in step after it");
}

void sizeMismatchIsReported() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  std::vector<char> small(400), big(800);
  auto recv = transports[0]->irecv(1, 3, big.data(), big.size());
  transports[1]->isend(0, 3, small.data(), small.size());
  expectFailed(recv, "rank 1 sent 400 bytes where 800 were expected", "a size mismatch names the sender and both sizes");
  expectInStep(transports, 4, "the connection survives a mismatched message");
}

// A timeout names the receive it waits on by the collective's sequence number;
// a flow-control credit (kCreditTagBit) says so rather than showing 2^61 + n.
void pendingCreditIsNamed() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  char byte = 0;
  auto credit = transports[0]->irecv(1, (1ull << 63) | kCreditTagBit | 7, &byte, 0);
  const std::string pending = transports[0]->describePending(1);
  expect(pending.find("1 receive(s) posted (first tag 7 (a credit))") != std::string::npos,
         "a pending credit is named as one: " + pending);
  transports[1]->isend(0, (1ull << 63) | kCreditTagBit | 7, &byte, 0);
  expect(waitOk(credit), "the credit arrives");
}

void emptyMessagesIntoNullBuffers() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  bool ok = true;
  for (int i = 0; i < 20000 && ok; ++i) {
    // Alternate who posts first, so both the buffered and the direct paths run.
    RequestPtr recv, send;
    if (i % 2) {
      recv = transports[0]->irecv(1, 100 + i, nullptr, 0);
      send = transports[1]->isend(0, 100 + i, nullptr, 0);
    } else {
      send = transports[1]->isend(0, 100 + i, nullptr, 0);
      recv = transports[0]->irecv(1, 100 + i, nullptr, 0);
    }
    ok = waitOk(send) && waitOk(recv);
  }
  expect(ok, "20000 empty messages with null buffers all complete");
}

// Sends a 64 MiB message from rank 1 and has rank 0 post its receive as soon as
// the message's header has been read and buffered, so the receive usually
// claims it while its payload is still arriving (else it finds it complete).
RequestPtr receiveWhileArriving(std::vector<std::unique_ptr<TcpTransport>>& transports,
                                const std::vector<char>& sent, std::vector<char>& received) {
  auto send = transports[1]->isend(0, 5, sent.data(), sent.size());
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (transports[0]->describePending(1).find("arrived that no receive matched") == std::string::npos &&
         Clock::now() < deadline) {
  }
  auto recv = transports[0]->irecv(1, 5, received.data(), received.size());
  waitOk(send);
  return recv;
}

void receivesPostedWhileTheMessageArrives() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  std::vector<char> sent(64 << 20), received(sent.size());
  for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>(i * 131 + 7);
  auto recv = receiveWhileArriving(transports, sent, received);
  const bool claimed = !recv->completed();
  expect(waitOk(recv) && received == sent,
         std::string("a receive posted after its message began arriving gets all of it (") +
             (claimed ? "claimed while arriving" : "found complete") + ")");
  // The same with the wrong size: the receive fails at once, the rest of the
  // message is dropped, and the stream stays in step.
  std::vector<char> half(sent.size() / 2);
  auto mismatched = receiveWhileArriving(transports, sent, half);
  expect(mismatched->failed() && mismatched->error().find("rank 1 sent 67108864 bytes where 33554432 were "
                                                          "expected") != std::string::npos,
         "a receive of another size fails: " + mismatched->error());
  int value = 9, got = 0;
  auto next = transports[0]->irecv(1, 6, &got, sizeof(got));
  transports[1]->isend(0, 6, &value, sizeof(value));
  expect(waitOk(next) && got == 9, "the next message arrives intact");
}

// A header that announces 2^40 bytes no receive was posted for: the receiver
// allocates nothing (it used to try, and die of bad_alloc on its I/O thread);
// the stream waits unread, a rank waiting on that peer times out with the
// reason, and a receive posted for that tag fails at once naming the sender.
void hugeAnnouncementAllocatesNothing() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  {
    const ssize_t sent = TcpTransportProbe::sendHeader(*transports[1], 0, WireHeader{kDataMagic, 0, 5, 1ull << 40});
    expect(sent >= static_cast<ssize_t>(sizeof(WireHeader)), "a raw header announcing 2^40 bytes is sent");
  }
  int value = 0;
  auto other = transports[0]->irecv(1, 6, &value, sizeof(value));
  const bool waited = !other->waitUntil(Clock::now() + std::chrono::milliseconds(500));
  const std::string pending = transports[0]->describePending(1);
  expect(waited && pending.find("rank 1 announced a message of 1099511627776 bytes (tag 5) that no receive "
                                "matched; it waits unread") != std::string::npos,
         "the stream is parked, and a timeout can say why: " + pending);
  char small[16];
  auto claimed = transports[0]->irecv(1, 5, small, sizeof(small));
  claimed->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(claimed->failed() && claimed->error().find("rank 1 sent 1099511627776 bytes where 16 were expected") !=
                                  std::string::npos,
         "a receive for it fails at once, naming the sender: " + claimed->error());
}

// A peer failed off the I/O thread (as a failed send does) while one of its
// messages is half received and claimed by a receive: the receive fails, and
// the message is detached from it, so the I/O thread can never copy the rest
// into that receive's buffer after its owner has freed it.
void failedPeerDetachesHalfReceivedMessage() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  std::vector<char> sent(64 << 20, 1), received(sent.size());
  std::shared_ptr<void> message;
  RequestPtr recv;
  bool complete = true, waiting = false;
  {
    auto send = transports[1]->isend(0, 7, sent.data(), sent.size());
    // The sender stops mid-message while the test holds its send lock.
    std::lock_guard<std::mutex> stall(TcpTransportProbe::sendMutex(*transports[1], 0));
    // Until its header and first bytes arrived (held as unexpected). A fixed 200 ms
    // was not always enough on a loaded 2-core machine.
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (!TcpTransportProbe::firstUnexpected(*transports[0], 1, &complete, &waiting) && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    recv = transports[0]->irecv(1, 7, received.data(), received.size());
    message = TcpTransportProbe::firstUnexpected(*transports[0], 1, &complete, &waiting);
    expect(message && !complete && waiting, "a receive claimed the half-received message");
    TcpTransportProbe::failPeer(*transports[0], 1, "test: lost off the I/O thread");
  }
  expect(recv->completed() && recv->failed(), "its receive failed: " + recv->error());
  expect(message && !TcpTransportProbe::stillAttached(*transports[0], message),
         "the half-received message no longer points at that receive's buffer");
}


// Several streams per pair and several I/O threads: messages of every size
// (empty, tiny, just under and over the striping threshold, odd sizes that do
// not divide into stripes, 9 MiB) from two senders, receives posted before and
// after their messages and in another order than the sends, same-tag messages
// in FIFO order, a size mismatch on a striped message, and the unexpected
// budget parking a striped stream.
std::vector<char> pattern(size_t bytes, int seed) {
  std::vector<char> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>((i * 131 + seed * 17 + (i >> 12)) & 0xff);
  return data;
}

void stripedStreamsKeepEveryMessage() {
  MemoryStore store(kStoreTimeout);
  std::vector<TcpOptions> perRank(3);
  for (auto& o : perRank) {
    o.socketsPerPeer = 4;
    o.ioThreads = 2;
  }
  perRank[2].socketsPerPeer = 1;  // rank 0's choice wins
  Built built = meshOrErrors(3, store, std::chrono::milliseconds(20000), {}, perRank);
  for (int r = 0; r < 3; ++r) expect(built.errors[r].empty(), "rank " + std::to_string(r) + " connects: " + built.errors[r]);
  if (!built.errors[0].empty() || !built.errors[1].empty() || !built.errors[2].empty()) return;
  auto& t = built.transports;
  expect(TcpTransportProbe::socketsPerPeer(*t[2]) == 4 && TcpTransportProbe::ioThreads(*t[0]) == 2,
         "every rank uses rank 0's 4 streams per peer; 2 I/O threads");
  const std::vector<size_t> sizes = {0, 1, 7, (64 << 10) - 1, 128 << 10, (128 << 10) + 3, (256 << 10) + 4097,
                                     (1 << 20) + 13, (9 << 20) + 5};
  for (int round = 0; round < 2; ++round) {
    // Round 0: receives first, in reverse order; round 1: sends first (buffered).
    std::vector<std::vector<char>> sent, received;
    std::vector<RequestPtr> requests;
    std::vector<std::pair<int, size_t>> messages;  // (sender, size index)
    for (int sender = 1; sender <= 2; ++sender)
      for (size_t m = 0; m < sizes.size(); ++m) {
        messages.push_back({sender, m});
        sent.push_back(pattern(sizes[m], static_cast<int>(m) + 10 * sender + 100 * round));
        received.push_back(std::vector<char>(sizes[m], 0));
      }
    auto post = [&](size_t i, bool send) {
      const int sender = messages[i].first;
      const uint64_t tag = 1000 + messages[i].second;
      if (send) requests.push_back(t[sender]->isend(0, tag, sent[i].data(), sent[i].size()));
      else requests.push_back(t[0]->irecv(sender, tag, received[i].data(), received[i].size()));
    };
    for (int phase = 0; phase < 2; ++phase) {
      const bool sends = (phase == 0) == (round == 1);
      for (size_t j = 0; j < messages.size(); ++j) post(sends ? j : messages.size() - 1 - j, sends);
      if (round == 1 && phase == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    bool ok = true;
    for (auto& r : requests) ok = waitOk(r) && ok;
    expect(ok && received == sent, std::string("striped messages of every size arrive intact (") +
                                       (round == 0 ? "receives first, reversed" : "sends first, buffered") + ")");
  }
  // Same tag, two striped messages: FIFO.
  auto first = pattern(3 << 20, 1), second = pattern(3 << 20, 2);
  std::vector<char> got1(first.size()), got2(first.size());
  auto s1 = t[1]->isend(0, 7, first.data(), first.size());
  auto s2 = t[1]->isend(0, 7, second.data(), second.size());
  auto r1 = t[0]->irecv(1, 7, got1.data(), got1.size());
  auto r2 = t[0]->irecv(1, 7, got2.data(), got2.size());
  expect(waitOk(s1) && waitOk(s2) && waitOk(r1) && waitOk(r2) && got1 == first && got2 == second,
         "two striped messages of one tag arrive in the order sent");
  // A size mismatch on a striped message: the receive fails, every stream stays in step.
  std::vector<char> wrong(first.size() - 1);
  auto bad = t[0]->irecv(1, 8, wrong.data(), wrong.size());
  t[1]->isend(0, 8, first.data(), first.size());
  bad->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(bad->failed() && bad->error().find("rank 1 sent 3145728 bytes where 3145727 were expected") !=
                              std::string::npos,
         "a striped message of another size fails its receive: " + bad->error());
  auto next = t[0]->irecv(1, 9, got2.data(), got2.size());
  auto nextSend = t[1]->isend(0, 9, first.data(), first.size());
  expect(waitOk(next) && waitOk(nextSend) && got2 == first, "the next striped message arrives intact");
}

// Unexpected messages hold at most maxUnexpectedBytes; past it the stream waits
// for a receive (which then gets the data directly) and nothing is lost: over one
// stream, and over several (the striped parts of a parked message wait too).
void unexpectedBudgetKeepsEveryMessage(int sockets, int ioThreads, size_t bytes) {
  MemoryStore store(kStoreTimeout);
  TcpOptions options;
  options.maxUnexpectedBytes = 1 << 20;
  options.socketsPerPeer = sockets;
  options.ioThreads = ioThreads;
  auto transports = mesh(2, store, {}, options);
  const std::string streams =
      " (" + std::to_string(sockets) + " stream(s), " + std::to_string(bytes) + " bytes)";
  std::vector<std::vector<char>> sent, received;
  for (int m = 0; m < 3; ++m) {
    sent.push_back(pattern(bytes, m));
    received.push_back(std::vector<char>(bytes));
  }
  std::vector<RequestPtr> sends, recvs;
  for (int m = 0; m < 3; ++m) sends.push_back(transports[1]->isend(0, 10 + m, sent[m].data(), bytes));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // message 0 buffered, 1 parked
  const std::string pending = transports[0]->describePending(1);
  for (int m = 2; m >= 0; --m) recvs.push_back(transports[0]->irecv(1, 10 + m, received[m].data(), bytes));
  bool ok = true;
  for (auto& r : recvs) ok = waitOk(r) && ok;
  for (auto& s : sends) ok = waitOk(s) && ok;
  expect(pending.find("waits unread") != std::string::npos,
         "the message past the budget waited unread" + streams + ": " + pending);
  expect(ok && received == sent, "every message arrives intact, in any posting order" + streams);
}

// Wire integrity: a frame whose tag does not check (bytes altered in transit) fails
// the receive waiting on that peer, naming it, and nothing is delivered; without
// wire integrity (PYCOMM_WIRE=none) the same header is taken as it is.
void alteredFramesFailNamingThePeer() {
  {
    MemoryStore store(kStoreTimeout);
    auto transports = mesh(2, store);
    int value = 0;
    auto recv = transports[0]->irecv(1, 5, &value, sizeof(value));
    TcpTransportProbe::sendHeader(*transports[1], 0, WireHeader{kDataMagic, 0, 5, sizeof(int)}, true);
    const bool settled = recv->waitUntil(Clock::now() + std::chrono::seconds(10));
    expect(settled && recv->failed() && recv->error().find("from rank 1") != std::string::npos &&
               recv->error().find("integrity check") != std::string::npos,
           "a header with a wrong tag fails the receive, naming rank 1: " + recv->error());
  }
  {
    MemoryStore store(kStoreTimeout);
    std::vector<TcpOptions> options(2);
    for (auto& o : options) o.wire = kWireNone;
    auto built = meshOrErrors(2, store, std::chrono::milliseconds(10000), {}, options);
    int value = 0, sent = 42;
    auto recv = built.transports[0]->irecv(1, 5, &value, sizeof(value));
    TcpTransportProbe::sendHeader(*built.transports[1], 0, WireHeader{kDataMagic, 0, 5, sizeof(int)}, true);
    ::send(TcpTransportProbe::fd(*built.transports[1], 0), &sent, sizeof(sent), MSG_NOSIGNAL);
    expect(waitOk(recv) && value == 42, "with PYCOMM_WIRE=none the unauthenticated frame is taken (the control)");
  }
  {
    MemoryStore store(kStoreTimeout);
    std::vector<TcpOptions> options(2);
    options[1].wire = kWireNone;
    auto built = meshOrErrors(2, store, std::chrono::milliseconds(2000), {}, options);
    expect(!built.errors[1].empty() && built.errors[0].find("PYCOMM_WIRE=none, this rank integrity") != std::string::npos,
           "ranks with different wire modes do not connect: " + built.errors[0]);
  }
}

// Empty messages that no receive has claimed cost nothing against the byte budget
// but a record each: past maxUnexpectedMessages per peer the stream waits unread
// (as past the byte budget), so a peer cannot make this rank allocate records
// without bound; every message still arrives once receives are posted, and a
// receive posted for the message that waits unread takes it.
void emptyMessagesAreCounted() {
  MemoryStore store(kStoreTimeout);
  TcpOptions options;
  options.maxUnexpectedMessages = 64;
  auto transports = mesh(2, store, {}, options);
  constexpr int kMessages = 300;
  std::vector<RequestPtr> sends, recvs;
  for (int m = 0; m < kMessages; ++m) sends.push_back(transports[1]->isend(0, 1000 + m, nullptr, 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // 64 held, the next one parked
  const std::string pending = transports[0]->describePending(1);
  expect(pending.find("64 message(s) from rank 1") != std::string::npos &&
             pending.find("waits unread") != std::string::npos,
         "at most 64 empty messages are held; the next waits unread: " + pending);
  // The parked one (the 65th) first, then the rest in reverse order of the held ones.
  recvs.push_back(transports[0]->irecv(1, 1000 + 64, nullptr, 0));
  for (int m = kMessages - 1; m >= 0; --m)
    if (m != 64) recvs.push_back(transports[0]->irecv(1, 1000 + m, nullptr, 0));
  bool ok = true;
  for (auto& r : recvs) ok = waitOk(r) && ok;
  for (auto& s : sends) ok = waitOk(s) && ok;
  expect(ok, "every empty message arrives");
}

// A sender that goes away mid-message (its sockets close) fails the striped
// receive in progress and everything else waiting on it, on every stream; nothing hangs.
void lostPeerFailsEveryStream() {
  MemoryStore store(kStoreTimeout);
  TcpOptions options;
  options.socketsPerPeer = 4;
  options.ioThreads = 2;
  auto transports = mesh(3, store, {}, options);
  // Big enough that it is still on its way when rank 1 goes: 64 MiB over 4 streams on
  // a quiet loopback arrived whole within the 20 ms this test once slept.
  std::vector<char> big(256 << 20, 3), received(big.size());
  int small = 0;
  auto recv = transports[0]->irecv(1, 1, received.data(), received.size());
  auto later = transports[0]->irecv(1, 2, &small, sizeof(small));
  auto fromTwo = transports[2]->irecv(1, 3, received.data(), 1 << 20);
  auto send = transports[1]->isend(0, 1, big.data(), big.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // some of it is on its way
  transports[1].reset();  // rank 1 goes away: its sockets close (abort notice only between messages)
  const auto start = Clock::now();
  bool settled = recv->waitUntil(Clock::now() + std::chrono::seconds(10)) &&
                 later->waitUntil(Clock::now() + std::chrono::seconds(10)) &&
                 fromTwo->waitUntil(Clock::now() + std::chrono::seconds(10));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Destroying rank 1's transport stops its I/O threads, and one that can still write
  // may finish the message first (it did in a full test run, with the socket buffers
  // grown by earlier tests): then the big receive completes, and its data must be whole.
  // Either way nothing after it arrives, and nothing hangs.
  const bool bigSettled = recv->failed() || (recv->completed() && received == big);
  expect(settled && bigSettled && later->failed() && fromTwo->failed() && seconds < 5,
         "every receive from the lost peer fails (the one in progress: fails, or completes intact), within " +
             std::to_string(seconds) + " s: " + recv->error() + " | " + later->error() + " | " + fromTwo->error());
  auto after = transports[0]->isend(1, 4, &small, sizeof(small));
  after->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(after->failed(), "a later send to it fails: " + after->error());
  int value = 11, got = 0;
  auto r = transports[0]->irecv(2, 5, &got, sizeof(got));
  auto s = transports[2]->isend(0, 5, &value, sizeof(value));
  expect(waitOk(r) && waitOk(s) && got == 11, "the survivors still talk over their own streams");
}

// A peer that sends a striped message whole and then leaves (abort notice on stream
// 0, then its sockets close) must not take that message with it: the notice can be
// read before the message's other stripes are (another stream, maybe another I/O
// thread). Made certain here: the receiver holds no unexpected bytes, so stream 0
// waits unread at the header until the receive is posted, and its one I/O thread
// then reads stripe 0 and the notice before it turns to stream 1. A pytorch rank
// that leaves right after its last all-reduce (destroy_process_group) did this to
// its peers' last call with 2 streams per peer.
void leavingPeerStillDeliversWhatItSent() {
  MemoryStore store(kStoreTimeout);
  TcpOptions options;
  options.socketsPerPeer = 2;
  options.ioThreads = 1;
  options.maxUnexpectedBytes = 0;
  auto transports = mesh(2, store, {}, options);
  const auto sent = pattern(160 << 10, 5);  // two stripes of 80 KiB
  std::vector<char> received(sent.size());
  auto send = transports[1]->isend(0, 3, sent.data(), sent.size());
  expect(waitOk(send), "the sender's striped message is all written before it leaves");
  transports[1]->abort("the process group was shut down");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // message, notice and ends all arrived
  auto recv = transports[0]->irecv(1, 3, received.data(), received.size());
  expect(waitOk(recv) && received == sent,
         "a message the peer sent whole before leaving arrives whole: " + recv->error());
  int one = 0;
  auto later = transports[0]->irecv(1, 4, &one, sizeof(one));
  later->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(later->failed() && later->error().find("rank 1 aborted the group: the process group was shut down") !=
                                std::string::npos,
         "a receive for what it never sent fails with its reason: " + later->error());
}

// A peer that aborts closes its sockets with this rank's bytes unread in them, so
// the kernel answers with a reset right behind its abort notice; a send that meets
// the reset before this rank's I/O thread read the notice must not fail the peer as
// lost: the notice, already in the socket, names the reason. Made (nearly) certain
// by holding this rank's one I/O thread in a write to another peer (`viaIoThread`
// false: the posting thread's own write meets the reset) or to the aborting peer
// itself (true: the I/O thread's write does), so nothing reads the notice until
// the send has failed. (An I/O thread that had not reached that write yet may
// read the notice first: such a round passes with or without the fix.) The same
// race, unchecked, reports a comm hook that raises on one rank to its peers as "lost
// the connection (Broken pipe)" (tests/hooks/test_hooks_checkpoint.py).
void sendsMeetingAnAbortResetReportTheNotice(bool viaIoThread) {
  const std::string reason = "test: a hook raised ValueError";
  const std::string expected = "rank 1 aborted the group: " + reason;
  const std::string path = viaIoThread ? "the I/O thread's write" : "the posting thread's write";
  // Big enough to outlast the socket buffers: its write waits for the receiver.
  std::vector<char> big(64 << 20, 1);
  int bad = 0, counted = 0;
  std::string firstBad;
  const int rounds = 10;
  for (int attempt = 0; attempt < 3 * rounds && counted < rounds; ++attempt) {
    MemoryStore store(kStoreTimeout);
    TcpOptions options;
    options.maxUnexpectedBytes = 0;  // rank 1 leaves a message unread: its close resets
    auto transports = mesh(viaIoThread ? 2 : 3, store, {}, options);
    const int stalled = viaIoThread ? 1 : 2;  // the peer whose write holds rank 0's I/O thread
    auto drain = transports[stalled]->irecv(0, 1, big.data(), big.size());
    auto bulk = transports[0]->isend(stalled, 1, big.data(), big.size());
    RequestPtr probe;
    bool written = false;
    {
      std::unique_lock<std::mutex> hold(TcpTransportProbe::sendMutex(*transports[0], stalled));
      // The posting thread may have written it all while the receiver kept pace:
      // then no write waits, and the round proves nothing.
      written = bulk->completed();
      // The receiver drains what was written; the I/O thread wakes to write more
      // and waits for this lock.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      int value = 1;
      if (!viaIoThread) {
        auto unread = transports[0]->isend(1, 2, &value, sizeof(value));
        waitOk(unread);  // in rank 1's socket; it parks at the header
      }
      transports[1]->abort(reason);
      // The notice, then the reset, have reached rank 0; its I/O thread read neither.
      if (!viaIoThread) probe = transports[0]->isend(1, 3, &value, sizeof(value));
    }
    const RequestPtr& failed = viaIoThread ? bulk : probe;
    failed->waitUntil(Clock::now() + std::chrono::seconds(10));
    if (!written) {
      ++counted;
      if (!failed->failed() || failed->error().find(expected) == std::string::npos)
        if (bad++ == 0) firstBad = failed->completed() ? failed->error() : "(still pending)";
    }
    for (auto& t : transports)
      if (t) t->abort("test done");
  }
  expect(counted == rounds && bad == 0,
         "a send meeting the reset of a peer that aborted (" + path + ") reports its notice in every one of " +
             std::to_string(counted) + " rounds (" + std::to_string(bad) + " did not" +
             (bad > 0 ? ", first: " + firstBad : std::string()) + ")");
}

}  // namespace

int main() {
  strayConnectionsAreRejected();
  silentConnectionsDoNotStallStartup();
  connectHonoursTheTimeout();
  connectorAuthenticatesTheAcceptor();
  unprovenClaimsBlockNobody();
  secretsOutsideTheStore();
  shortSecretsAreRefused();
  abortNoticeNamesTheFirstFailure();
  sizeMismatchIsReported();
  receivesUpToTheBufferSize();
  anotherCallFailsTheReceive();
  earlierCallFailsTheReceive();
  emptyMessagesIntoNullBuffers();
  pendingCreditIsNamed();
  receivesPostedWhileTheMessageArrives();
  hugeAnnouncementAllocatesNothing();
  unexpectedBudgetKeepsEveryMessage(1, 1, 768 << 10);
  emptyMessagesAreCounted();
  alteredFramesFailNamingThePeer();
  failedPeerDetachesHalfReceivedMessage();
  stripedStreamsKeepEveryMessage();
  unexpectedBudgetKeepsEveryMessage(3, 2, (768 << 10) + 1);
  lostPeerFailsEveryStream();
  leavingPeerStillDeliversWhatItSent();
  sendsMeetingAnAbortResetReportTheNotice(false);
  sendsMeetingAnAbortResetReportTheNotice(true);
  std::cout << (failures == 0 ? "all passed" : "FAILURES: " + std::to_string(failures)) << std::endl;
  return failures == 0 ? 0 : 1;
}
