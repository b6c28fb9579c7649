// pybind11 module pycomm._C: the backend class torch.distributed instantiates,
// its options object, the kernels (kernel_bindings.cc) and statistics. The tests'
// loopback harness is a module of its own (tests/cpp/loopback_module.cc).
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "algorithms/allreduce_registry.h"
#include "backend/process_group.h"
#include "backend/device_seam.h"
#include "common/stats.h"
#include "transport/shm_wait.h"

namespace py = pybind11;

namespace pycomm {
void registerKernelBindings(py::module_& m);  // kernel_bindings.cc
}  // namespace pycomm

PYBIND11_MODULE(_C, m) {
  using pycomm::ProcessGroupPycomm;
  m.doc() = "pycomm C++ core: the torch.distributed backend and the kernels";
  py::module_::import("torch.distributed");
  py::object backendBase = py::module_::import("torch._C._distributed_c10d").attr("Backend");

  // The cost model's constants (common/cost_model.h); pycomm/plan.py measures them.
  py::class_<pycomm::CostModel>(m, "CostModel")
      .def(py::init<>())
      .def_readwrite("alpha", &pycomm::CostModel::alpha)
      .def_readwrite("beta", &pycomm::CostModel::beta)
      .def_readwrite("gamma", &pycomm::CostModel::gamma)
      .def_readwrite("delta", &pycomm::CostModel::delta)
      .def_readwrite("shm_alpha", &pycomm::CostModel::shmAlpha)
      .def_readwrite("shm_beta", &pycomm::CostModel::shmBeta)
      .def_readwrite("cpu_beta", &pycomm::CostModel::cpuBeta)
      .def_readwrite("cpu_beta_oneway", &pycomm::CostModel::cpuBetaOneWay)
      .def_readwrite("link_burst", &pycomm::CostModel::linkBurst);

  // The one options object (common/group_config.h); pycomm/config.py fills it.
  py::class_<pycomm::GroupConfig>(m, "GroupConfig")
      .def(py::init<>())
      .def_readwrite("timeout", &pycomm::GroupConfig::timeout)
      .def_readwrite("bind_address", &pycomm::GroupConfig::bindAddress)
      .def_readwrite("segment_bytes", &pycomm::GroupConfig::segmentBytes)
      .def_readwrite("algorithm", &pycomm::GroupConfig::algorithm)
      .def_readwrite("global_ranks", &pycomm::GroupConfig::globalRanks)
      .def_readwrite("check_calls", &pycomm::GroupConfig::checkCalls)
      .def_readwrite("store_prefix", &pycomm::GroupConfig::storePrefix)
      .def_readwrite("transport", &pycomm::GroupConfig::transport)
      .def_readwrite("shm_spread", &pycomm::GroupConfig::shmSpread)
      .def_readwrite("debug", &pycomm::GroupConfig::debug)
      .def_readwrite("secret", &pycomm::GroupConfig::secret)
      .def_readwrite("sockets_per_peer", &pycomm::GroupConfig::socketsPerPeer)
      .def_readwrite("io_threads", &pycomm::GroupConfig::ioThreads)
      .def_readwrite("wire", &pycomm::GroupConfig::wire)
      .def_readwrite("cost", &pycomm::GroupConfig::cost);

  py::class_<ProcessGroupPycomm, c10::intrusive_ptr<ProcessGroupPycomm>>(m, "ProcessGroupPycomm",
                                                                        backendBase)
      // Tensors of a device with a seam (CUDA in the CUDA build) go through it
      // (device_seam.h): one class for every device.
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       pycomm::GroupConfig config) {
             return c10::make_intrusive<ProcessGroupPycomm>(store, rank, size, std::move(config));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("config"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_algorithm", &ProcessGroupPycomm::setAlgorithm, py::arg("name"))
      .def("get_algorithm", &ProcessGroupPycomm::algorithm)
      .def("select_algorithm", &ProcessGroupPycomm::selectAlgorithm, py::arg("nbytes"))
      .def("last_algorithm", &ProcessGroupPycomm::lastAlgorithm)
      .def("failure", &ProcessGroupPycomm::failure)
      // gloo's names: torch's _set_pg_timeout reaches only gloo and NCCL groups, so code
      // that sets a timeout on a backend object calls these (set_timeout is torch's own)
      .def("_set_default_timeout",
           [](ProcessGroupPycomm& pg, std::chrono::milliseconds timeout) { pg.setTimeout(timeout); },
           py::arg("timeout"))
      .def_property_readonly("options", &ProcessGroupPycomm::getBackendOptions)
      .def("abort_with_reason", &ProcessGroupPycomm::abortWithReason, py::arg("reason"),
           py::call_guard<py::gil_scoped_release>(),
           "abort(), telling the peers why (they fail with 'rank R aborted the group: <reason>')")
      .def("bytes_sent", &ProcessGroupPycomm::bytesSent)
      .def("bytes_received", &ProcessGroupPycomm::bytesReceived)
      .def("flight_recorder",
           [](const ProcessGroupPycomm& pg) {
             py::list calls;
             auto time = [](int64_t us) -> py::object {
               return us == 0 ? py::none() : py::object(py::float_(us / 1e6));
             };
             for (const auto& r : pg.flightRecord()) {
               py::dict call;
               call["seq"] = r.seq;
               call["op"] = std::string(r.op);
               call["dtype"] = std::string(r.dtype);
               call["bytes"] = r.bytes;
               call["algorithm"] = std::string(r.algorithm);
               call["state"] = std::string(pycomm::callStateName(r.state));
               call["time_queued"] = time(r.queuedUs);
               call["time_started"] = time(r.startedUs);
               call["time_ended"] = time(r.endedUs);
               calls.append(call);
             }
             return calls;
           },
           "the group's last collectives, oldest first (pycomm.flight_recorder())")
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
             std::vector<int64_t> segments, double divisor, bool asyncOp) {
            return pg.allreduceSparseTensor(indices, values, out, residual.value_or(at::Tensor()),
                                            segments, valueDtype, keepDensity, divisor, asyncOp);
          },
          py::arg("indices"), py::arg("values"), py::arg("out"), py::arg("residual") = py::none(),
          py::arg("value_dtype") = "float32", py::arg("keep_density") = 0.0,
          py::arg("segments") = std::vector<int64_t>{}, py::arg("divisor") = 1.0, py::arg("async_op") = true,
          py::call_guard<py::gil_scoped_release>(),
          "sparse all-reduce (SUM) of (ascending int64 indices, float32 values) into the dense "
          "float32 `out`, divided by `divisor` (1: the sums; the world size: the average); "
          "returns a Work");

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
    py::list buckets;
    for (const auto& [key, entry] : stats.buckets()) {
      py::dict row;
      row["op"] = std::get<0>(key);
      row["group_size"] = std::get<1>(key);
      row["bucket"] = std::get<2>(key);
      row["count"] = entry.count;
      row["failures"] = entry.failures;
      row["seconds"] = entry.seconds;
      row["bytes"] = entry.bytes;
      buckets.append(row);
    }
    py::dict result;
    result["buckets"] = buckets;
    result["bytes_sent"] = stats.sent();
    result["bytes_received"] = stats.received();
    result["bytes_buffered"] = stats.buffered();
    result["ops"] = ops;
    return result;
  });
  m.def("_reset_stats", [] { pycomm::Stats::instance().reset(); });
  m.def("_polling_limited", &pycomm::Request::pollingLimited,
        "whether only waits for small TCP messages (1 byte to 64 KiB) poll before they sleep: "
        "true for good once a group found more ranks on this machine than CPUs this process may use");
  m.def("_shm_ignore_other_jobs", &pycomm::shmIgnoreOtherJobs, py::arg("ignore"),
        "tests only: oversubscribed shared-memory waits poll with sched_yield as on a machine "
        "without other jobs' runnable threads (by default they sleep at once where there are)");
  pycomm::registerKernelBindings(m);
