// A block a peer sends as soon as it can must land in a receive already posted,
// not in the TCP transport's unexpected-message buffer (allocated per message,
// then copied out: it made a 64 MiB sharded all-reduce on 2 ranks over loopback
// take 79.5 ms instead of 57.9, docs/planner.md "Open").
//
// Sharded all-reduce on 2, 3 and 4 ranks as threads over TCP, started one after
// another, rank 0 last: what a rank sends to ranks not started yet is buffered
// there, and is the only thing that may be. Rank 0 starts with its sends held
// back (they complete 300 ms late, as a slow link or a busy core would make
// them): meanwhile the others get rank 0's data, reduce it and send their
// reduced blocks. Those must find their receives posted.
//
// The tree reduce on 4 and 5 ranks, every parent starting after its children:
// a child may send the first window of segments before its parent posts, and the
// rest only on the parent's credits, so nothing else may be buffered.
//
// The ring all-reduce on 2, 3 and 4 ranks, each starting after its right
// neighbour (rank 0 last): a rank sends a step only on its right neighbour's
// credit, so nothing may be buffered. Before the ring's credits 2.1, 4.9-5.9 and
// 9.7-10.0 MB arrived early on 2, 3 and 4 ranks (a left neighbour runs ahead of
// a rank that has not started, and of the ranks behind it).
// Built and run by tests/transport/test_placement_cpp.py; one line per check.
#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/comm.h"
#include "common/stats.h"
#include "transport/memory_store.h"
#include "transport/tcp.h"

using namespace pycomm;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

// Forwards to a transport, but the sends posted in the first `hold` complete
// only once it has passed (after the real send has).
class HeldSends : public Transport {
 public:
  HeldSends(Transport& inner, std::chrono::milliseconds hold)
      : inner_(inner), releaser_([this, hold] { release(Clock::now() + hold); }) {}
  ~HeldSends() override { releaser_.join(); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* name() const override { return "held-sends"; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    RequestPtr sent = inner_.isend(peer, tag, data, bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    if (released_) return sent;
    auto held = std::make_shared<Request>(peer, bytes);
    held_.emplace_back(sent, held);
    return held;
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo = false) override {
    return inner_.irecv(peer, tag, data, bytes, upTo);
  }
  void abort(const std::string& reason) override { inner_.abort(reason); }
  std::string describePending(int peer) override { return inner_.describePending(peer); }
  uint64_t bytesSent() const override { return inner_.bytesSent(); }
  uint64_t bytesReceived() const override { return inner_.bytesReceived(); }

 private:
  void release(Clock::time_point at) {
    std::this_thread::sleep_until(at);
    std::vector<std::pair<RequestPtr, RequestPtr>> held;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      released_ = true;
      held.swap(held_);
    }
    for (auto& [sent, proxy] : held) {
      sent->waitUntil(Clock::now() + std::chrono::seconds(10));
      if (sent->failed()) proxy->fail(sent->error());
      else if (sent->completed()) proxy->complete();
      else proxy->fail("the held send did not complete in 10 s");
    }
  }
  Transport& inner_;
  std::mutex mutex_;
  bool released_ = false;
  std::vector<std::pair<RequestPtr, RequestPtr>> held_;
  std::thread releaser_;
};

// `n` TCP ranks in this process, connected in parallel (their constructors rendezvous).
std::vector<std::unique_ptr<TcpTransport>> connectRanks(int n, MemoryStore& store, const std::string& prefix) {
  std::vector<std::unique_ptr<TcpTransport>> transports(n);
  std::vector<std::thread> threads;
  TcpOptions options;
  options.storePrefix = prefix;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] { transports[r] = std::make_unique<TcpTransport>(r, n, store, options); });
  for (auto& t : threads) t.join();
  return transports;
}

