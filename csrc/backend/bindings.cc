// pybind11 module pycomm._C: the backend class torch.distributed instantiates,
// and a loopback harness that runs the algorithms with threads as ranks.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <thread>

#include "algorithms/collectives.h"
#include "common/stats.h"
#include "backend/process_group.h"
#ifdef PYCOMM_WITH_CUDA
#include "backend/cuda_staging.h"
#endif
#include "backend/tensor_types.h"
#include "kernels/cpu/reduce.h"
#include "transport/loopback.h"
#include "transport/memory_store.h"
#include "transport/shm_arena.h"

namespace py = pybind11;

namespace pycomm {

void registerKernelBindings(py::module_& m);  // kernel_bindings.cc

namespace {

ReduceOp reduceOpOf(const std::string& name) {
  static const std::pair<const char*, ReduceOp> ops[] = {
      {"sum", ReduceOp::kSum}, {"avg", ReduceOp::kAvg}, {"product", ReduceOp::kProduct},
      {"min", ReduceOp::kMin}, {"max", ReduceOp::kMax}, {"band", ReduceOp::kBand},
      {"bor", ReduceOp::kBor}, {"bxor", ReduceOp::kBxor}};
  for (const auto& [key, op] : ops)
    if (name == key) return op;
  throw std::invalid_argument("unknown reduce op " + name);
}

// Runs one collective on len(tensors) threads over a loopback fabric; tensor i
// belongs to rank i and is updated in place (outputs for gather-like ops are
// returned). Used by tests/test_algorithms.py.
std::vector<at::Tensor> loopbackCollective(const std::string& collective,
                                           std::vector<at::Tensor> tensors, const std::string& op,
                                           const std::string& algorithm, int root,
                                           size_t segmentBytes, double timeoutSeconds) {
  const int n = static_cast<int>(tensors.size());
  auto fabric = std::make_shared<LoopbackFabric>(n);
  const ReduceOp reduceOp = reduceOpOf(op);
  const AllreduceAlgorithm algo = parseAllreduceAlgorithm(algorithm);
  std::vector<at::Tensor> outputs(n);
  for (int r = 0; r < n; ++r) {
    const at::Tensor& t = tensors[r];
    if (collective == "allgather") outputs[r] = at::empty({n * t.numel()}, t.options());
    else if (collective == "reduce_scatter") outputs[r] = at::empty({t.numel() / n}, t.options());
    else if (collective == "alltoall") outputs[r] = at::empty_like(t);
    else outputs[r] = t;
  }
  std::vector<std::string> errors(n);
  // algorithm "shm": the ranks (threads) share a node-local arena whose slots
  // are `segmentBytes` (rounded up to 4 KiB) so small segments pipeline.
  MemoryStore store;
  std::vector<int> everyone(n);
  for (int r = 0; r < n; ++r) everyone[r] = r;
  {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          LoopbackTransport transport(fabric, r);
          Comm comm(transport, std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000)),
                    segmentBytes);
          std::unique_ptr<ShmArena> arena;
          // With an arena every collective takes its shm path (dispatch.cc).
          if (algo == AllreduceAlgorithm::kShm && n > 1) {
            arena = std::make_unique<ShmArena>(store, "loopback/", everyone, r, segmentBytes, 4);
            comm.setArena(arena.get());
          }
          comm.begin(collective);
          const at::Tensor& t = tensors[r];
          const DataType dtype = toDataType("loopback", t.scalar_type());
          char* data = static_cast<char*>(t.data_ptr());
          const size_t count = static_cast<size_t>(t.numel());
          const size_t bytes = t.nbytes();
          if (collective == "allreduce") {
            allreduce(comm, data, count, dtype, reduceOp, algo);
          } else if (collective == "broadcast") {
            broadcast(comm, data, bytes, root);
          } else if (collective == "reduce") {
            reduce(comm, data, count, dtype, reduceOp, root);
          } else if (collective == "allgather") {
            std::vector<char*> chunks;
            for (int i = 0; i < n; ++i) chunks.push_back(static_cast<char*>(outputs[r].data_ptr()) + i * bytes);
            std::memcpy(chunks[r], data, bytes);
            allgather(comm, chunks, std::vector<size_t>(n, bytes));
          } else if (collective == "reduce_scatter") {
            const size_t part = count / n;
            std::vector<char*> chunks;
            for (int i = 0; i < n; ++i) chunks.push_back(data + i * part * elementSize(dtype));
            reduceScatter(comm, chunks, std::vector<size_t>(n, part), dtype, reduceOp);
            std::memcpy(outputs[r].data_ptr(), chunks[r], part * elementSize(dtype));
          } else if (collective == "alltoall") {
            const size_t part = bytes / n;
            std::vector<const char*> sends;
            std::vector<char*> recvs;
            for (int i = 0; i < n; ++i) {
              sends.push_back(data + i * part);
              recvs.push_back(static_cast<char*>(outputs[r].data_ptr()) + i * part);
            }
            alltoall(comm, sends, std::vector<size_t>(n, part), recvs,
                             std::vector<size_t>(n, part));
          } else if (collective == "barrier") {
            barrier(comm);
          } else {
            throw std::invalid_argument("unknown collective " + collective);
          }
        } catch (const std::exception& e) {
          errors[r] = e.what();
          // Unblock the other ranks: a failed rank must not leave them waiting.
          LoopbackTransport(fabric, r).abort(strCat("rank ", r, " failed: ", e.what()));
        }
      });
    }
    for (auto& thread : threads) thread.join();
  }
  for (int r = 0; r < n; ++r)
    if (!errors[r].empty()) throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
  return outputs;
}

}  // namespace
}  // namespace pycomm

