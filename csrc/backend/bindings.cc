// pybind11 module pycomm._C: the backend class torch.distributed instantiates,
// and a loopback harness that runs the algorithms with threads as ranks.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <thread>
#include <tuple>

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

// Runs fn(comm, rank) on n threads over a fresh loopback fabric; rethrows the first
// rank's error (usage errors as ValueError). Used by tests/test_algorithms.py and
// tests/test_compressed_collectives.py.
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

// Runs one collective on len(tensors) threads over a loopback fabric; tensor i
// belongs to rank i and is updated in place (outputs for gather-like ops are
// returned). Used by tests/test_algorithms.py.
std::vector<at::Tensor> loopbackCollective(const std::string& collective,
                                           std::vector<at::Tensor> tensors, const std::string& op,
                                           const std::string& algorithm, int root,
                                           size_t segmentBytes, double timeoutSeconds) {
  const int n = static_cast<int>(tensors.size());
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
          alltoall(comm, sends, std::vector<size_t>(n, part), recvs, std::vector<size_t>(n, part));
        } else if (collective == "barrier") {
          barrier(comm);
        } else {
          throw std::invalid_argument("unknown collective " + collective);
        }
      },
      segmentBytes);
  return outputs;
}


// ---- compressed collectives over loopback (tests/test_compressed_collectives.py)

void checkLoopbackFloats(const std::vector<at::Tensor>& tensors, const char* what) {
  for (const auto& t : tensors)
    if (t.scalar_type() != at::kFloat || !t.is_contiguous() || !t.device().is_cpu())
      throw py::value_error(std::string(what) + " must be contiguous CPU float32 tensors");
}

// tensors[r] <- the quantized sum (in place); residuals[r] updated when given.
void loopbackAllreduceQuantized(std::vector<at::Tensor> tensors,
                                std::optional<std::vector<at::Tensor>> residuals, int bits,
                                int64_t block, bool stochastic, int64_t seed,
                                std::vector<size_t> segments, double timeoutSeconds) {
  const int n = static_cast<int>(tensors.size());
  checkLoopbackFloats(tensors, "tensors");
  if (residuals) {
    checkLoopbackFloats(*residuals, "residuals");
    if (static_cast<int>(residuals->size()) != n) throw py::value_error("one residual per rank");
    for (int r = 0; r < n; ++r)
      if ((*residuals)[r].numel() != tensors[r].numel())
        throw py::value_error("residual " + std::to_string(r) + " differs in size from its tensor");
  }
  QuantizeOptions opts;
  opts.bits = bits;
  opts.block = static_cast<size_t>(std::max<int64_t>(block, 0));
  opts.stochastic = stochastic;
  opts.seed = static_cast<uint64_t>(seed);
  runLoopbackRanks(n, timeoutSeconds, [&](Comm& comm, int r) {
    comm.begin("allreduce_quantized");
    allreduceQuantized(comm, tensors[r].data_ptr<float>(), static_cast<size_t>(tensors[r].numel()),
                       segments, {}, opts, residuals ? (*residuals)[r].data_ptr<float>() : nullptr);
  });
}

