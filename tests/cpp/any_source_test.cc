// Receives from any source (kAnySource) on the TCP transport once peers are lost:
// while one peer lives such a receive waits for it; once every peer is lost it fails,
// naming a lost peer, instead of waiting for the caller's timeout (found by
// tests/fuzz/fuzz_frames.cc; its input is tests/fuzz/corpus/fuzz_frames/any_source_after_peer_left).
// Built and run by tests/transport/test_any_source_cpp.py; one line per check.
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/memory_store.h"
#include "transport/tcp.h"

using namespace pycomm;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

std::vector<std::unique_ptr<TcpTransport>> mesh(int n, MemoryStore& store) {
  std::vector<std::unique_ptr<TcpTransport>> transports(n);
  std::vector<std::thread> threads;
  TcpOptions options;
  options.connectTimeout = std::chrono::seconds(20);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] { transports[r] = std::make_unique<TcpTransport>(r, n, store, options); });
  for (auto& t : threads) t.join();
  return transports;
}

bool settlesWithin(const RequestPtr& request, std::chrono::milliseconds limit) {
  return request->waitUntil(Clock::now() + limit);
}

void lastPeerLostFailsAnySourceReceives() {
  MemoryStore store;
  auto t = mesh(2, store);
  char byte = 0;
  RequestPtr pending = t[0]->irecv(kAnySource, 5, &byte, 1);
  t[1].reset();  // rank 1 leaves
  expect(settlesWithin(pending, std::chrono::seconds(10)) && pending->failed(),
         "an any-source receive fails once its only peer is lost");
  expect(pending->error().find("rank 1") != std::string::npos, "its error names rank 1: " + pending->error());
  RequestPtr later = t[0]->irecv(kAnySource, 5, &byte, 1);
  expect(later->completed() && later->failed(), "an any-source receive posted after that fails at once");
}

void anySourceWaitsWhileAPeerLives() {
  MemoryStore store;
  auto t = mesh(3, store);
  int value = 0;
  RequestPtr pending = t[0]->irecv(kAnySource, 9, &value, sizeof(value));
  t[2].reset();  // one of two peers leaves
  // Rank 0 sees rank 2 leave before anything comes from rank 1 (a message on another tag proves it).
  char byte = 0;
  RequestPtr fromTwo = t[0]->irecv(2, 1, &byte, 1);
  expect(settlesWithin(fromTwo, std::chrono::seconds(10)) && fromTwo->failed(), "rank 0 saw rank 2 leave");
  expect(!pending->completed(), "an any-source receive still waits while rank 1 lives");
  const int sent = 42;
  RequestPtr send = t[1]->isend(0, 9, &sent, sizeof(sent));
  expect(settlesWithin(pending, std::chrono::seconds(10)) && !pending->failed() && value == 42 &&
             pending->sourceRank() == 1,
         "and completes with rank 1's message");
  expect(settlesWithin(send, std::chrono::seconds(10)) && !send->failed(), "rank 1's send completes");
  RequestPtr last = t[0]->irecv(kAnySource, 9, &value, sizeof(value));
  t[1].reset();
  expect(settlesWithin(last, std::chrono::seconds(10)) && last->failed(),
         "then fails once rank 1 is lost too: " + last->error());
}

}  // namespace

int main() {
  lastPeerLostFailsAnySourceReceives();
  anySourceWaitsWhileAPeerLives();
  if (failures) {
    std::cout << failures << " failed" << std::endl;
    return 1;
  }
  std::cout << "all passed" << std::endl;
  return 0;
}
