// A collective that fails must leave no receive posted into memory it is about
// to free (issue #13). Each collective runs on 3 ranks as threads over TCP;
// rank 2 never calls it, so ranks 0 and 1 time out in the middle of it. Every
// request the collective posted is recorded; once the collective has returned or
// thrown, none may still be pending: a pending receive is one the transport's
// I/O thread could still write into after the collective's locals are gone.
// Built and run by tests/transport/test_failure_cpp.py; one line per check.
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/comm.h"
#include "transport/memory_store.h"
#include "transport/tcp.h"

using namespace pycomm;

namespace {

constexpr int kRanks = 3;
constexpr std::chrono::milliseconds kCollectiveTimeout{300};

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

// Forwards to a transport and keeps every request it hands out.
class RecordingTransport : public Transport {
 public:
  explicit RecordingTransport(Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* name() const override { return "recording"; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return keep(inner_.isend(peer, tag, data, bytes));
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo = false) override {
    return keep(inner_.irecv(peer, tag, data, bytes, upTo));
  }
  void abort(const std::string& reason) override { inner_.abort(reason); }
  std::string describePending(int peer) override { return inner_.describePending(peer); }
  uint64_t bytesSent() const override { return inner_.bytesSent(); }
  uint64_t bytesReceived() const override { return inner_.bytesReceived(); }

  // Requests neither done nor failed.
  int pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    int count = 0;
    for (auto& request : requests_)
      if (!request->completed()) ++count;
    return count;
  }

 private:
  RequestPtr keep(RequestPtr request) {
    std::lock_guard<std::mutex> lock(mutex_);
    requests_.push_back(request);
    return request;
  }
  Transport& inner_;
  std::mutex mutex_;
  std::vector<RequestPtr> requests_;
};

using Collective = std::function<void(Comm&)>;

// Runs `collective` on ranks 0 and 1 (rank 2 stays away) and checks that on each
// it either finished or threw a runtime error, with nothing left pending.
void check(const std::string& name, const Collective& collective) {
  MemoryStore store(std::chrono::seconds(20));
  std::vector<std::unique_ptr<TcpTransport>> transports(kRanks);
  {
    std::vector<std::thread> threads;
    TcpOptions options;
    options.storePrefix = name + "/";
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] { transports[r] = std::make_unique<TcpTransport>(r, kRanks, store, options); });
    for (auto& t : threads) t.join();
  }
  std::string outcome[2];
  int pending[2] = {0, 0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      RecordingTransport recording(*transports[r]);
      Comm comm(recording, kCollectiveTimeout, 1 << 16);
      comm.begin(name);
      try {
        collective(comm);
        outcome[r] = "returned";
      } catch (const Error& e) {
        outcome[r] = e.kind() == ErrorKind::kUsage ? std::string("usage error: ") + e.what() : "failed";
      }
      pending[r] = recording.pending();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    expect(outcome[r].rfind("usage", 0) != 0 && pending[r] == 0,
           strCat(name, ": rank ", r, " ", outcome[r], " with ", pending[r], " request(s) still pending"));
  for (auto& t : transports) t->abort("test done");
}

}  // namespace

