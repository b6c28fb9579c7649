// Python bindings of the compression kernels (csrc/kernels/): pycomm._C.kernels.
//
// Thin wrappers for tests, benchmarks and the pure-Python codecs: they check the
// tensors (usage errors raise ValueError / TypeError naming the op), release the
// GIL and call the torch-free kernels in kernels/cpu/. In the CUDA build
// (PYCOMM_WITH_CUDA) CUDA tensors go to cuda_kernel_bindings.cc instead, after
// the device-independent arguments are checked here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda_kernels.h"
#include "common/error.h"
#include "common/reduce_op.h"
#include "backend/tensor_checks.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/topk.h"

namespace py = pybind11;

namespace pycomm {
namespace {

// Runs a kernel call; pycomm usage errors become ValueError.
template <typename F>
auto translate(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& err) {
    if (err.kind() == ErrorKind::kUsage) usageError(err.what());
    throw;
  }
}

// The caller's output buffer when given (benchmarks reuse one; a fresh 64 MB
// tensor costs more in page faults than the kernel), else a new one.
at::Tensor outputOf(const char* op, const std::optional<at::Tensor>& out, int64_t numel,
                    at::ScalarType dtype) {
  if (!out) return at::empty({numel}, dtype);
  const at::Tensor& t = *out;
  if (t.device().type() != at::kCPU || t.scalar_type() != dtype || !t.is_contiguous() ||
      t.numel() != numel)
    usageError(std::string("pycomm ") + op + ": out must be a contiguous CPU " +
               std::string(c10::toString(dtype)) + " tensor of " + std::to_string(numel) +
               " elements");
  return t;
}

const char* pathName(TopkPath p) {
  switch (p) {
    case TopkPath::kExact: return "exact";
    case TopkPath::kOnePass: return "one_pass";
    case TopkPath::kTieFill: return "tie_fill";
    case TopkPath::kTrimmed: return "trimmed";
    case TopkPath::kFallback: return "fallback";
  }
  return "?";
}

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x, double density, bool exact,
                                        int64_t seed) {
  checkSeed("topk", seed);
#ifdef PYCOMM_WITH_CUDA
  if (x.is_cuda())
    return translate([&] {
      const size_t k = topkCount("topk", static_cast<size_t>(x.numel()), density);
      return cudabind::topk(x, k, exact, static_cast<uint64_t>(seed));
    });
#endif
  checkNamed("topk", "x", x, at::kFloat);
  return translate([&] {
    const size_t n = static_cast<size_t>(x.numel());
    const size_t k = topkCount("topk", n, density);
    const size_t cap = exact ? k : topkBandHigh(k);
    at::Tensor indices = at::empty({static_cast<int64_t>(cap)}, at::kLong);
    at::Tensor values = at::empty({static_cast<int64_t>(cap)}, at::kFloat);
    size_t m;
    {
      py::gil_scoped_release release;
      if (exact) {
        topkExact(x.data_ptr<float>(), n, k, indices.data_ptr<int64_t>(), values.data_ptr<float>());
        m = k;
      } else {
        m = topkApprox(x.data_ptr<float>(), n, k, static_cast<uint64_t>(seed),
                       indices.data_ptr<int64_t>(), values.data_ptr<float>());
      }
    }
    const int64_t used = static_cast<int64_t>(m);
    return std::make_tuple(indices.narrow(0, 0, used), values.narrow(0, 0, used));
  });
}

py::dict topkInfo(const at::Tensor& x, double density, int64_t seed) {
  checkNamed("topk", "x", x, at::kFloat);
  checkSeed("topk", seed);
  return translate([&] {
    const size_t n = static_cast<size_t>(x.numel());
    const size_t k = topkCount("topk", n, density);
    at::Tensor indices = at::empty({static_cast<int64_t>(topkBandHigh(k))}, at::kLong);
    at::Tensor values = at::empty({static_cast<int64_t>(topkBandHigh(k))}, at::kFloat);
    TopkInfo info;
    size_t m;
    {
      py::gil_scoped_release release;
      m = topkApprox(x.data_ptr<float>(), n, k, static_cast<uint64_t>(seed),
                     indices.data_ptr<int64_t>(), values.data_ptr<float>(), &info);
    }
    py::dict d;
    d["k"] = k;
    d["selected"] = m;
    d["band"] = py::make_tuple(topkBandLow(k), topkBandHigh(k));
    d["path"] = pathName(info.path);
    d["sample_size"] = info.sampleSize;
    d["threshold"] = info.threshold;
    return d;
  });
}

