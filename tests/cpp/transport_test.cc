// Torch-free tests of the TCP transport, several ranks as threads of one
// process. Built and run by tests/test_transport_cpp.py; prints one line per
// check and exits non-zero on the first failure.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
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
  static std::mutex& sendMutex(TcpTransport& t, int peer) { return t.peers_[peer]->sendMutex; }
  static int fd(TcpTransport& t, int peer) { return t.peers_[peer]->fd; }
  // The first message from `peer` that arrived before its receive, and whether it
  // is complete and claimed by a waiting receive.
  static std::shared_ptr<void> firstUnexpected(TcpTransport& t, int peer, bool* complete, bool* waiting) {
    std::lock_guard<std::mutex> lock(t.mutex_);
    auto& queue = t.peers_[peer]->unexpected;
    if (queue.empty()) return nullptr;
    *complete = queue.front()->complete;
    *waiting = queue.front()->claim == TcpTransport::Unexpected::Claim::kWaiting;
    return queue.front();
  }
  // Whether that message still hands its data to a receive when it ends.
  static bool stillAttached(TcpTransport& t, const std::shared_ptr<void>& message) {
    std::lock_guard<std::mutex> lock(t.mutex_);
    auto& u = *std::static_pointer_cast<TcpTransport::Unexpected>(message);
    return u.claim == TcpTransport::Unexpected::Claim::kWaiting || u.waiter.request != nullptr;
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

void strayConnectionsAreRejected() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store, [&] {
    const std::string rank0 = store.get("addr/0");
    // 1: garbage bytes; 2: a well-formed hello without the job secret; 3: silence, then close.
    int garbage = connectTo(rank0);
    const char junk[32] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    ssize_t sent = ::send(garbage, junk, sizeof(junk), MSG_NOSIGNAL);
    (void)sent;
    int impostor = connectTo(rank0);
    Hello hello{kHelloMagic, kWireVersion, 1, 2, {}};
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

void sizeMismatchIsReported() {
  MemoryStore store(kStoreTimeout);
  auto transports = mesh(2, store);
  std::vector<char> small(400), big(800);
  auto recv = transports[0]->irecv(1, 3, big.data(), big.size());
  transports[1]->isend(0, 3, small.data(), small.size());
  recv->waitUntil(Clock::now() + std::chrono::seconds(10));
  expect(recv->failed() && recv->error().find("rank 1 sent 400 bytes where 800 were expected") !=
                               std::string::npos,
         "a size mismatch names the sender and both sizes: " + recv->error());
  // The stream stays in step: the next message arrives intact.
  int value = 5, received = 0;
  auto next = transports[0]->irecv(1, 4, &received, sizeof(received));
  transports[1]->isend(0, 4, &value, sizeof(value));
  expect(waitOk(next) && received == 5, "the connection survives a mismatched message");
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
    std::lock_guard<std::mutex> lock(TcpTransportProbe::sendMutex(*transports[1], 0));
    WireHeader header{kDataMagic, 0, 5, 1ull << 40};
    ssize_t sent = ::send(TcpTransportProbe::fd(*transports[1], 0), &header, sizeof(header), MSG_NOSIGNAL);
    expect(sent == sizeof(header), "a raw header announcing 2^40 bytes is sent");
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

// Unexpected messages hold at most maxUnexpectedBytes; past it the stream waits
// for a receive (which then gets the data directly) and nothing is lost.
void unexpectedBudgetKeepsEveryMessage() {
  MemoryStore store(kStoreTimeout);
  TcpOptions options;
  options.maxUnexpectedBytes = 1 << 20;
  auto transports = mesh(2, store, {}, options);
  const size_t bytes = 768 << 10;
  std::vector<std::vector<char>> sent(3, std::vector<char>(bytes)), received = sent;
  for (int m = 0; m < 3; ++m)
    for (size_t i = 0; i < bytes; ++i) sent[m][i] = static_cast<char>(i * 7 + m);
  std::vector<RequestPtr> sends, recvs;
  for (int m = 0; m < 3; ++m) sends.push_back(transports[1]->isend(0, 10 + m, sent[m].data(), bytes));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // message 0 buffered, 1 parked
  const std::string pending = transports[0]->describePending(1);
  for (int m = 2; m >= 0; --m) recvs.push_back(transports[0]->irecv(1, 10 + m, received[m].data(), bytes));
  bool ok = true;
  for (auto& r : recvs) ok = waitOk(r) && ok;
  for (auto& s : sends) ok = waitOk(s) && ok;
  expect(pending.find("waits unread") != std::string::npos,
         "the message past the budget waited unread: " + pending);
  expect(ok && received == sent, "every message arrives intact, in any posting order");
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
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    recv = transports[0]->irecv(1, 7, received.data(), received.size());
    message = TcpTransportProbe::firstUnexpected(*transports[0], 1, &complete, &waiting);
    expect(message && !complete && waiting, "a receive claimed the half-received message");
    TcpTransportProbe::failPeer(*transports[0], 1, "test: lost off the I/O thread");
  }
  expect(recv->completed() && recv->failed(), "its receive failed: " + recv->error());
  expect(message && !TcpTransportProbe::stillAttached(*transports[0], message),
         "the half-received message no longer points at that receive's buffer");
}

}  // namespace

int main() {
  strayConnectionsAreRejected();
  abortNoticeNamesTheFirstFailure();
  sizeMismatchIsReported();
  emptyMessagesIntoNullBuffers();
  receivesPostedWhileTheMessageArrives();
  hugeAnnouncementAllocatesNothing();
  unexpectedBudgetKeepsEveryMessage();
  failedPeerDetachesHalfReceivedMessage();
  std::cout << (failures == 0 ? "all passed" : "FAILURES: " + std::to_string(failures)) << std::endl;
  return failures == 0 ? 0 : 1;
}