int main() {
  constexpr size_t kCount = 1 << 15;  // floats: several pipeline segments at 64 KiB
  const DataType f32 = DataType::kFloat32;
  check("allreduce ring", [&](Comm& comm) {
    std::vector<float> buf(kCount, 1.0f);
    allreduceRing(comm, buf.data(), buf.size(), f32, ReduceOp::kSum);
  });
  check("allreduce tree", [&](Comm& comm) {
    std::vector<float> buf(kCount, 1.0f);
    allreduceTree(comm, buf.data(), buf.size(), f32, ReduceOp::kSum);
  });
  check("allreduce sharded", [&](Comm& comm) {
    std::vector<float> buf(kCount, 1.0f);
    allreduceSharded(comm, buf.data(), buf.size(), f32, ReduceOp::kSum);
  });
  check("allreduce auto", [&](Comm& comm) {
    std::vector<float> buf(kCount, 1.0f);
    allreduce(comm, buf.data(), buf.size(), f32, ReduceOp::kAvg, nullptr);
  });
  check("reduce_scatter ring", [&](Comm& comm) {
    std::vector<std::vector<float>> parts(kRanks, std::vector<float>(kCount / kRanks, 1.0f));
    std::vector<char*> chunks;
    for (auto& p : parts) chunks.push_back(reinterpret_cast<char*>(p.data()));
    ringReduceScatter(comm, chunks, std::vector<size_t>(kRanks, kCount / kRanks), f32, ReduceOp::kSum);
  });
  check("allgather ring", [&](Comm& comm) {
    std::vector<std::vector<char>> parts(kRanks, std::vector<char>(4096));
    std::vector<char*> chunks;
    for (auto& p : parts) chunks.push_back(p.data());
    ringAllgather(comm, chunks, std::vector<size_t>(kRanks, 4096));
  });
  for (int root : {0, 2}) {
    check(strCat("broadcast tree root ", root), [&](Comm& comm) {
      std::vector<char> buf(1 << 18);
      broadcastTree(comm, buf.data(), buf.size(), root);
    });
    check(strCat("reduce tree root ", root), [&](Comm& comm) {
      std::vector<float> buf(kCount, 1.0f);
      reduceTree(comm, buf.data(), buf.size(), f32, ReduceOp::kSum, root);
    });
    check(strCat("gather root ", root), [&](Comm& comm) {
      std::vector<char> input(4096);
      std::vector<std::vector<char>> parts(kRanks, std::vector<char>(4096));
      std::vector<char*> outputs;
      for (auto& p : parts) outputs.push_back(p.data());
      gatherDirect(comm, input.data(), input.size(), outputs, root);
    });
    check(strCat("scatter root ", root), [&](Comm& comm) {
      std::vector<std::vector<char>> parts(kRanks, std::vector<char>(4096));
      std::vector<const char*> inputs;
      for (auto& p : parts) inputs.push_back(p.data());
      std::vector<char> output(4096);
      scatterDirect(comm, inputs, output.data(), output.size(), root);
    });
  }
  check("alltoall pairwise", [&](Comm& comm) {
    std::vector<std::vector<char>> sends(kRanks, std::vector<char>(4096)), recvs = sends;
    std::vector<const char*> sendPtrs;
    std::vector<char*> recvPtrs;
    for (int r = 0; r < kRanks; ++r) {
      sendPtrs.push_back(sends[r].data());
      recvPtrs.push_back(recvs[r].data());
    }
    alltoallPairwise(comm, sendPtrs, std::vector<size_t>(kRanks, 4096), recvPtrs,
                     std::vector<size_t>(kRanks, 4096));
  });
  check("barrier dissemination", [&](Comm& comm) { barrierDissemination(comm); });
  check("allreduce quantized", [&](Comm& comm) {
    std::vector<float> buf(kCount, 1.0f);
    QuantizeOptions opts;
    allreduceQuantized(comm, buf.data(), buf.size(), {}, {}, opts, nullptr);
  });
  check("allreduce sparse", [&](Comm& comm) {
    std::vector<int64_t> indices;
    std::vector<float> values;
    for (size_t i = 0; i < kCount; i += 7) {
      indices.push_back(static_cast<int64_t>(i));
      values.push_back(1.0f);
    }
    std::vector<float> out(kCount);
    allreduceSparse(comm, indices.data(), values.data(), indices.size(), kCount, {}, out.data(), nullptr,
                    SparseAllreduceOptions{});
  });
  if (failures > 0) {
    std::cout << failures << " check(s) failed" << std::endl;
    return 1;
  }
  std::cout << "all passed" << std::endl;
  return 0;
}