// g and e of a fused error-feedback kernel: as many elements, not the same tensor.
void checkGradAndResidual(const char* op, const at::Tensor& g, const at::Tensor& e) {
  if (g.numel() != e.numel())
    usageError(std::string("pycomm ") + op + ": g and e must have the same number of elements (got " +
               std::to_string(g.numel()) + " and " + std::to_string(e.numel()) + ")");
  if (g.is_same(e)) usageError(std::string("pycomm ") + op + ": g and e must be different tensors");
}

std::tuple<at::Tensor, at::Tensor> topkEf(const at::Tensor& g, at::Tensor& e, double density,
                                          bool exact, int64_t seed) {
  checkSeed("topk_ef", seed);
  checkGradAndResidual("topk_ef", g, e);
#ifdef PYCOMM_WITH_CUDA
  if (g.is_cuda() || e.is_cuda())
    return translate([&] {
      const size_t k = topkCount("topk_ef", static_cast<size_t>(g.numel()), density);
      return cudabind::topkEf(g, e, k, exact, static_cast<uint64_t>(seed));
    });
#endif
  checkNamed("topk_ef", "g", g, at::kFloat);
  checkNamed("topk_ef", "e", e, at::kFloat);
  return translate([&] {
    const size_t n = static_cast<size_t>(g.numel());
    const size_t k = topkCount("topk_ef", n, density);
    const size_t cap = exact ? k : topkBandHigh(k);
    at::Tensor indices = at::empty({static_cast<int64_t>(cap)}, at::kLong);
    at::Tensor values = at::empty({static_cast<int64_t>(cap)}, at::kFloat);
    size_t m;
    {
      py::gil_scoped_release release;
      m = topkErrorFeedback(g.data_ptr<float>(), e.data_ptr<float>(), n, k, exact,
                            static_cast<uint64_t>(seed), indices.data_ptr<int64_t>(),
                            values.data_ptr<float>());
    }
    const int64_t used = static_cast<int64_t>(m);
    return std::make_tuple(indices.narrow(0, 0, used), values.narrow(0, 0, used));
  });
}

// topk_ef over several segments of g and e in one call (a DDP bucket's parameters):
// segment i is [offsets[i], offsets[i] + lengths[i]), selected exactly when exact[i],
// with seeds[i]. Returns the concatenated indices (each + base + offsets[i]) and
// values, segment after segment. CPU float32 only.
std::tuple<at::Tensor, at::Tensor> topkEfSegments(const at::Tensor& g, at::Tensor& e,
                                                  const std::vector<int64_t>& offsets,
                                                  const std::vector<int64_t>& lengths, double density,
                                                  const std::vector<bool>& exact,
                                                  const std::vector<int64_t>& seeds, int64_t base) {
  checkNamed("topk_ef_segments", "g", g, at::kFloat);
  checkNamed("topk_ef_segments", "e", e, at::kFloat);
  checkGradAndResidual("topk_ef_segments", g, e);
  const size_t count = offsets.size();
  if (lengths.size() != count || exact.size() != count || seeds.size() != count)
    usageError("pycomm topk_ef_segments: offsets, lengths, exact and seeds must have one entry per segment");
  if (base < 0) usageError("pycomm topk_ef_segments: base must be >= 0");
  int64_t end = 0;
  for (size_t i = 0; i < count; ++i) {
    if (offsets[i] < end || lengths[i] < 0 || offsets[i] > g.numel() || lengths[i] > g.numel() - offsets[i])
      usageError("pycomm topk_ef_segments: segment " + std::to_string(i) + " [" + std::to_string(offsets[i]) +
                 ", +" + std::to_string(lengths[i]) + ") must lie in [0, " + std::to_string(g.numel()) +
                 ") after the previous one");
    checkSeed("topk_ef_segments", seeds[i]);
    end = offsets[i] + lengths[i];
  }
  return translate([&] {
    std::vector<size_t> ks(count);
    size_t cap = 0;
    for (size_t i = 0; i < count; ++i) {
      ks[i] = topkCount("topk_ef_segments", static_cast<size_t>(lengths[i]), density);
      cap += exact[i] ? ks[i] : topkBandHigh(ks[i]);
    }
    at::Tensor indices = at::empty({static_cast<int64_t>(cap)}, at::kLong);
    at::Tensor values = at::empty({static_cast<int64_t>(cap)}, at::kFloat);
    size_t at = 0;
    {
      py::gil_scoped_release release;
      const float* gp = g.data_ptr<float>();
      float* ep = e.data_ptr<float>();
      int64_t* ip = indices.data_ptr<int64_t>();
      float* vp = values.data_ptr<float>();
      for (size_t i = 0; i < count; ++i) {
        const size_t n = static_cast<size_t>(lengths[i]);
        // what is left of the output holds this segment's capacity: the earlier ones
        // wrote at most theirs
        const size_t m = topkErrorFeedback(gp + offsets[i], ep + offsets[i], n, ks[i], exact[i],
                                           static_cast<uint64_t>(seeds[i]), ip + at, vp + at);
        for (size_t j = at; j < at + m; ++j) ip[j] += base + offsets[i];
        at += m;
      }
    }
    const int64_t used = static_cast<int64_t>(at);
    return std::make_tuple(indices.narrow(0, 0, used), values.narrow(0, 0, used));
  });
}

