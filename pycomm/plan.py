"""The all-reduce cost model, calibrated on this host, and what it predicts elsewhere.

    python -m pycomm.plan --calibrate                 # measure this host, cache it
    python -m pycomm.plan --hosts 4 --ranks-per-host 8 --bandwidth 10gbit --latency 20us
    python -m pycomm.plan --extrapolate --plot plan.png
    python -m pycomm.plan --validate                  # predicted against measured, here

The model is the one `auto` uses (csrc/algorithms/allreduce_registry.cc, read through
``pycomm._C.allreduce_costs``): a message costs alpha plus bytes * beta, reducing costs
gamma per byte, the shared-memory arena has its own shm_alpha and shm_beta, and each
algorithm is a formula over them (ring, sharded = halving/doubling, tree, shm,
hierarchical). The compressed all-reduces are modelled here, in Python, since `auto`
never picks them (a hook does): the dense sharded exchange on the compressed bytes plus
the measured encode and decode time per input byte.

``--calibrate`` fits the constants to pycomm's own benchmark on this host (2 ranks:
ring over TCP for alpha and beta, the shared-memory algorithm for shm_alpha and
shm_beta, the reduction kernel for gamma, the compression kernels for their encode
cost) and caches them (pycomm.config.cost_cache_path); groups created afterwards on
this host use them (PYCOMM_COST_MODEL). A topology is hosts x ranks per host with a link
bandwidth and latency: beta = 1/bandwidth and alpha = latency + the per-message overhead
measured here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import _C
from .config import COST_FIELDS, cost_cache_path, read_cost_model

__all__ = ["DEFAULT_MODEL", "Topology", "predict", "winners", "break_even_gbps", "calibrate", "validate",
           "load_calibration", "save_calibration", "stream_lines", "main"]

PREFIX = "pycomm plan:"
# The built-in constants (common/cost_model.h).
DEFAULT_MODEL: Dict[str, float] = {name: float(getattr(_C.CostModel(), name)) for name in COST_FIELDS}
DENSITIES = (0.01, 0.001)
BITS = (8, 4)
QUANT_BLOCK = 256
SIZES = tuple(1 << e for e in range(10, 31, 2))  # 1 KiB .. 1 GiB


class Topology:
    """hosts x ranks_per_host, with the link between hosts (None: this host's model)."""

    def __init__(self, hosts: int, ranks_per_host: int, gbps: Optional[float] = None,
                 latency_s: Optional[float] = None):
        if hosts < 1 or ranks_per_host < 1:
            raise ValueError(f"{PREFIX} hosts and ranks per host must be >= 1 (got {hosts} x {ranks_per_host})")
        self.hosts, self.ranks_per_host = hosts, ranks_per_host
        self.gbps, self.latency_s = gbps, latency_s

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def model(self, base: Dict[str, float]) -> Dict[str, float]:
        """``base`` with the link's beta and alpha where given."""
        model = dict(base)
        if self.gbps:
            model["beta"] = 8.0 / (self.gbps * 1e9)
        if self.latency_s is not None:
            model["alpha"] = self.latency_s + base["alpha"]  # plus the per-message overhead
        return model

    def __str__(self) -> str:
        link = f", {self.gbps:g} Gbit/s" if self.gbps else ""
        link += f", {self.latency_s * 1e6:g} us" if self.latency_s is not None else ""
        return f"{self.hosts} host(s) x {self.ranks_per_host} rank(s){link}"


def _cost_object(model: Dict[str, float]):
    cost = _C.CostModel()
    for name in COST_FIELDS:
        setattr(cost, name, float(model[name]))
    return cost


def predict(model: Dict[str, float], topology: Topology, nbytes: int,
            codec: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """{algorithm: predicted seconds} for an all-reduce of ``nbytes`` per rank: every
    algorithm of the C++ table that fits, and with ``codec`` (encode + decode seconds
    per input byte, "topk" and "quantize") the compressed all-reduces ("topk d=0.01",
    "quantize 8-bit", ...)."""
    m = topology.model(model)
    one_host = topology.hosts == 1
    hosts = topology.hosts if topology.hosts > 1 else 0
    out = dict(_C.allreduce_costs(int(nbytes), topology.ranks, one_host, hosts, _cost_object(m)))
    if codec:
        out.update(_compressed(m, topology, nbytes, codec))
    return out


def _compressed(m: Dict[str, float], topology: Topology, nbytes: int, codec: Dict[str, float]) -> Dict[str, float]:
    """The compressed all-reduces: the sharded exchange of the compressed bytes between
    hosts (a reduce-scatter then an all-gather), plus encode and decode per input byte.
    top-k at density d sends (index, value) pairs, 8 bytes per kept 4-byte element;
    b-bit quantization sends b/32 of the bytes plus a float32 scale per block."""
    n = topology.ranks
    if n < 2:
        return {}
    steps = 2.0 * math.ceil(math.log2(n))
    out = {}
    for density in DENSITIES:
        wire = 2.0 * density * nbytes
        out[f"topk d={density:g}"] = (steps * m["alpha"] + 2.0 * (n - 1) / n * wire * m["beta"]
                                      + nbytes * codec["topk"])
    for bits in BITS:
        wire = nbytes * bits / 32.0 + nbytes / 4.0 / QUANT_BLOCK * 4.0
        out[f"quantize {bits}-bit"] = (steps * m["alpha"] + 2.0 * (n - 1) / n * wire * m["beta"]
                                       + nbytes * codec["quantize"] + (n - 1) / n * wire * m["gamma"])
    return out


def winners(costs: Dict[str, float]) -> Tuple[str, str]:
    """(the cheapest dense algorithm, the cheapest of all)."""
    dense = {k: v for k, v in costs.items() if not k.startswith(("topk", "quantize"))}
    return min(dense, key=dense.get), min(costs, key=costs.get)


def break_even_gbps(model: Dict[str, float], topology: Topology, nbytes: int, name: str,
                    codec: Optional[Dict[str, float]] = None) -> Optional[float]:
    """The link speed (Gbit/s) below which the compressed all-reduce ``name`` beats the
    best dense network algorithm at ``nbytes``: both are linear in beta, so it is where
    the lines cross. None when it never pays (or always does: inf)."""
    def line(gbps):
        t = Topology(topology.hosts, topology.ranks_per_host, gbps, topology.latency_s)
        costs = predict(model, t, nbytes, codec)
        dense = min(v for k, v in costs.items() if k in ("ring", "sharded", "tree"))
        return dense, costs[name]
    # Two points give each line: beta = 8/(gbps 1e9).
    (d1, c1), (d2, c2) = line(1.0), line(1000.0)
    b1, b2 = 8.0 / 1e9, 8.0 / 1e12
    slope_d, slope_c = (d1 - d2) / (b1 - b2), (c1 - c2) / (b1 - b2)
    icpt_d, icpt_c = d1 - slope_d * b1, c1 - slope_c * b1
    if slope_d <= slope_c:
        return None if icpt_c >= icpt_d else math.inf
    beta = (icpt_c - icpt_d) / (slope_d - slope_c)
    if beta <= 0:
        return math.inf
    return 8.0 / beta / 1e9


# ---------------------------------------------------------------------------
# calibration: pycomm's own benchmark on this host
# ---------------------------------------------------------------------------

def _fit_line(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """Least squares t = a + b S, weighted by 1/t (relative error, so the small sizes
    that fix a count as much as the large ones that fix b)."""
    sw = swx = swy = swxx = swxy = 0.0
    for x, y in points:
        w = 1.0 / (y * y)
        sw, swx, swy = sw + w, swx + w * x, swy + w * y
        swxx, swxy = swxx + w * x * x, swxy + w * x * y
    det = sw * swxx - swx * swx
    b = (sw * swxy - swx * swy) / det
    a = (swy - b * swx) / sw
    return max(a, 0.0), max(b, 0.0)


SMALL_MAX = 32 << 10  # sizes up to here fix the per-message term
LARGE_MIN = 1 << 20  # sizes from here fix the per-byte term


def _fit_regimes(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """t = a + b S fitted in two regimes, as the planner is used: a = the median time of
    the small sizes (latency-bound), then b by relative least squares over the large
    sizes with a fixed. (One weighted line through every size lets the many small
    sizes, whose time is flat, pull b away from the large sizes the goal is about.)"""
    small = sorted(t for s, t in points if s <= SMALL_MAX)
    large = [(s, t) for s, t in points if s >= LARGE_MIN]
    if not small or not large:
        return _fit_line(points)
    a = small[len(small) // 2]
    num = sum(s * (t - a) / (t * t) for s, t in large)
    den = sum(s * s / (t * t) for s, t in large)
    return a, max(num / den, 0.0)


def _sweep(algo: str, transport: str, max_bytes: int, iters: int, sockets: int = 1,
           min_bytes: int = 8) -> List[Tuple[float, float]]:
    """(bytes, seconds) of pycomm's 2-rank all-reduce with ``algo`` over ``transport``
    (``sockets`` TCP streams per peer, one I/O thread each)."""
    from .bench import BenchConfig, run_benchmark

    knobs = {"PYCOMM_TRANSPORT": transport, "PYCOMM_SOCKETS_PER_PEER": str(sockets),
             "PYCOMM_IO_THREADS": str(sockets)}
    saved = {name: os.environ.get(name) for name in knobs}
    os.environ.update(knobs)
    try:
        cfg = BenchConfig(nprocs=2, min_bytes=min_bytes, max_bytes=max_bytes, step_factor=4, iters=iters,
                          warmup=3, algos=(algo,), peer=None, check=False, quiet=True, tcp_reference=False)
        result = run_benchmark(cfg)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return [(float(row["size_bytes"]), row["time_us"] * 1e-6) for row in result.rows if row["time_us"]]


def _seconds_per_byte(fn, nbytes: int, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / nbytes


def _kernel_costs(nbytes: int = 16 << 20) -> Tuple[float, Dict[str, float]]:
    """gamma (the reduction kernel, one thread) and the codecs' encode + decode per byte."""
    import torch

    k = _C.kernels
    n = nbytes // 4
    a, b = torch.randn(n), torch.randn(n)
    gamma = _seconds_per_byte(lambda: k.reduce(a, b, "sum", out=a), nbytes)
    topk = _seconds_per_byte(lambda: k.topk(a, 0.01, False), nbytes)
    packed = k.quantize(a, 8, QUANT_BLOCK)
    quant = _seconds_per_byte(lambda: k.quantize(a, 8, QUANT_BLOCK), nbytes)
    quant += _seconds_per_byte(lambda: k.dequantize(packed, n, 8, QUANT_BLOCK), nbytes)
    return gamma, {"topk": topk, "quantize": quant}


def calibrate(max_bytes: int = 16 << 20, iters: int = 10, verbose: bool = True) -> dict:
    """Measure this host's constants (2 ranks); returns the calibration (model, codec,
    the measured points)."""
    gamma, codec = _kernel_costs()
    # 2-rank ring (allreduce_registry.cc): 2 alpha + (S + 4097) beta + S/2 gamma.
    tcp = _sweep("ring", "tcp", max_bytes, iters)
    a, b = _fit_regimes(tcp)
    beta = max(b - gamma / 2.0, 1e-12)
    alpha = max((a - 4097 * beta) / 2.0, 1e-7)
    # 2-rank shm: 2 shm_alpha + S shm_beta + S/2 gamma.
    shm = _sweep("shm", "auto", max_bytes, iters)
    sa, sb = _fit_regimes(shm)
    model = {"alpha": alpha, "beta": beta, "gamma": gamma, "delta": DEFAULT_MODEL["delta"],
             "shm_alpha": max(sa / 2.0, 1e-8), "shm_beta": max(sb - gamma / 2.0, 1e-13)}
    # One TCP stream (one socket per peer, one I/O thread): beta is its time per byte,
    # so 8 / beta bit/s is what one stream moves here (pycomm.streams). The ring at the
    # largest size with 2 and 4 streams shows what more streams do on this host.
    streams = {"per_stream_gbps": 8.0 / beta / 1e9, "ring_seconds": {"1": tcp[-1][1]}}
    for count in (2, 4):
        streams["ring_seconds"][str(count)] = _sweep("ring", "tcp", max_bytes, iters, count, max_bytes)[-1][1]
    calibration = {"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "model": model, "codec": codec, "points": {"ring_tcp": tcp, "shm": shm}, "streams": streams,
                   "note": "delta is the built-in default (not measured: it needs 3+ ranks)"}
    if verbose:
        print(f"# calibrated on {calibration['host']}: " + ", ".join(f"{k} {_fmt_const(k, v)}"
                                                                   for k, v in model.items()))
        print(f"# one TCP stream: {streams['per_stream_gbps']:.2f} Gbit/s; ring of {_size(max_bytes)}, 2 ranks: "
              + ", ".join(f"{n} stream(s) {t * 1e3:.2f} ms" for n, t in streams["ring_seconds"].items()))
    return calibration


def _fmt_const(name: str, value: float) -> str:
    if "beta" in name or name == "gamma":
        return f"{1.0 / value / 1e9:.2f} GB/s" if value > 0 else "0"
    return f"{value * 1e6:.1f} us"


def save_calibration(calibration: dict, path: Optional[str] = None) -> str:
    path = path or cost_cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(calibration, handle, indent=1)
    os.replace(tmp, path)
    return path


def load_calibration(path: Optional[str] = None) -> Tuple[Dict[str, float], Dict[str, float], str]:
    """(model, codec, where from): the cached calibration, else the built-in constants
    with the compression kernels timed now (a second or two)."""
    path = path or cost_cache_path()
    if os.path.exists(path):
        model = read_cost_model(path)
        with open(path) as handle:
            codec = json.load(handle).get("codec")
        return model, codec or _kernel_costs()[1], path
    return dict(DEFAULT_MODEL), _kernel_costs()[1], "built-in constants (no calibration cached)"


# ---------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------

def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def table(model, codec, topology: Topology, sizes: Sequence[int] = SIZES) -> List[str]:
    lines = [f"# {topology} ({topology.ranks} ranks): predicted time (us) per algorithm"]
    names = list(predict(model, topology, sizes[0], codec))
    lines.append(f"{'size':>9} " + " ".join(f"{n[:15]:>15}" for n in names) + f" {'auto':>12} {'best':>16}")
    for nbytes in sizes:
        costs = predict(model, topology, nbytes, codec)
        auto = _C._select_algorithm(nbytes, topology.ranks, topology.hosts == 1,
                                    topology.hosts if topology.hosts > 1 else 0, _cost_object(topology.model(model)))
        lines.append(f"{_size(nbytes):>9} " + " ".join(f"{costs[n] * 1e6:>15.1f}" for n in names)
                     + f" {auto:>12} {winners(costs)[1]:>16}")
    return lines


def compression_table(model, codec, topology: Topology, nbytes: int = 64 << 20) -> List[str]:
    lines = [f"# {topology}, {_size(nbytes)}: link speed below which each compressed all-reduce "
             "beats the best dense network algorithm"]
    for name in [k for k in predict(model, topology, nbytes, codec) if k.startswith(("topk", "quantize"))]:
        gbps = break_even_gbps(model, topology, nbytes, name, codec)
        text = "never" if gbps is None else "always" if math.isinf(gbps) else f"{gbps:.1f} Gbit/s"
        lines.append(f"{name:>16}: {text}")
    return lines


EXTRAPOLATE = [(64, 8), (512, 8), (4096, 8)]
LINKS = [(100.0, 5e-6), (10.0, 20e-6)]  # Gbit/s, one-way latency between hosts


def extrapolation(model, codec) -> List[str]:
    lines = ["# extrapolation: 8 ranks per host; network algorithms among the host leaders "
             "(what hierarchical runs between hosts), and flat over every rank"]
    for gbps, latency in LINKS:
        for ranks, per_host in EXTRAPOLATE:
            hosts = ranks // per_host
            leaders = Topology(hosts, 1, gbps, latency)
            flat = Topology(hosts, per_host, gbps, latency)
            crossings = []
            previous = None
            for nbytes in [1 << e for e in range(8, 31)]:
                costs = {k: v for k, v in predict(model, leaders, nbytes, codec).items() if k in ("ring", "sharded", "tree")}
                best = min(costs, key=costs.get)
                if best != previous:
                    crossings.append(f"{best} from {_size(nbytes)}")
                    previous = best
            hier = predict(model, flat, 64 << 20, codec)
            lines.append(f"{ranks:>5} ranks ({hosts} hosts), {gbps:g} Gbit/s, {latency * 1e6:g} us: leaders: "
                         + ", ".join(crossings)
                         + f"; 64 MiB hierarchical {hier['hierarchical'] * 1e3:.1f} ms vs flat ring "
                         f"{hier['ring'] * 1e3:.1f} ms")
    return lines


def write_plot(model, codec, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(LINKS), len(EXTRAPOLATE), figsize=(15, 8), sharex=True)
    sizes = [1 << e for e in range(8, 31)]
    for row, (gbps, latency) in enumerate(LINKS):
        for col, (ranks, per_host) in enumerate(EXTRAPOLATE):
            ax = axes[row][col]
            topology = Topology(ranks // per_host, per_host, gbps, latency)
            costs = [predict(model, topology, s, codec) for s in sizes]
            for name in ("ring", "sharded", "tree", "hierarchical", "topk d=0.01", "quantize 8-bit"):
                if name in costs[0]:
                    ax.plot(sizes, [c[name] for c in costs], "--" if " " in name else "-", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{ranks} ranks, {gbps:g} Gbit/s, {latency * 1e6:g} us", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if row == len(LINKS) - 1:
                ax.set_xlabel("bytes per rank")
            if col == 0:
                ax.set_ylabel("predicted time (s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("pycomm cost model: predicted all-reduce time (8 ranks per host)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# validation: predicted against measured on this host
# ---------------------------------------------------------------------------

def validate(model, codec, ranks: Sequence[int] = (2, 4), max_bytes: int = 64 << 20,
             iters: int = 10) -> Tuple[List[str], Dict[int, float]]:
    """Measure ring / sharded / tree over TCP and shm here at sizes from 1 MiB and
    compare with the prediction. Returns (table lines, {ranks: worst relative error})."""
    from .bench import BenchConfig, run_benchmark

    lines = [f"{'ranks':>5} {'algorithm':>9} {'size':>9} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"]
    worst: Dict[int, float] = {}
    for n in ranks:
        for transport, algos in (("tcp", ("ring", "sharded", "tree")), ("auto", ("shm",))):
            saved = os.environ.get("PYCOMM_TRANSPORT")
            os.environ["PYCOMM_TRANSPORT"] = transport
            try:
                cfg = BenchConfig(nprocs=n, min_bytes=1 << 20, max_bytes=max_bytes, step_factor=4, iters=iters,
                                  warmup=2, algos=algos, peer=None, check=False, quiet=True, tcp_reference=False)
                rows = run_benchmark(cfg).rows
            finally:
                if saved is None:
                    os.environ.pop("PYCOMM_TRANSPORT", None)
                else:
                    os.environ["PYCOMM_TRANSPORT"] = saved
            topology = Topology(1, n)
            for row in rows:
                if not row["time_us"]:
                    continue
                if transport == "tcp":  # every rank is a host of its own to the model
                    costs = dict(_C.allreduce_costs(row["size_bytes"], n, False, 0, _cost_object(model)))
                else:
                    costs = predict(model, topology, row["size_bytes"], codec)
                predicted, measured = costs[row["name"]], row["time_us"] * 1e-6
                if math.isinf(predicted):  # never chosen by auto here (sharded on 2 ranks)
                    continue
                error = (predicted - measured) / measured
                worst[n] = max(worst.get(n, 0.0), abs(error))
                lines.append(f"{n:>5} {row['name']:>9} {_size(row['size_bytes']):>9} {predicted * 1e3:>13.2f} "
                             f"{measured * 1e3:>12.2f} {100 * error:>+6.0f}%")
    return lines, worst


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

def _rate(text: str) -> float:
    t = text.strip().lower().replace("bit/s", "bit").replace("bps", "bit")
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("g", 1.0), ("m", 1e-3)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * scale
    return float(t)


def _latency(text: str) -> float:
    t = text.strip().lower()
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * scale
    return float(t)


def stream_lines(per_stream: Optional[float], link: Optional[float], where: str) -> List[str]:
    """The TCP stream model (pycomm.streams): what 1, 2, 4, 8 and 16 streams move over
    ``link`` Gbit/s when one moves ``per_stream``, and what auto picks."""
    from .streams import choose_streams, stream_gbps

    sockets, threads = choose_streams(link, per_stream)
    head = (f"# TCP streams: one stream moves {per_stream:.2f} Gbit/s on this host (calibration)"
            if per_stream else "# TCP streams: per-stream throughput not measured (python -m pycomm.plan --calibrate)")
    lines = [head + f"; link {f'{link:g} Gbit/s' if link else 'speed unknown'} ({where})"]
    if per_stream:
        lines.append("#   streams -> Gbit/s, min(link, streams x per-stream): " + ", ".join(
            f"{n} -> {stream_gbps(n, link, per_stream):.1f}" for n in (1, 2, 4, 8, 16)))
    lines.append(f"#   auto: PYCOMM_SOCKETS_PER_PEER={sockets}, PYCOMM_IO_THREADS={threads}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycomm.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="measure this host and cache the constants")
    parser.add_argument("--model", help="a calibration JSON (default: this host's cache, else built-in)")
    parser.add_argument("--hosts", type=int, default=None, help="hosts of the topology to predict")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--bandwidth", type=_rate, default=None, help="link between hosts, e.g. 10gbit")
    parser.add_argument("--latency", type=_latency, default=None, help="one-way latency, e.g. 20us")
    parser.add_argument("--extrapolate", action="store_true", help="64 / 512 / 4096 ranks, 100 and 10 Gbit/s")
    parser.add_argument("--plot", help="PNG of the extrapolation (needs matplotlib)")
    parser.add_argument("--validate", action="store_true", help="predicted against measured on this host")
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    args = parser.parse_args(argv)
    try:
        if args.calibrate:
            calibration = calibrate(max_bytes=args.max_bytes)
            print(f"# cached: {save_calibration(calibration, args.model)}")
        model, codec, source = load_calibration(args.model)
        print(f"# model from {source}: " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()))
        from .config import _per_stream, bind_address, load_config
        from .streams import link_gbps
        per_stream = _per_stream({"PYCOMM_COST_MODEL": args.model} if args.model else os.environ)
        if args.bandwidth:
            print("\n".join(stream_lines(per_stream, args.bandwidth, "--bandwidth")))
        else:
            address = bind_address(load_config())
            print("\n".join(stream_lines(per_stream, link_gbps(address), f"this host's {address}")))
        if args.hosts is not None:
            topology = Topology(args.hosts, args.ranks_per_host, args.bandwidth, args.latency)
            print("\n".join(table(model, codec, topology)))
            print("\n".join(compression_table(model, codec, topology)))
        if args.extrapolate or args.plot:
            print("\n".join(extrapolation(model, codec)))
        if args.plot:
            write_plot(model, codec, args.plot)
            print(f"# plot: {args.plot}")
        if args.validate:
            lines, worst = validate(model, codec, max_bytes=max(args.max_bytes, 1 << 20))
            print("\n".join(lines))
            for n, error in sorted(worst.items()):
                print(f"# {n} ranks on this host's {os.cpu_count()} CPUs: worst error from 1 MiB up "
                      f"{100 * error:.0f}% (goal: within 25%)")
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
        print(message if message.startswith(("pycomm", PREFIX)) else f"{PREFIX} {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
