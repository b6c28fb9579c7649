// The loopback test harness: the algorithms with threads as ranks, as a small
// torch-free Python module built by the tests (tests/cpp_build.py), not part of
// the production pycomm._C. Buffers arrive as raw addresses (tests/loopback.py
// passes torch tensors' data_ptr()) with a dtype name.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/reduce.h"
#include "transport/bootstrap.h"
#include "transport/loopback.h"
#include "transport/memory_store.h"
#include "transport/shm_arena.h"

namespace py = pybind11;

namespace pycomm {
namespace {

using Addresses = std::vector<uintptr_t>;

template <typename T = char>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

ReduceOp reduceOpOf(const std::string& name) {
  static const std::pair<const char*, ReduceOp> ops[] = {
      {"sum", ReduceOp::kSum}, {"avg", ReduceOp::kAvg}, {"product", ReduceOp::kProduct},
      {"min", ReduceOp::kMin}, {"max", ReduceOp::kMax}, {"band", ReduceOp::kBand},
      {"bor", ReduceOp::kBor}, {"bxor", ReduceOp::kBxor}};
  for (const auto& [key, op] : ops)
    if (name == key) return op;
  throw std::invalid_argument("unknown reduce op " + name);
}

DataType dataTypeOf(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(DataType::kBool); ++i)
    if (name == dataTypeName(static_cast<DataType>(i))) return static_cast<DataType>(i);
  throw std::invalid_argument("unknown dtype " + name);
}

// Runs fn(comm, rank) on n threads over a fresh loopback fabric; rethrows the first
// rank's error (usage errors as ValueError).
template <typename F>
void runLoopbackRanks(int n, double timeoutSeconds, F fn, size_t segmentBytes = 256 * 1024) {
  auto fabric = std::make_shared<LoopbackFabric>(n);
  std::vector<std::string> errors(n);
  std::vector<int> usageError(n, 0);
  {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          LoopbackTransport transport(fabric, r);
          Comm comm(transport, std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000)),
                    segmentBytes);
          fn(comm, r);
        } catch (const std::exception& e) {
          errors[r] = e.what();
          const auto* err = dynamic_cast<const Error*>(&e);
          usageError[r] = err != nullptr && err->kind() == ErrorKind::kUsage;
          LoopbackTransport(fabric, r).abort(strCat("rank ", r, " failed: ", e.what()));
        }
      });
    }
    for (auto& thread : threads) thread.join();
  }
  for (int r = 0; r < n; ++r)
    if (usageError[r]) throw py::value_error(errors[r]);
  for (int r = 0; r < n; ++r)
    if (!errors[r].empty()) throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
}

// One collective on len(data) threads: rank r's `count` elements at data[r] are
// updated in place; gather-like results land at outputs[r] (allgather: n * count,
// reduce_scatter: count / n, alltoall: count elements).
void collective(const std::string& collective, const Addresses& data, const Addresses& outputs,
                size_t count, const std::string& dtypeName, const std::string& op,
                const std::string& algorithm, int root, size_t segmentBytes, double timeoutSeconds) {
  const int n = static_cast<int>(data.size());
  const DataType dtype = dataTypeOf(dtypeName);
  const ReduceOp reduceOp = reduceOpOf(op);
  const AllreduceAlgorithm* algo = findAllreduceAlgorithm(algorithm);
  const bool shm = algo != nullptr && std::string(algo->name) == "shm";
  const size_t bytes = count * elementSize(dtype);
  // algorithm "shm": the ranks (threads) share a node-local arena whose slots
  // are `segmentBytes` (rounded up to 4 KiB) so small segments pipeline.
  MemoryStore store;
  std::vector<int> everyone(n);
  for (int r = 0; r < n; ++r) everyone[r] = r;
  runLoopbackRanks(
      n, timeoutSeconds,
      [&](Comm& comm, int r) {
        std::unique_ptr<ShmArena> arena;
        // With an arena every collective takes its shm path (dispatch.cc).
        if (shm && n > 1) {
          arena = std::make_unique<ShmArena>(store, "loopback/", everyone, r, segmentBytes, kArenaDepth,
                                             /*spread=*/true);
          comm.setArena(arena.get());
        }
        comm.begin(collective);
        char* buf = at(data[r]);
        if (collective == "allreduce") {
          allreduce(comm, buf, count, dtype, reduceOp, algo);
        } else if (collective == "broadcast") {
          broadcast(comm, buf, bytes, root);
        } else if (collective == "reduce") {
          reduce(comm, buf, count, dtype, reduceOp, root);
        } else if (collective == "allgather") {
          std::vector<char*> chunks;
          for (int i = 0; i < n; ++i) chunks.push_back(at(outputs[r]) + i * bytes);
          if (bytes > 0) std::memcpy(chunks[r], buf, bytes);
          allgather(comm, chunks, std::vector<size_t>(n, bytes));
        } else if (collective == "reduce_scatter") {
          const size_t part = count / n;
          std::vector<char*> chunks;
          for (int i = 0; i < n; ++i) chunks.push_back(buf + i * part * elementSize(dtype));
          reduceScatter(comm, chunks, std::vector<size_t>(n, part), dtype, reduceOp);
          if (part > 0) std::memcpy(at(outputs[r]), chunks[r], part * elementSize(dtype));
        } else if (collective == "alltoall") {
          const size_t part = bytes / n;
          std::vector<const char*> sends;
          std::vector<char*> recvs;
          for (int i = 0; i < n; ++i) {
            sends.push_back(buf + i * part);
            recvs.push_back(at(outputs[r]) + i * part);
          }
          alltoall(comm, sends, std::vector<size_t>(n, part), recvs, std::vector<size_t>(n, part));
        } else if (collective == "barrier") {
          barrier(comm);
        } else {
          throw std::invalid_argument("unknown collective " + collective);
        }
      },
      segmentBytes);
}