// The checked options of a quantize call (bits, block, rounding, seed).
QuantizeOptions quantizeOptions(const char* op, int64_t bits, int64_t block, bool stochastic,
                                int64_t seed) {
  QuantizeOptions opts;
  opts.bits = static_cast<int>(bits);
  opts.block = checkBlock(op, block);
  opts.stochastic = stochastic;
  opts.seed = static_cast<uint64_t>(seed);
  checkQuantizeOptions(op, opts.bits, opts.block);
  return opts;
}

at::Tensor quantizeTensor(const at::Tensor& x, int64_t bits, int64_t block, bool stochastic,
                          int64_t seed, const std::optional<at::Tensor>& outArg) {
  checkSeed("quantize", seed);
#ifdef PYCOMM_WITH_CUDA
  if (x.is_cuda())
    return translate([&] {
      return cudabind::quantize(x, quantizeOptions("quantize", bits, block, stochastic, seed), outArg);
    });
#endif
  checkNamed("quantize", "x", x, at::kFloat);
  return translate([&] {
    const QuantizeOptions opts = quantizeOptions("quantize", bits, block, stochastic, seed);
    const size_t n = static_cast<size_t>(x.numel());
    at::Tensor out = outputOf("quantize", outArg,
                              static_cast<int64_t>(packedSize(n, opts.bits, opts.block)), at::kByte);
    {
      py::gil_scoped_release release;
      quantize(x.data_ptr<float>(), n, opts, out.data_ptr<uint8_t>());
    }
    return out;
  });
}

at::Tensor quantizeEf(const at::Tensor& g, at::Tensor& e, int64_t bits, int64_t block,
                      bool stochastic, int64_t seed, const std::optional<at::Tensor>& outArg) {
  checkSeed("quantize_ef", seed);
  checkGradAndResidual("quantize_ef", g, e);
#ifdef PYCOMM_WITH_CUDA
  if (g.is_cuda() || e.is_cuda())
    return translate([&] {
      return cudabind::quantizeEf(g, e, quantizeOptions("quantize_ef", bits, block, stochastic, seed),
                                  outArg);
    });
#endif
  checkNamed("quantize_ef", "g", g, at::kFloat);
  checkNamed("quantize_ef", "e", e, at::kFloat);
  return translate([&] {
    const QuantizeOptions opts = quantizeOptions("quantize_ef", bits, block, stochastic, seed);
    const size_t n = static_cast<size_t>(g.numel());
    at::Tensor out = outputOf("quantize_ef", outArg,
                              static_cast<int64_t>(packedSize(n, opts.bits, opts.block)), at::kByte);
    {
      py::gil_scoped_release release;
      quantizeErrorFeedback(g.data_ptr<float>(), e.data_ptr<float>(), n, opts,
                            out.data_ptr<uint8_t>());
    }
    return out;
  });
}