#ifdef PYCOMM_WITH_CUDA
  m.def("_built_with_cuda", [] { return true; });
#else
  m.def("_built_with_cuda", [] { return false; });
#endif
  m.def("_devices", &pycomm::seamDevices,
        "the device types the backend takes: cpu and each with a device seam (device_seam.h)");
  m.def("allreduce_algorithms", &pycomm::allreduceAlgorithmNames,
        "the all-reduce algorithm settings: 'auto', then the table of allreduce_registry.h");
  auto topologyOf = [](int worldSize, bool oneHost, int hosts, const std::optional<pycomm::CostModel>& cost,
                       double oversubscription, bool ingressLimited) {
    pycomm::Topology topology;
    topology.ranks = worldSize;
    topology.hosts = hosts;
    topology.oneHost = oneHost;
    if (cost) topology.cost = *cost;
    topology.oversubscription = oversubscription;
    topology.ingressLimited = ingressLimited;
    return topology;
  };
  m.def("_select_algorithm",
        [topologyOf](size_t bytes, int worldSize, bool oneHost, int hosts,
                     const std::optional<pycomm::CostModel>& cost, double oversubscription, bool ingressLimited) {
          return std::string(pycomm::chooseAllreduceAlgorithm(
                                 bytes, topologyOf(worldSize, oneHost, hosts, cost, oversubscription, ingressLimited))
                                 .name);
        },
        py::arg("nbytes"), py::arg("world_size"), py::arg("one_host") = false, py::arg("hosts") = 0,
        py::arg("cost") = py::none(), py::arg("oversubscription") = 1.0, py::arg("ingress_limited") = true);
  m.def("allreduce_costs",
        [topologyOf](size_t bytes, int worldSize, bool oneHost, int hosts,
                     const std::optional<pycomm::CostModel>& cost, double oversubscription, bool ingressLimited) {
          return pycomm::allreduceCosts(
              bytes, topologyOf(worldSize, oneHost, hosts, cost, oversubscription, ingressLimited));
        },
        py::arg("nbytes"), py::arg("world_size"), py::arg("one_host") = false, py::arg("hosts") = 0,
        py::arg("cost") = py::none(), py::arg("oversubscription") = 1.0, py::arg("ingress_limited") = true,
        "[(algorithm, predicted seconds)] for every all-reduce algorithm that fits: the cost "
        "model auto uses (allreduce_registry.cc), with `cost` or the built-in constants");
}