// data[r] (count float32) <- the quantized sum; residuals[r] updated when given.
void allreduceQuantizedRanks(const Addresses& data, std::optional<Addresses> residuals, size_t count,
                             int bits, int64_t block, bool stochastic, int64_t seed,
                             std::vector<size_t> segments, double timeoutSeconds) {
  const int n = static_cast<int>(data.size());
  QuantizeOptions opts;
  opts.bits = bits;
  opts.block = static_cast<size_t>(std::max<int64_t>(block, 0));
  opts.stochastic = stochastic;
  opts.seed = static_cast<uint64_t>(seed);
  runLoopbackRanks(n, timeoutSeconds, [&](Comm& comm, int r) {
    comm.begin("allreduce_quantized");
    allreduceQuantized(comm, at<float>(data[r]), count, segments, {}, opts,
                       residuals ? at<float>((*residuals)[r]) : nullptr);
  });
}

// outputs[r] (count float32) <- the sparse sum of (indices[r], values[r]) with
// nnz[r] entries. Returns (bytes sent per rank, entries kept per owner).
std::tuple<std::vector<size_t>, std::vector<size_t>> allreduceSparseRanks(
    const Addresses& indices, const Addresses& values, const std::vector<size_t>& nnz,
    const Addresses& outputs, size_t count, std::optional<Addresses> residuals,
    const std::string& valueType, double keepDensity, std::vector<size_t> segments,
    double timeoutSeconds) {
  const int n = static_cast<int>(indices.size());
  SparseAllreduceOptions opts;
  opts.valueType = valueType == "float16"    ? DataType::kFloat16
                   : valueType == "bfloat16" ? DataType::kBFloat16
                   : valueType == "float32"  ? DataType::kFloat32
                                             : DataType::kInt8;  // rejected by the algorithm
  opts.keepDensity = keepDensity;
  std::vector<size_t> sent(n), kept(n);
  runLoopbackRanks(n, timeoutSeconds, [&](Comm& comm, int r) {
    comm.begin("allreduce_sparse");
    const SparseAllreduceResult result =
        allreduceSparse(comm, at<int64_t>(indices[r]), at<float>(values[r]), nnz[r], count, segments,
                        at<float>(outputs[r]), residuals ? at<float>((*residuals)[r]) : nullptr, opts);
    sent[r] = result.bytesSent;
    kept[r] = result.keptByOwner;
  });
  return {sent, kept};
}

