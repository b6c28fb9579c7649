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
#include <string>
#include <thread>
#include <vector>

#include "transport/memory_store.h"
#include "transport/tcp.h"
#include "transport/wire.h"

using namespace pycomm;

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
                                                std::function<void()> whileConnecting = {}) {
  std::vector<std::unique_ptr<TcpTransport>> transports(n);
  std::vector<std::thread> threads;
  TcpOptions options;
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

}  // namespace

int main() {
  strayConnectionsAreRejected();
  abortNoticeNamesTheFirstFailure();
  sizeMismatchIsReported();
  emptyMessagesIntoNullBuffers();
  receivesPostedWhileTheMessageArrives();
  std::cout << (failures == 0 ? "all passed" : "FAILURES: " + std::to_string(failures)) << std::endl;
  return failures == 0 ? 0 : 1;
}