at::Tensor dequantizeTensor(const at::Tensor& packed, int64_t count, int64_t bits, int64_t block,
                            const std::optional<at::Tensor>& outArg) {
  if (count < 0) usageError("pycomm dequantize: count must be >= 0");
#ifdef PYCOMM_WITH_CUDA
  const bool onCuda = packed.is_cuda();
#else
  const bool onCuda = false;
#endif
  if ((!onCuda && packed.device().type() != at::kCPU) || packed.scalar_type() != at::kByte ||
      !packed.is_contiguous())
    usageError("pycomm dequantize: packed must be a contiguous CPU uint8 tensor");
  return translate([&] {
    const size_t b = checkBlock("dequantize", block);
    checkQuantizeOptions("dequantize", static_cast<int>(bits), b);
    const size_t n = static_cast<size_t>(count);
    const size_t need = packedSize(n, static_cast<int>(bits), b);
    if (static_cast<size_t>(packed.numel()) != need)
      usageError("pycomm dequantize: packed holds " + std::to_string(packed.numel()) +
                 " bytes where " + std::to_string(need) + " were expected for count " +
                 std::to_string(n) + ", bits " + std::to_string(bits) + ", block " +
                 std::to_string(b));
#ifdef PYCOMM_WITH_CUDA
    if (onCuda) return cudabind::dequantize(packed, n, static_cast<int>(bits), b, outArg);
#endif
    at::Tensor out = outputOf("dequantize", outArg, count, at::kFloat);
    {
      py::gil_scoped_release release;
      dequantize(packed.data_ptr<uint8_t>(), n, static_cast<int>(bits), b, out.data_ptr<float>());
    }
    return out;
  });
}

ReduceOp reduceOpNamed(const std::string& name) {
  static const std::pair<const char*, ReduceOp> ops[] = {
      {"sum", ReduceOp::kSum}, {"product", ReduceOp::kProduct}, {"min", ReduceOp::kMin},
      {"max", ReduceOp::kMax}, {"band", ReduceOp::kBand},       {"bor", ReduceOp::kBor},
      {"bxor", ReduceOp::kBxor}};
  for (const auto& [key, op] : ops)
    if (name == key) return op;
  usageError("pycomm reduce: unknown op '" + name +
             "' (sum, product, min, max, band, bor, bxor; AVG is SUM then divide_)");
}

// out = op(a, b) element-wise, on CPU or (CUDA build) CUDA tensors.
at::Tensor reduceTensors(const at::Tensor& a, const at::Tensor& b, const std::string& opName,
                         const std::optional<at::Tensor>& outArg) {
  const ReduceOp op = reduceOpNamed(opName);
  const DataType dtype = toDataType("reduce", a.scalar_type());
  if (b.scalar_type() != a.scalar_type() || b.numel() != a.numel() || b.device() != a.device())
    usageError("pycomm reduce: a and b must have the same dtype, size and device");
  if (!a.is_contiguous() || !b.is_contiguous()) usageError("pycomm reduce: tensors must be contiguous");
  at::Tensor out = outArg ? *outArg : at::empty_like(a);
  if (out.scalar_type() != a.scalar_type() || out.numel() != a.numel() ||
      out.device() != a.device() || !out.is_contiguous())
    usageError("pycomm reduce: out must be a contiguous tensor like a");
  return translate([&] {
    checkReduceSupported("reduce", op, dtype);
#ifdef PYCOMM_WITH_CUDA
    if (a.is_cuda()) {
      cudabind::reduce(out, a, b, dtype, op);
      return out;
    }
#endif
    if (!a.device().is_cpu()) usageError("pycomm reduce: tensors must be on the CPU (got " + a.device().str() + ")");
    if (out.is_same(b) && !out.is_same(a))
      usageError("pycomm reduce: on CPU, out may alias a but not b");
    if (!out.is_same(a)) out.copy_(a);
    py::gil_scoped_release release;
    reduceInto(out.data_ptr(), b.data_ptr(), static_cast<size_t>(a.numel()), dtype, op);
    return out;
  });
}

// t /= divisor in place (floating dtypes), on CPU or (CUDA build) CUDA tensors.
at::Tensor divideTensor(at::Tensor& t, int64_t divisor) {
  const DataType dtype = toDataType("divide_", t.scalar_type());
  if (!isFloating(dtype)) typeError("pycomm divide_: needs a floating dtype (got " +
                                               std::string(dataTypeName(dtype)) + ")");
  if (divisor <= 0) usageError("pycomm divide_: divisor must be > 0");
  if (!t.is_contiguous()) usageError("pycomm divide_: t must be contiguous");
  return translate([&] {
#ifdef PYCOMM_WITH_CUDA
    if (t.is_cuda()) {
      cudabind::divide(t, dtype, static_cast<int>(divisor));
      return t;
    }
#endif
    if (!t.device().is_cpu()) usageError("pycomm divide_: t must be on the CPU (got " + t.device().str() + ")");
    divideBy(t.data_ptr(), static_cast<size_t>(t.numel()), dtype, static_cast<int>(divisor));
    return t;
  });
}