// The COO all-reduce of (rows[r], values[r]) with nnz[r] rows of rowElems elements
// on each rank; shm: through a node-local arena (every collective on its shm path).
// Returns each rank's result as (rows, the values' bytes).
std::vector<std::tuple<std::vector<int64_t>, py::bytes>> allreduceCooRanks(
    const Addresses& rows, const Addresses& values, const std::vector<size_t>& nnz, uint64_t rowCount,
    size_t rowElems, const std::string& dtypeName, const std::string& op, bool shm, double timeoutSeconds) {
  const int n = static_cast<int>(rows.size());
  const DataType dtype = dataTypeOf(dtypeName);
  const ReduceOp reduceOp = reduceOpOf(op);
  const size_t rowBytes = rowElems * elementSize(dtype);
  std::vector<std::vector<int64_t>> outRows(n);
  std::vector<std::string> outValues(n);
  MemoryStore store;
  std::vector<int> everyone(n);
  for (int r = 0; r < n; ++r) everyone[r] = r;
  runLoopbackRanks(n, timeoutSeconds, [&](Comm& comm, int r) {
    std::unique_ptr<ShmArena> arena;
    if (shm && n > 1) {
      arena = std::make_unique<ShmArena>(store, "loopback/", everyone, r, 64 * 1024, kArenaDepth,
                                         /*spread=*/true);
      comm.setArena(arena.get());
    }
    comm.begin("allreduce");
    allreduceCoo(comm, at<int64_t>(rows[r]), at(values[r]), nnz[r], rowCount, rowElems, dtype, reduceOp,
                 [&](size_t count) {
                   outRows[r].resize(count);
                   outValues[r].resize(std::max<size_t>(count * rowBytes, 1));
                   return CooOutput{outRows[r].data(), outValues[r].data()};
                 });
    outValues[r].resize(outRows[r].size() * rowBytes);
  });
  std::vector<std::tuple<std::vector<int64_t>, py::bytes>> result;
  for (int r = 0; r < n; ++r) result.emplace_back(outRows[r], py::bytes(outValues[r]));
  return result;
}

// Ranks (threads) sharing an arena of `segmentBytes` slots: rank r runs
// collectives[r] (allreduce, broadcast from rank 0, allgather) with counts[r]
// elements of dtypes[r]; any of them may differ between ranks. Returns each rank's error
// ("" when its call succeeded); never throws for a rank's failure.
std::vector<std::string> arenaCalls(const std::vector<std::string>& collectives, const std::vector<size_t>& counts,
                                    const std::vector<std::string>& dtypes, size_t segmentBytes,
                                    double timeoutSeconds) {
  const int n = static_cast<int>(counts.size());
  MemoryStore store;
  std::vector<int> everyone(n);
  for (int r = 0; r < n; ++r) everyone[r] = r;
  std::vector<std::string> errors(n);
  runLoopbackRanks(n, timeoutSeconds, [&](Comm& comm, int r) {
    ShmArena arena(store, "loopback/", everyone, r, segmentBytes, kArenaDepth, /*spread=*/true);
    comm.setArena(&arena);
    const DataType dtype = dataTypeOf(dtypes[r]);
    const size_t bytes = counts[r] * elementSize(dtype);
    std::vector<char> buf(std::max<size_t>(bytes, 1)), all(std::max<size_t>(n * bytes, 1));
    const std::string& collective = collectives[r];
    try {
      comm.begin(collective);
      if (collective == "allreduce") {
        allreduce(comm, buf.data(), counts[r], dtype, ReduceOp::kSum, findAllreduceAlgorithm("shm"));
      } else if (collective == "broadcast") {
        broadcast(comm, buf.data(), bytes, 0);
      } else if (collective == "allgather") {
        std::vector<char*> chunks;
        for (int i = 0; i < n; ++i) chunks.push_back(all.data() + i * bytes);
        allgather(comm, chunks, std::vector<size_t>(n, bytes));
      } else {
        throw std::invalid_argument("unknown collective " + collective);
      }
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    arena.leave();
  }, segmentBytes);
  return errors;
}

void setCpuIsa(const std::string& name) {
  CpuIsa isa = bestCpuIsa();
  if (name != "auto" && !parseCpuIsa(name, &isa)) throw py::value_error("unknown instruction set " + name);
  setReduceIsa(isa);
}

}  // namespace
}  // namespace pycomm

PYBIND11_MODULE(pycomm_loopback, m) {
  m.doc() = "pycomm's algorithms with threads as ranks over the loopback transport (tests only)";
  m.def("collective", &pycomm::collective);
  m.def("allreduce_quantized", &pycomm::allreduceQuantizedRanks);
  m.def("allreduce_sparse", &pycomm::allreduceSparseRanks);
  m.def("allreduce_coo", &pycomm::allreduceCooRanks);
  m.def("arena_calls", &pycomm::arenaCalls);
  // This module has its own copy of the reduction kernels: tests choosing an
  // instruction set for pycomm._C.kernels choose it here too.
  m.def("set_cpu_isa", &pycomm::setCpuIsa);
}