PYBIND11_MODULE(_C, m) {
  using pycomm::ProcessGroupPycomm;
  m.doc() = "pycomm C++ core: the torch.distributed backend and test harnesses";
  py::module_::import("torch.distributed");
  py::object backendBase = py::module_::import("torch._C._distributed_c10d").attr("Backend");

  py::class_<ProcessGroupPycomm, c10::intrusive_ptr<ProcessGroupPycomm>>(m, "ProcessGroupPycomm",
                                                                        backendBase)
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       double timeoutSeconds, const std::string& bindAddress, size_t segmentBytes,
                       const std::string& algorithm, std::vector<int> globalRanks,
                       bool checkCalls, const std::string& storePrefix,
                       const std::string& transport) {
             pycomm::GroupConfig config;
             config.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000));
             config.bindAddress = bindAddress;
             config.segmentBytes = segmentBytes;
             config.algorithm = algorithm;
             config.globalRanks = std::move(globalRanks);
             config.checkCalls = checkCalls;
             config.storePrefix = storePrefix;
             config.transport = transport;
#ifdef PYCOMM_WITH_CUDA
             // Also takes CUDA tensors, staged through pinned host memory (cuda_staging.h).
             return c10::intrusive_ptr<ProcessGroupPycomm>(
                 c10::make_intrusive<pycomm::ProcessGroupPycommCuda>(store, rank, size,
                                                                    std::move(config)));
#else
             return c10::make_intrusive<ProcessGroupPycomm>(store, rank, size, std::move(config));
#endif
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_seconds"),
           py::arg("bind_address"), py::arg("segment_bytes"), py::arg("algorithm"),
           py::arg("global_ranks"), py::arg("check_calls") = false,
           py::arg("store_prefix") = "pycomm/", py::arg("transport") = "auto",
           py::call_guard<py::gil_scoped_release>())
      .def("set_algorithm", &ProcessGroupPycomm::setAlgorithm, py::arg("name"))
      .def("get_algorithm", &ProcessGroupPycomm::algorithm)
      .def("select_algorithm", &ProcessGroupPycomm::selectAlgorithm, py::arg("nbytes"))
      .def("last_algorithm", &ProcessGroupPycomm::lastAlgorithm)
      .def("failure", &ProcessGroupPycomm::failure)
      .def("bytes_sent", &ProcessGroupPycomm::bytesSent)
      .def("bytes_received", &ProcessGroupPycomm::bytesReceived);
#ifdef PYCOMM_WITH_CUDA
  // Registered so that pybind11, which names an object by its most derived C++ type,
  // hands torch's backend objects to Python as a ProcessGroupPycomm subclass (without
  // it they arrive as a plain Backend and pycomm.set_algorithm & co reject them).
  py::class_<pycomm::ProcessGroupPycommCuda, ProcessGroupPycomm,
             c10::intrusive_ptr<pycomm::ProcessGroupPycommCuda>>(
      m, "_ProcessGroupPycommCuda", "ProcessGroupPycomm that also stages CUDA tensors");
#endif

  m.def("_loopback_collective", &pycomm::loopbackCollective, py::arg("collective"),
        py::arg("tensors"), py::arg("op") = "sum", py::arg("algorithm") = "auto",
        py::arg("root") = 0, py::arg("segment_bytes") = 256 * 1024,
        py::arg("timeout_seconds") = 60.0);
  m.def("_stats", [] {
    auto& stats = pycomm::Stats::instance();
    py::dict ops;
    for (const auto& [name, entry] : stats.ops()) {
      py::dict row;
      row["count"] = entry.count;
      row["failures"] = entry.failures;
      row["seconds"] = entry.seconds;
      row["bytes"] = entry.bytes;
      ops[py::str(name)] = row;
    }
    py::dict result;
    result["bytes_sent"] = stats.sent();
    result["bytes_received"] = stats.received();
    result["bytes_buffered"] = stats.buffered();
    result["ops"] = ops;
    return result;
  });
  m.def("_reset_stats", [] { pycomm::Stats::instance().reset(); });
  pycomm::registerKernelBindings(m);
#ifdef PYCOMM_WITH_CUDA
  m.def("_built_with_cuda", [] { return true; });
#else
  m.def("_built_with_cuda", [] { return false; });
#endif
  m.def("_select_algorithm",
        [](size_t bytes, int worldSize, bool oneHost) {
          return std::string(pycomm::allreduceAlgorithmName(
              pycomm::selectAllreduceAlgorithm(bytes, worldSize, oneHost)));
        },
        py::arg("nbytes"), py::arg("world_size"), py::arg("one_host") = false);
}