// Runs body(r) for every rank on its own thread, rank k starting (n - 1 - k) x
// 200 ms after rank n - 1 (rank 0 last); returns each rank's outcome: "returned",
// or what it threw.
std::vector<std::string> runStaggered(int n, const std::function<void(int)>& body) {
  std::vector<std::string> outcome(n);
  std::vector<std::thread> threads;
  for (int r = n - 1; r >= 0; --r)
    threads.emplace_back([&, r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200) * (n - 1 - r));
      try {
        body(r);
        outcome[r] = "returned";
      } catch (const std::exception& e) {
        outcome[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return outcome;
}

// Every rank returned and holds 1 + 2 + ... + n in every element (rank r
// contributed r + 1): one check line, named `what`.
void expectSums(const std::string& what, int n, const std::vector<std::string>& outcome,
                const std::vector<std::vector<float>>& data) {
  const float sum = static_cast<float>(n * (n + 1) / 2);
  bool correct = true, returned = true;
  for (int r = 0; r < n; ++r) {
    returned = returned && outcome[r] == "returned";
    for (float v : data[r]) correct = correct && v == sum;
  }
  expect(returned && correct, strCat(what, ", ", n, " ranks: ", returned ? "every rank returned" : outcome[0],
                                     ", every element ", correct ? "right" : "WRONG"));
}

// The sharded all-reduce on `n` ranks; rank k starts (n - 1 - k) x 200 ms after
// the last one, so the reduce-scatter data a rank sends to ranks that have not
// started yet is buffered there: that, and nothing else, may be. Rank 0, the last
// to start, has its sends held for 300 ms, in which the others finish their
// reduce-scatter and send it their reduced blocks.
void sharded(int n) {
  constexpr size_t kCount = 1 << 20;  // floats: 4 MiB, several 256 KiB segments per block
  MemoryStore store(std::chrono::seconds(20));
  auto transports = connectRanks(n, store, strCat("sharded", n, "/"));
  // What may arrive early: halving-doubling (power of two) sends a rank's partner
  // at distance n/2 half the buffer first; the direct exchange sends every peer
  // its shard.
  const std::vector<size_t> shards = balancedOffsets(kCount, n);
  uint64_t early = 0;
  for (int k = 0; k < n; ++k)
    for (int p = 0; p < k; ++p) {  // k starts before p
      if ((n & (n - 1)) == 0) {
        if (p == (k ^ (n / 2))) early += kCount / 2 * sizeof(float);
      } else {
        early += (shards[p + 1] - shards[p]) * sizeof(float);
      }
    }
  // On 4 ranks rank 1 also finishes its first step (with rank 3) before rank 0
  // starts, and sends rank 0 its quarter of the second step (distance 1). Rank 3
  // sends its quarter to rank 2 while rank 2 is still in its first step (waiting
  // for rank 0): that one must land, every step's receives being posted at once.
  if (n == 4) early += kCount / 4 * sizeof(float);
  const uint64_t bufferedBefore = Stats::instance().buffered();
  std::vector<std::vector<float>> data(n);
  for (int r = 0; r < n; ++r) data[r].assign(kCount, static_cast<float>(r + 1));
  const std::vector<std::string> outcome = runStaggered(n, [&](int r) {
    std::unique_ptr<HeldSends> held;
    if (r == 0) held = std::make_unique<HeldSends>(*transports[0], std::chrono::milliseconds(300));
    Comm comm(held ? static_cast<Transport&>(*held) : *transports[r], std::chrono::seconds(20), 256 << 10);
    comm.begin("allreduce");
    allreduceSharded(comm, data[r].data(), kCount, DataType::kFloat32, ReduceOp::kSum);
  });
  const uint64_t buffered = Stats::instance().buffered() - bufferedBefore;
  expectSums("sharded", n, outcome, data);
  expect(buffered == early, strCat("sharded, ", n, " ranks, rank 0's sends held: ", buffered,
                                   " bytes arrived before their receive (only the ", early,
                                   " sent before the receiver could post may)"));
  for (auto& t : transports) t->abort("test done");
}

// The tree reduce to rank 0 on `n` ranks, rank k starting (n - 1 - k) x 200 ms
// after the last one: every parent starts after its children. A child may send
// its parent the first window (8 segments) before the parent posts anything;
// the rest it sends only as the parent posts their receives (one credit each).
// Before credits a child sent everything at once, and a parent that was late
// (or slow to reduce) had all of it buffered.
void treeReduce(int n) {
  constexpr size_t kCount = 1 << 20;  // floats: 4 MiB, 16 segments of 256 KiB
  constexpr size_t kSegment = 256 << 10;
  constexpr size_t kWindow = 8;  // tree.cc's kReduceWindow
  MemoryStore store(std::chrono::seconds(20));
  auto transports = connectRanks(n, store, strCat("tree", n, "/"));
  // Every rank but the root has a parent that starts after it.
  const uint64_t early = static_cast<uint64_t>(n - 1) * kWindow * kSegment;
  const uint64_t bufferedBefore = Stats::instance().buffered();
  std::vector<std::vector<float>> data(n);
  for (int r = 0; r < n; ++r) data[r].assign(kCount, static_cast<float>(r + 1));
  const std::vector<std::string> outcome = runStaggered(n, [&](int r) {
    Comm comm(*transports[r], std::chrono::seconds(20), kSegment);
    comm.begin("reduce");
    reduceTree(comm, data[r].data(), kCount, DataType::kFloat32, ReduceOp::kSum, 0);
  });
  const uint64_t buffered = Stats::instance().buffered() - bufferedBefore;
  const float sum = static_cast<float>(n * (n + 1) / 2);
  bool returned = true;
  for (int r = 0; r < n; ++r) returned = returned && outcome[r] == "returned";
  bool correct = true;
  for (float v : data[0]) correct = correct && v == sum;
  expect(returned && correct, strCat("tree reduce, ", n, " ranks: ", returned ? "every rank returned" : outcome[0],
                                     ", the root's elements ", correct ? "right" : "WRONG"));
  expect(buffered == early, strCat("tree reduce, ", n, " ranks, parents late: ", buffered,
                                   " bytes arrived before their receive (only the first window per child, ",
                                   early, ", may)"));
  for (auto& t : transports) t->abort("test done");
}

// The ring all-reduce on `n` ranks, rank k starting (n - 1 - k) x 200 ms after the
// last one: rank n-1 sends to rank 0, the last to start, and rank k-1 starts after
// rank k. Steps of 1 MiB and up are sent only on the receiver's credit.
void ringAllreduce(int n) {
  constexpr size_t kCount = 1 << 20;  // floats: 4 MiB, chunks of 1-2 MiB (ring.cc credits from 1 MiB)
  MemoryStore store(std::chrono::seconds(20));
  auto transports = connectRanks(n, store, strCat("ring", n, "/"));
  const uint64_t bufferedBefore = Stats::instance().buffered();
  std::vector<std::vector<float>> data(n);
  for (int r = 0; r < n; ++r) data[r].assign(kCount, static_cast<float>(r + 1));
  const std::vector<std::string> outcome = runStaggered(n, [&](int r) {
    Comm comm(*transports[r], std::chrono::seconds(20), 256 << 10);
    comm.begin("allreduce");
    allreduceRing(comm, data[r].data(), kCount, DataType::kFloat32, ReduceOp::kSum);
  });
  const uint64_t buffered = Stats::instance().buffered() - bufferedBefore;
  expectSums("ring", n, outcome, data);
  expect(buffered == 0, strCat("ring, ", n, " ranks, each started after its right neighbour: ", buffered,
                               " bytes arrived before their receive (none may)"));
  for (auto& t : transports) t->abort("test done");
}

// The ring all-gather with uneven chunks, one of them empty (the sparse all-reduce
// gathers payloads like that): the step that moves the empty chunk sends nothing,
// and the steps around it still go on their credits. Started as above.
void ringAllgatherUneven() {
  const std::vector<size_t> bytes = {3 << 20, 0, 2 << 20};  // credited: the largest chunk is 3 MiB
  const int n = static_cast<int>(bytes.size());
  MemoryStore store(std::chrono::seconds(20));
  auto transports = connectRanks(n, store, "allgather/");
  std::vector<std::vector<std::vector<char>>> out(n);  // out[rank][chunk]
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < n; ++c) out[r].emplace_back(bytes[c], r == c ? static_cast<char>('a' + c) : 0);
  const uint64_t bufferedBefore = Stats::instance().buffered();
  const std::vector<std::string> outcome = runStaggered(n, [&](int r) {
    Comm comm(*transports[r], std::chrono::seconds(20), 256 << 10);
    comm.begin("allgather");
    std::vector<char*> chunks;
    for (auto& chunk : out[r]) chunks.push_back(chunk.data());
    ringAllgather(comm, chunks, bytes);
  });
  const uint64_t buffered = Stats::instance().buffered() - bufferedBefore;
  bool correct = true, returned = true;
  for (int r = 0; r < n; ++r) {
    returned = returned && outcome[r] == "returned";
    for (int c = 0; c < n; ++c)
      for (char v : out[r][c]) correct = correct && v == 'a' + c;
  }
  expect(returned && correct, strCat("ring all-gather, 3, 0 and 2 MiB: ", returned ? "every rank returned" : outcome[0],
                                     ", every byte ", correct ? "right" : "WRONG"));
  expect(buffered == 0, strCat("ring all-gather, uneven: ", buffered, " bytes arrived before their receive (none may)"));
  for (auto& t : transports) t->abort("test done");
}

}  // namespace

int main() {
  sharded(2);  // recursive halving, then doubling
  sharded(4);
  sharded(3);  // direct exchange
  treeReduce(4);
  treeReduce(5);
  ringAllreduce(2);
  ringAllreduce(3);
  ringAllreduce(4);
  ringAllgatherUneven();
  if (failures) {
    std::cout << failures << " check(s) failed" << std::endl;
    return 1;
  }
  std::cout << "all passed" << std::endl;
  return 0;
}