// Returns (outputs, bytes sent per rank, entries kept per owner).
std::tuple<std::vector<at::Tensor>, std::vector<size_t>, std::vector<size_t>> loopbackAllreduceSparse(
    std::vector<at::Tensor> indices, std::vector<at::Tensor> values, int64_t count,
    std::optional<std::vector<at::Tensor>> residuals, const std::string& valueType,
    double keepDensity, std::vector<size_t> segments, double timeoutSeconds) {
  const int n = static_cast<int>(indices.size());
  checkLoopbackFloats(values, "values");
  if (static_cast<int>(values.size()) != n) throw py::value_error("one values tensor per rank");
  for (int r = 0; r < n; ++r)
    if (indices[r].scalar_type() != at::kLong || !indices[r].is_contiguous() ||
        indices[r].numel() != values[r].numel())
      throw py::value_error("indices must be contiguous int64 tensors as long as the values");
  if (residuals) {
    checkLoopbackFloats(*residuals, "residuals");
    if (static_cast<int>(residuals->size()) != n) throw py::value_error("one residual per rank");
    for (const auto& e : *residuals)
      if (e.numel() != count) throw py::value_error("residuals must have `count` elements");
  }
  SparseAllreduceOptions opts;
  opts.valueType = valueType == "float16"    ? DataType::kFloat16
                   : valueType == "bfloat16" ? DataType::kBFloat16
                   : valueType == "float32"  ? DataType::kFloat32
                                             : DataType::kInt8;  // rejected by the algorithm
  opts.keepDensity = keepDensity;
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < n; ++r) outputs.push_back(at::empty({count}, at::kFloat));
  std::vector<size_t> sent(n), kept(n);
  runLoopbackRanks(n, timeoutSeconds, [&](Comm& comm, int r) {
    comm.begin("allreduce_sparse");
    const SparseAllreduceResult result = allreduceSparse(
        comm, indices[r].data_ptr<int64_t>(), values[r].data_ptr<float>(),
        static_cast<size_t>(indices[r].numel()), static_cast<size_t>(count), segments,
        outputs[r].data_ptr<float>(), residuals ? (*residuals)[r].data_ptr<float>() : nullptr, opts);
    sent[r] = result.bytesSent;
    kept[r] = result.keptByOwner;
  });
  return {outputs, sent, kept};
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
      .def("bytes_received", &ProcessGroupPycomm::bytesReceived)
      // ---- compressed collectives (process_group_compressed.cc)
      .def(
          "allreduce_quantized",
          [](ProcessGroupPycomm& pg, at::Tensor tensor, std::optional<at::Tensor> residual, int bits,
             int64_t block, bool stochastic, int64_t seed, std::vector<int64_t> segments,
             std::vector<int64_t> keys, bool asyncOp) {
            return pg.allreduceQuantizedTensor(tensor, residual.value_or(at::Tensor()), segments, keys,
                                               bits, block, stochastic, seed, asyncOp);
          },
          py::arg("tensor"), py::arg("residual") = py::none(), py::arg("bits") = 8,
          py::arg("block") = 256, py::arg("stochastic") = false, py::arg("seed") = 0,
          py::arg("segments") = std::vector<int64_t>{}, py::arg("keys") = std::vector<int64_t>{},
          py::arg("async_op") = true, py::call_guard<py::gil_scoped_release>(),
          "two-phase quantized all-reduce (SUM) of a float32 tensor in place; returns a Work")
      .def(
          "allreduce_sparse",
          [](ProcessGroupPycomm& pg, at::Tensor indices, at::Tensor values, at::Tensor out,
             std::optional<at::Tensor> residual, const std::string& valueDtype, double keepDensity,
             std::vector<int64_t> segments, bool asyncOp) {
            return pg.allreduceSparseTensor(indices, values, out, residual.value_or(at::Tensor()),
                                            segments, valueDtype, keepDensity, asyncOp);
          },
          py::arg("indices"), py::arg("values"), py::arg("out"), py::arg("residual") = py::none(),
          py::arg("value_dtype") = "float32", py::arg("keep_density") = 0.0,
          py::arg("segments") = std::vector<int64_t>{}, py::arg("async_op") = true, py::call_guard<py::gil_scoped_release>(),
          "sparse all-reduce (SUM) of (ascending int64 indices, float32 values) into the dense "
          "float32 `out`; returns a Work");
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
  m.def("_loopback_allreduce_quantized", &pycomm::loopbackAllreduceQuantized, py::arg("tensors"),
        py::arg("residuals") = py::none(), py::arg("bits") = 8, py::arg("block") = 256,
        py::arg("stochastic") = false, py::arg("seed") = 0,
        py::arg("segments") = std::vector<size_t>{}, py::arg("timeout_seconds") = 60.0);
  m.def("_loopback_allreduce_sparse", &pycomm::loopbackAllreduceSparse, py::arg("indices"),
        py::arg("values"), py::arg("count"), py::arg("residuals") = py::none(),
        py::arg("value_dtype") = "float32", py::arg("keep_density") = 0.0,
        py::arg("segments") = std::vector<size_t>{}, py::arg("timeout_seconds") = 60.0);
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