void checkReduceTensor(const char* name, const at::Tensor& t, const at::Tensor& like) {
  if (t.device().type() != at::kCPU)
    usageError(std::string("pycomm reduce: ") + name + " must be a CPU tensor (got " +
               t.device().str() + ")");
  if (!t.is_contiguous()) usageError(std::string("pycomm reduce: ") + name + " must be contiguous");
  if (t.scalar_type() != like.scalar_type())
    typeError(std::string("pycomm reduce: ") + name + " is " +
                         dataTypeName(toDataType("reduce", t.scalar_type())) + ", the output is " +
                         dataTypeName(toDataType("reduce", like.scalar_type())));
  if (t.numel() != like.numel())
    usageError(std::string("pycomm reduce: ") + name + " has " + std::to_string(t.numel()) +
               " elements, the output has " + std::to_string(like.numel()));
}

// out = op(a, b); out may be a or b itself (the three-operand reduceInto).
void reduceIntoTensor(at::Tensor out, const at::Tensor& a, const at::Tensor& b,
                      const std::string& opName) {
  const ReduceOp op = reduceOpNamed(opName);
  checkReduceTensor("out", out, out);
  checkReduceTensor("a", a, out);
  checkReduceTensor("b", b, out);
  const DataType dtype = toDataType("reduce", out.scalar_type());
  translate([&] { checkReduceSupported("reduce", op, dtype); });
  const char* o = static_cast<const char*>(out.data_ptr());
  for (const at::Tensor* t : {&a, &b}) {
    const char* p = static_cast<const char*>(t->data_ptr());
    if (p != o && p < o + out.nbytes() && o < p + t->nbytes())
      usageError("pycomm reduce: out partially overlaps an operand (it may only be one of them)");
  }
  py::gil_scoped_release release;
  reduceInto(out.data_ptr(), a.data_ptr(), b.data_ptr(), static_cast<size_t>(out.numel()), dtype,
             op);
}

// For each segment [offsets[i], offsets[i] + lengths[i]) of x (elements of a
// contiguous CPU tensor of any dtype): whether all its bytes are zero.
std::vector<bool> zeroSegments(const at::Tensor& x, const std::vector<int64_t>& offsets,
                               const std::vector<int64_t>& lengths) {
  if (x.device().type() != at::kCPU || !x.is_contiguous())
    usageError("pycomm zero_segments: x must be a contiguous CPU tensor");
  if (offsets.size() != lengths.size())
    usageError("pycomm zero_segments: offsets and lengths must have one entry per segment");
  for (size_t i = 0; i < offsets.size(); ++i)
    if (offsets[i] < 0 || lengths[i] < 0 || offsets[i] > x.numel() || lengths[i] > x.numel() - offsets[i])
      usageError("pycomm zero_segments: segment " + std::to_string(i) + " [" + std::to_string(offsets[i]) +
                 ", +" + std::to_string(lengths[i]) + ") must lie in [0, " + std::to_string(x.numel()) + ")");
  std::vector<bool> zero(offsets.size());
  const char* base = static_cast<const char*>(x.data_ptr());
  const size_t size = x.element_size();
  py::gil_scoped_release release;
  for (size_t i = 0; i < offsets.size(); ++i)
    zero[i] = allZeroBytes(base + offsets[i] * size, static_cast<size_t>(lengths[i]) * size);
  return zero;
}

void setCpuIsa(const std::string& name) {
  CpuIsa isa = bestCpuIsa();
  if (name != "auto" && !parseCpuIsa(name, &isa))
    usageError("pycomm set_cpu_isa: unknown instruction set '" + name +
               "' (auto, generic, avx2, avx512)");
  translate([&] { setReduceIsa(isa); });
}

std::vector<std::string> cpuIsaNames() {
  std::vector<std::string> names;
  for (CpuIsa isa : supportedCpuIsas()) names.push_back(cpuIsaName(isa));
  return names;
}

}  // namespace

void registerKernelBindings(py::module_& m) {
  auto k = m.def_submodule("kernels",
                           "compression and reduction kernels on CPU tensors, and on CUDA tensors "
                           "in the CUDA build (see csrc/kernels/)");
  k.def("topk", &topk, py::arg("x"), py::arg("density"), py::arg("exact") = true,
        py::arg("seed") = 0,
        "(indices int64, values float32) of the largest |x| in ascending index order; exact: "
        "k = ceil(density * n) elements; approximate: within topk_band(k)");
  k.def("topk_info", &topkInfo, py::arg("x"), py::arg("density"), py::arg("seed") = 0,
        "diagnostics of one approximate top-k call (path taken, sample size, threshold)");
  k.def("topk_ef", &topkEf, py::arg("g"), py::arg("e"), py::arg("density"),
        py::arg("exact") = true, py::arg("seed") = 0,
        "top-k of g + e; e <- g + e with the selected entries zeroed (in place)");
  k.def("topk_ef_segments", &topkEfSegments, py::arg("g"), py::arg("e"), py::arg("offsets"),
        py::arg("lengths"), py::arg("density"), py::arg("exact"), py::arg("seeds"), py::arg("base") = 0,
        "topk_ef over ascending, disjoint segments of g and e in one call (CPU): the "
        "concatenated (indices + base + offset, values), segment after segment");
  k.def("zero_segments", &zeroSegments, py::arg("x"), py::arg("offsets"), py::arg("lengths"),
        "for each segment of a contiguous CPU tensor (in elements): whether all its bytes are zero, "
        "stopping at the first nonzero block");
  k.def(
      "topk_count",
      [](int64_t count, double density) {
        if (count < 0) usageError("pycomm topk: count must be >= 0");
        return translate([&] { return topkCount("topk", static_cast<size_t>(count), density); });
      },
      py::arg("count"), py::arg("density"));
  k.def(
      "topk_band", [](int64_t k) { return py::make_tuple(topkBandLow(k), topkBandHigh(k)); },
      py::arg("k"), "(low, high): the counts the approximate top-k may return for k");
  k.def("quantize", &quantizeTensor, py::arg("x"), py::arg("bits") = 8, py::arg("block") = 256,
        py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("out") = py::none(),
        "packed uint8 (per block: float32 scale, then codes; layout in kernels/cpu/quantize.h)");
  k.def("dequantize", &dequantizeTensor, py::arg("packed"), py::arg("count"), py::arg("bits") = 8,
        py::arg("block") = 256, py::arg("out") = py::none());
  k.def("quantize_ef", &quantizeEf, py::arg("g"), py::arg("e"), py::arg("bits") = 8,
        py::arg("block") = 256, py::arg("stochastic") = false, py::arg("seed") = 0,
        py::arg("out") = py::none(),
        "packed quantize(g + e); e <- g + e - dequantize(packed) (in place)");
  k.def(
      "packed_size",
      [](int64_t count, int64_t bits, int64_t block) {
        if (count < 0) usageError("pycomm packed_size: count must be >= 0");
        return translate([&] {
          return packedSize(static_cast<size_t>(count), static_cast<int>(bits),
                            checkBlock("packed_size", block));
        });
      },
      py::arg("count"), py::arg("bits"), py::arg("block"));
  k.def("reduce", &reduceTensors, py::arg("a"), py::arg("b"), py::arg("op") = "sum",
        py::arg("out") = py::none(),
        "out = op(a, b) element-wise with the collectives' reduction kernels (kernels/cpu/reduce.h, "
        "kernels/cuda/reduce.cuh); op: sum, product, min, max, band, bor, bxor");
  k.def("divide_", &divideTensor, py::arg("t"), py::arg("divisor"),
        "t /= divisor in place (floating dtypes; how AVG finishes)");
  k.def("reduce_into", &reduceIntoTensor, py::arg("out"), py::arg("a"), py::arg("b"),
        py::arg("op") = "sum", "out = op(a, b) element-wise; out may be a or b itself");
  k.def("cpu_isa", [] { return std::string(cpuIsaName(reduceIsa())); },
        "the instruction set the reductions use now (generic, avx2 or avx512)");
  k.def("cpu_isas", &cpuIsaNames, "the instruction sets this CPU and build support");
  k.def("set_cpu_isa", &setCpuIsa, py::arg("name"),
        "force the reductions' instruction set, process-wide (auto = the best supported); "
        "for tests and benchmarks");
}

}  // namespace pycomm
