"""The all-reduce cost model, calibrated on this host, and what it predicts elsewhere.

    python -m pycomm.plan --calibrate                 # measure this host, cache it
    python -m pycomm.plan --hosts 4 --ranks-per-host 8 --bandwidth 10gbit --latency 20us
    python -m pycomm.plan --extrapolate --plot plan.png
    python -m pycomm.plan --validate --out t.txt     # predicted against measured, namespaces (root)
    python -m pycomm.plan --validate-local            # predicted against measured, this host

The model is the one `auto` uses (csrc/algorithms/allreduce_registry.cc, read through
``pycomm._C.allreduce_costs``; docs/planner.md): a message costs alpha, a byte beta on
the link and cpu_beta of TCP copies at its two ends (a phase takes the larger of link
and CPU), cpu_beta_oneway per byte of a one-way transfer (the tree's phases), reducing
costs gamma per byte, the shared-memory arena has its own shm_alpha and shm_beta, and
each algorithm is a formula over them (ring, sharded =
halving/doubling, tree, shm, hierarchical). A topology adds its ranks per core
(oversubscription: the CPU terms scale by it) and whether links limit ingress (a NIC)
or egress only (tc tbf on the namespace hosts). The compressed all-reduces are
modelled here, in Python, since `auto` never picks them (a hook does): the dense
sharded exchange on the compressed bytes plus the measured encode and decode time per
input byte.

``--calibrate`` fits the constants to pycomm's own benchmark on this host (2 ranks:
ring over TCP loopback for alpha and cpu_beta, beta 0 since no link limits loopback,
the tree over TCP loopback for cpu_beta_oneway, the shared-memory algorithm for
shm_alpha and shm_beta, the reduction kernel for gamma, the compression kernels for
their encode cost) and caches them
(pycomm.config.cost_cache_path); groups created afterwards on this host use them
(PYCOMM_COST_MODEL). A topology is hosts x ranks per host with a link bandwidth and
latency: beta = 1/bandwidth and alpha = latency + the per-message overhead measured
here. ``--validate`` does the same on network namespaces and compares predicted with
measured for 2, 4 and 8 hosts with and without a tbf rate.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import sys
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _C
from ..config import COST_FIELDS, cost_cache_path, read_cost_model

__all__ = ["DEFAULT_MODEL", "Topology", "predict", "winners", "break_even_gbps", "calibrate", "validate",
           "calibrate_netns", "link_model", "validate_hosts", "validation_table", "oversubscription",
           "load_calibration", "save_calibration", "stream_lines", "topk_wire_bytes", "main"]

PREFIX = "pycomm plan:"
# The built-in constants (common/cost_model.h).
DEFAULT_MODEL: Dict[str, float] = {name: float(getattr(_C.CostModel(), name)) for name in COST_FIELDS}
DENSITIES = (0.01, 0.001)
BITS = (8, 4)
QUANT_BLOCK = 256
SIZES = tuple(1 << e for e in range(10, 31, 2))  # 1 KiB .. 1 GiB


class Topology:
    """hosts x ranks_per_host, with the link between hosts (None: this host's model).
    ``oversubscription``: ranks per CPU core on the most loaded machine (above 1 the
    CPU-bound terms scale by it); ``ingress_limited``: False where only each host's
    egress is limited (tc tbf in pycomm/netns.py), True for a real NIC."""

    def __init__(self, hosts: int, ranks_per_host: int, gbps: Optional[float] = None,
                 latency_s: Optional[float] = None, oversubscription: float = 1.0, ingress_limited: bool = True):
        if hosts < 1 or ranks_per_host < 1:
            raise ValueError(f"{PREFIX} hosts and ranks per host must be >= 1 (got {hosts} x {ranks_per_host})")
        self.hosts, self.ranks_per_host = hosts, ranks_per_host
        self.gbps, self.latency_s = gbps, latency_s
        self.oversubscription, self.ingress_limited = float(oversubscription), bool(ingress_limited)

    def shape(self) -> dict:
        """The keyword arguments of _C.allreduce_costs / _C._select_algorithm after the size."""
        return {"world_size": self.ranks, "one_host": self.hosts == 1,
                "hosts": self.hosts if self.hosts > 1 else 0, "oversubscription": self.oversubscription,
                "ingress_limited": self.ingress_limited}

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
        setattr(cost, name, float(model.get(name, DEFAULT_MODEL[name])))
    return cost


def predict(model: Dict[str, float], topology: Topology, nbytes: int,
            codec: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """{algorithm: predicted seconds} for an all-reduce of ``nbytes`` per rank: every
    algorithm of the C++ table that fits, and with ``codec`` (encode + decode seconds
    per input byte, "topk" and "quantize") the compressed all-reduces ("topk d=0.01",
    "quantize 8-bit", ...)."""
    m = topology.model(model)
    out = dict(_C.allreduce_costs(int(nbytes), cost=_cost_object(m), **topology.shape()))
    if codec:
        out.update(_compressed(m, topology, nbytes, codec))
    return out


# TopKState's defaults: values travel as bfloat16, owners keep 2 x density (pycomm/hooks/topk.py).
TOPK_VALUE_BYTES = 2
TOPK_OWNER_FACTOR = 2.0
SPARSE_HEADER_BYTES = 16  # allreduce_sparse.cc: {format, nnz, payload_bytes}, one per message pair


def _gap_bytes(density: float) -> float:
    """Expected LEB128 length of the gap between consecutive kept positions when
    positions are kept independently with probability ``density`` (geometric gaps of
    mean 1/density): 1 byte, plus 1 for each of 2^7, 2^14, 2^21, 2^28 the gap reaches."""
    return 1.0 + sum((1.0 - density) ** (1 << (7 * k)) for k in (1, 2, 3, 4))


def topk_wire_bytes(nbytes: int, density: float, ranks: int, value_bytes: int = TOPK_VALUE_BYTES,
                    owner_factor: float = TOPK_OWNER_FACTOR, element_bytes: int = 4) -> float:
    """Bytes one rank sends in pycomm's sparse all-reduce (allreduce_sparse.cc) of a
    float32 buffer of ``nbytes`` from which every rank keeps ``density`` of the entries
    at independent random positions. Phase 1: its pairs in each other owner's 1/n of
    the buffer; phase 2: the ``owner_factor x density`` largest of its own 1/n's summed
    pairs (at most their union) to each of the n - 1 others. A pair is its gap's
    varint plus the value; each message is the smaller of that and the dense piece
    (value_bytes per element); a 16-byte header precedes every payload."""
    n = ranks
    if n < 2:
        return 0.0
    piece = nbytes / element_bytes / n  # elements an owner owns
    union = 1.0 - (1.0 - density) ** n
    kept = min(owner_factor * density, union)
    def message(d):
        return min(d * piece * (_gap_bytes(d) + value_bytes), piece * value_bytes) + SPARSE_HEADER_BYTES
    return (n - 1) * (message(density) + message(kept))


def _compressed(m: Dict[str, float], topology: Topology, nbytes: int, codec: Dict[str, float]) -> Dict[str, float]:
    """The compressed all-reduces as pycomm's hooks run them: two phases of direct
    exchanges with the other n - 1 ranks (every rank is an owner; messages in flight
    at once towards one rank cost delta each, as the sharded all-reduce's direct
    exchange: a top-k phase sends a header and a payload to each peer, a quantized
    phase one message), the bytes one rank sends (topk_wire_bytes; b-bit quantization
    sends b/32 of the buffer plus a float32 scale per block, 2 (n-1)/n of that), on a
    link its host's L ranks share, plus the hook's own work per input byte (codec).
    With L > 1 ranks on each of several hosts, also the hosts=... variants: the same
    exchange among the H host leaders, one per link, between the host's sum and its
    broadcast through the arena. The hooks' small parameters (a separate 8-bit
    all-reduce per bucket) are not part of it: they depend on the model's shapes."""
    n = topology.ranks
    if n < 2:
        return {}
    cpu = max(1.0, topology.oversubscription)

    def exchange(ranks: int, on_link: float) -> Dict[str, float]:
        """Every compressed all-reduce over ``ranks`` owners, each rank's bytes sharing its
        link ``on_link``-fold: a byte costs the link or the TCP copies, whichever is slower
        (as the dense formulas); the hook's work is CPU time of its own, scaled by the ranks
        per core."""
        def moved(sent: float) -> float:
            return max(on_link * sent * m["beta"], cpu * sent * m.get("cpu_beta", 0.0))

        costs = {}
        for density in DENSITIES:
            costs[f"topk d={density:g}"] = (2.0 * m["alpha"] + 2.0 * (2 * (ranks - 1) - 1) * m["delta"]
                                            + moved(topk_wire_bytes(nbytes, density, ranks))
                                            + cpu * nbytes * codec["topk"])
        for bits in BITS:
            wire = nbytes * bits / 32.0 + nbytes / 4.0 / QUANT_BLOCK * 4.0
            costs[f"quantize {bits}-bit"] = (2.0 * m["alpha"] + 2.0 * (ranks - 2) * m["delta"]
                                             + moved(2.0 * (ranks - 1) / ranks * wire)
                                             + cpu * (nbytes * codec["quantize"]
                                                      + (ranks - 1) / ranks * wire * m["gamma"]))
        return costs

    # With L ranks per host, every rank sends (n - L)/(n - 1) of its bytes off the host
    # and the L ranks share its link.
    L = topology.ranks_per_host if topology.hosts > 1 else 1
    out = exchange(n, L * (n - L) / (n - 1.0) if topology.hosts > 1 else 1.0)
    if topology.hosts > 1 and L > 1:
        # TopKState / QuantizeState(hosts=...): the host's sum through the arena (pycomm's
        # shm reduce is its all-reduce), the leaders' exchange, the leader's broadcast.
        local = dict(_C.allreduce_costs(int(nbytes), cost=_cost_object(m), world_size=L, one_host=True, hosts=0,
                                        oversubscription=topology.oversubscription,
                                        ingress_limited=topology.ingress_limited))["shm"]
        broadcast = m["shm_alpha"] + nbytes * m["shm_beta"]
        for name, seconds in exchange(topology.hosts, 1.0).items():
            out[f"{name} hosts"] = local + seconds + broadcast
    return out


def winners(costs: Dict[str, float]) -> Tuple[str, str]:
    """(the cheapest dense algorithm, the cheapest of all)."""
    dense = {k: v for k, v in costs.items() if not k.startswith(("topk", "quantize"))}
    return min(dense, key=dense.get), min(costs, key=costs.get)


def break_even_gbps(model: Dict[str, float], topology: Topology, nbytes: int, name: str,
                    codec: Optional[Dict[str, float]] = None) -> Optional[float]:
    """The link speed (Gbit/s) below which the compressed all-reduce ``name`` beats the
    best dense network algorithm at ``nbytes``; None when it never pays (even at 1
    Mbit/s), inf when it always does (even at 10 Tbit/s). Where the TCP copies are
    slower than the link (cpu_beta) both sides stop depending on the link, so the
    crossing is found by bisection in log space rather than by intersecting lines."""
    def gain(gbps):  # > 0 where compression wins
        t = Topology(topology.hosts, topology.ranks_per_host, gbps, topology.latency_s,
                     topology.oversubscription, topology.ingress_limited)
        costs = predict(model, t, nbytes, codec)
        dense = min(v for k, v in costs.items() if k in ("ring", "sharded", "tree"))
        return dense - costs[name]
    lo, hi = 1e-3, 1e4
    if gain(lo) <= 0:
        return None
    if gain(hi) > 0:
        return math.inf
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return hi


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


CALIBRATION_ROUNDS = 3  # sweeps per calibration, each size's median kept


def _median_points(runs: Sequence[Sequence[Tuple[float, float]]]) -> List[Tuple[float, float]]:
    """(bytes, seconds) per size: the median over ``runs`` of the same sweep (sizes
    missing from a run count from the others). One sweep on this VM moved by up to
    1.7x within ten minutes (docs/planner.md, "One run, and how much this VM moves"); the
    median of three keeps one slow or fast sweep out of the fit."""
    by_size: Dict[float, List[float]] = {}
    for run in runs:
        for size, seconds in run:
            by_size.setdefault(size, []).append(seconds)
    return [(size, statistics.median(times)) for size, times in sorted(by_size.items())]


def _sweep(algo: str, transport: str, max_bytes: int, iters: int, sockets: int = 1,
           min_bytes: int = 8) -> List[Tuple[float, float]]:
    """(bytes, seconds) of pycomm's 2-rank all-reduce with ``algo`` over ``transport``
    (``sockets`` TCP streams per peer, one I/O thread each)."""
    from ..bench import BenchConfig, run_benchmark

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
    """gamma (the reduction kernel, one thread) and the compressed hooks' kernels per
    byte: top-k, the fused selection with error feedback (kernels.topk_ef_segments), a
    zeroed output and the average written back; quantization, quantize, dequantize and
    the average. A floor under what a hook's call costs (_hook_costs measures that),
    taken only where no calibration is cached."""
    import torch

    k = _C.kernels
    n = nbytes // 4
    a, b = torch.randn(n), torch.randn(n)
    gamma = _seconds_per_byte(lambda: k.reduce(a, b, "sum", out=a), nbytes)
    residual = torch.zeros(n)
    exact = n < (1 << 23)  # as the hook picks (hooks.topk._APPROX_MIN_NUMEL)
    topk = _seconds_per_byte(lambda: k.topk_ef_segments(a, residual, [0], [n], 0.01, [exact], [1], 0), nbytes)
    average = _seconds_per_byte(lambda: torch.div(residual, 2.0, out=b), nbytes)  # hooks._common._averaged_into
    topk += _seconds_per_byte(lambda: torch.zeros(n), nbytes) + average
    packed = k.quantize(a, 8, QUANT_BLOCK)
    quant = _seconds_per_byte(lambda: k.quantize(a, 8, QUANT_BLOCK), nbytes)
    quant += _seconds_per_byte(lambda: k.dequantize(packed, n, 8, QUANT_BLOCK), nbytes) + average
    return gamma, {"topk": topk, "quantize": quant}


HOOK_COLUMNS = {"topk1%": "topk", "quant8": "quantize"}


def _hook_costs(rows: Sequence[dict]) -> Dict[str, float]:
    """Seconds per byte of a compressed hook's whole call on one bucket: the slope of
    pycomm-bench's topk1% and quant8 columns over 1-64 MiB (``rows``: 2 ranks over TCP,
    where the CPU, not a link, is the limit). It holds the encode with error feedback,
    the compressed all-reduce's own CPU work (the owners' sums and selections, the
    zeroed output), the average written back and the TCP copies of the few compressed
    bytes. The codec kernels alone (_kernel_costs) are a fraction of it: on this VM
    about a fifth for top-k."""
    costs = {}
    for column, key in HOOK_COLUMNS.items():
        points = [(float(row["size_bytes"]), row["time_us"] * 1e-6) for row in rows
                  if row["name"] == column and row["time_us"]]
        costs[key] = max(_fit_regimes(points)[1], 1e-12)
    return costs


def _hook_rows(iters: int = 3) -> List[dict]:
    """pycomm-bench's compressed columns, 2 ranks over TCP loopback, 1-64 MiB."""
    from ..bench import BenchConfig, run_benchmark

    with _env("PYCOMM_TRANSPORT", "tcp"):
        cfg = BenchConfig(nprocs=2, min_bytes=1 << 20, max_bytes=64 << 20, step_factor=4, iters=iters, warmup=1,
                          algos=tuple(HOOK_COLUMNS), peer=None, check=False, quiet=True, tcp_reference=False)
        return run_benchmark(cfg).rows


def _tree_from(max_bytes: int) -> int:
    """The smallest size of the calibration's tree sweep: from LARGE_MIN, or the top three
    sizes (a factor of 4 apart) when the sweep ends below it."""
    return min(LARGE_MIN, max(max_bytes // 16, 1))


def _one_way(tree: Sequence[Tuple[float, float]], gamma: float) -> float:
    """cpu_beta_oneway from the 2-rank tree's large sizes: its slope is 2 w + gamma (S up,
    reduced at rank 0, then S down, one way at a time). Measured rather than taken as half
    of cpu_beta (the two-way exchange's); on this project's VM it came out 1.06-1.14x that
    (docs/planner.md). A fit that leaves nothing for the transfers (slope <= gamma: noisy
    or too few points) gives 0, "not measured", which the model reads as cpu_beta / 2: a
    tiny w would make the tree look free to ``auto``."""
    large = [(s, t) for s, t in tree if s >= LARGE_MIN]
    points = large if len(large) >= 2 else list(tree)
    if len(points) < 2:
        return 0.0
    slope = _fit_line(points)[1]
    return (slope - gamma) / 2.0 if slope > gamma else 0.0


def calibrate(max_bytes: int = 16 << 20, iters: int = 10, verbose: bool = True,
              rounds: int = CALIBRATION_ROUNDS) -> dict:
    """Measure this host's constants (2 ranks); returns the calibration (model, codec,
    the measured points: each size's median over ``rounds`` sweeps). Over TCP loopback
    no link limits a byte, the CPU does: beta is 0 and the ring's time per byte is
    cpu_beta (plus gamma/2); the tree's (from max_bytes / 16) is 2 cpu_beta_oneway + gamma."""
    gamma, _ = _kernel_costs()
    codec = _hook_costs(_hook_rows())
    # 2-rank ring (allreduce_registry.cc), beta 0: 2 alpha + S cpu_beta + S/2 gamma.
    tcp = _median_points([_sweep("ring", "tcp", max_bytes, iters) for _ in range(rounds)])
    a, b = _fit_regimes(tcp)
    # 2-rank tree (one way up, then one way down): 2 alpha + S (2 cpu_beta_oneway + gamma).
    tree = _median_points([_sweep("tree", "tcp", max_bytes, iters, min_bytes=_tree_from(max_bytes))
                           for _ in range(rounds)])
    # 2-rank shm: 2 shm_alpha + S shm_beta + S/2 gamma.
    shm = _median_points([_sweep("shm", "auto", max_bytes, iters) for _ in range(rounds)])
    sa, sb = _fit_regimes(shm)
    model = {"alpha": max(a / 2.0, 1e-7), "beta": 0.0, "gamma": gamma, "delta": DEFAULT_MODEL["delta"],
             "shm_alpha": max(sa / 2.0, 1e-8), "shm_beta": max(sb - gamma / 2.0, 1e-13),
             "cpu_beta": max(b - gamma / 2.0, 1e-12), "cpu_beta_oneway": _one_way(tree, gamma),
             "link_burst": 0.0}  # loopback: no token bucket
    # One TCP stream (one socket per peer, one I/O thread): cpu_beta is its time per byte
    # over loopback, so 8 / cpu_beta bit/s is what one stream moves here (pycomm.streams).
    # The ring at the largest size with 2 and 4 streams shows what more streams do on this host.
    streams = {"per_stream_gbps": 8.0 / model["cpu_beta"] / 1e9, "ring_seconds": {"1": tcp[-1][1]}}
    for count in (2, 4):
        streams["ring_seconds"][str(count)] = _sweep("ring", "tcp", max_bytes, iters, count, max_bytes)[-1][1]
    calibration = {"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "model": model, "codec": codec, "points": {"ring_tcp": tcp, "tree_tcp": tree, "shm": shm},
                   "streams": streams,
                   "note": "beta 0: TCP loopback has no link limit, cpu_beta is its cost per byte; "
                           "delta is the built-in default (not measured: it needs 3+ ranks); codec: seconds "
                           "per byte of a compressed hook's call on one bucket, 2 ranks over TCP, 1-64 MiB"}
    if verbose:
        print(f"# calibrated on {calibration['host']}: " + ", ".join(f"{k} {_fmt_const(k, v)}"
                                                                   for k, v in model.items()))
        print("# compressed hooks' own work per byte of a bucket: "
              + ", ".join(f"{k} {v * 1e9:.3f} ns" for k, v in codec.items()))
        print(f"# one TCP stream: {streams['per_stream_gbps']:.2f} Gbit/s; ring of {_size(max_bytes)}, 2 ranks: "
              + ", ".join(f"{n} stream(s) {t * 1e3:.2f} ms" for n, t in streams["ring_seconds"].items()))
    return calibration


def _fmt_const(name: str, value: float) -> str:
    if name == "cpu_beta_oneway" and value <= 0:
        return "cpu_beta / 2 (not measured)"
    if name == "link_burst":
        return f"{value / 1024:.0f} KiB" if value > 0 else "0 (none)"
    if "beta" in name or name == "gamma":
        return f"{1.0 / value / 1e9:.2f} GB/s" if value > 0 else "0 (free)"
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
        auto = _C._select_algorithm(nbytes, cost=_cost_object(topology.model(model)), **topology.shape())
        lines.append(f"{_size(nbytes):>9} " + " ".join(f"{costs[n] * 1e6:>15.1f}" for n in names)
                     + f" {auto:>12} {winners(costs)[1]:>16}")
    return lines


def compression_table(model, codec, topology: Topology, nbytes: int = 64 << 20) -> List[str]:
    """The break-even link speed of each compressed all-reduce, twice: with the link
    alone carrying a byte (cpu_beta 0, as the extrapolation) and with this host's TCP
    copies too (where they are slower than any link, a dense all-reduce cannot go
    faster than them and compression always pays)."""
    copies = model.get("cpu_beta", 0.0)
    lines = [f"# {topology}, {_size(nbytes)}: link speed below which each compressed all-reduce "
             "beats the best dense network algorithm: the link alone carrying a byte (cpu_beta 0)"
             + (f"; and with this host's TCP copies ({_fmt_const('cpu_beta', copies)})" if copies else "")]

    def text(gbps):
        return "never" if gbps is None else "always" if math.isinf(gbps) else f"{gbps:.1f} Gbit/s"

    for name in [k for k in predict(model, topology, nbytes, codec) if k.startswith(("topk", "quantize"))]:
        line = f"{name:>16}: {text(break_even_gbps(_network_only(model), topology, nbytes, name, codec))}"
        if copies:
            line += f"; {text(break_even_gbps(model, topology, nbytes, name, codec))}"
        lines.append(line)
    return lines


EXTRAPOLATE = [(64, 8), (512, 8), (4096, 8)]
LINKS = [(100.0, 5e-6), (10.0, 20e-6)]  # Gbit/s, one-way latency between hosts


def _network_only(model: Dict[str, float]) -> Dict[str, float]:
    """The extrapolation's model: this host's per-message overhead, reduction and
    shared-memory constants, but no TCP copy cost per byte (cpu_beta and cpu_beta_oneway
    0): one TCP stream on this small VM moves about 1 GB/s, which says nothing of a
    100 Gbit/s host."""
    return dict(model, cpu_beta=0.0, cpu_beta_oneway=0.0)


def _crossing(model, topology: Topology, fast: str, slow: str, sizes: Sequence[int]) -> Optional[int]:
    """The largest size at which ``fast`` is still predicted cheaper than ``slow``."""
    below = [n for n in sizes if (lambda c: c[fast] < c[slow])(predict(model, topology, n))]
    return max(below) if below else None


def extrapolation(model, codec) -> List[str]:
    model = _network_only(model)
    sizes = [1 << e for e in range(8, 31)]
    lines = ["# extrapolation: 8 ranks per host, cpu_beta 0 (the link, not this VM's TCP copies, carries a "
             "byte); network algorithms among the host leaders (what hierarchical runs between hosts), "
             "and flat over every rank"]
    for gbps, latency in LINKS:
        for ranks, per_host in EXTRAPOLATE:
            hosts = ranks // per_host
            leaders = Topology(hosts, 1, gbps, latency)
            flat = Topology(hosts, per_host, gbps, latency)
            crossings = []
            previous = None
            for nbytes in sizes:
                costs = {k: v for k, v in predict(model, leaders, nbytes).items() if k in DENSE}
                best = min(costs, key=costs.get)
                if best != previous:
                    crossings.append(f"{best} from {_size(nbytes)}")
                    previous = best
            tree_flat = _crossing(model, flat, "tree", "ring", sizes)
            small, big = predict(model, flat, 64 << 10), predict(model, flat, 64 << 20, codec)
            lines.append(f"{ranks:>5} ranks ({hosts} hosts), {gbps:g} Gbit/s, {latency * 1e6:g} us: leaders: "
                         + ", ".join(crossings)
                         + "; flat: tree beats ring up to "
                         + (_size(tree_flat) if tree_flat else "never")
                         + f"; 64 KiB ring {small['ring'] * 1e3:.2f} ms, tree {small['tree'] * 1e3:.2f} ms, "
                         f"hierarchical {small['hierarchical'] * 1e3:.2f} ms; 64 MiB ring {big['ring'] * 1e3:.1f} ms, "
                         f"hierarchical {big['hierarchical'] * 1e3:.1f} ms"
                         + (f"; compressed, flat (a direct exchange with every rank): topk d=0.01 "
                            f"{big['topk d=0.01'] * 1e3:.1f} ms, quantize 8-bit {big['quantize 8-bit'] * 1e3:.1f} ms; "
                            f"among the host leaders (hosts='auto'): topk d=0.01 "
                            f"{big['topk d=0.01 hosts'] * 1e3:.1f} ms, quantize 8-bit "
                            f"{big['quantize 8-bit hosts'] * 1e3:.1f} ms"
                            if codec else ""))
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
            costs = [predict(_network_only(model), topology, s, codec) for s in sizes]
            for name in ("ring", "sharded", "tree", "hierarchical", "topk d=0.01", "quantize 8-bit",
                         "topk d=0.01 hosts", "quantize 8-bit hosts"):
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
    fig.suptitle("pycomm cost model: predicted all-reduce time (8 ranks per host, flat over every rank "
                 "except hierarchical and the hosts variants; cpu_beta 0)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# validation: predicted against measured, on this host and across namespaces
# ---------------------------------------------------------------------------

DENSE = ("ring", "sharded", "tree")
VALIDATE_HOSTS = (2, 4, 8)
VALIDATE_RATES = (None, "1gbit")
# tc tbf counts every byte of a frame: a full TCP segment carries 1448 payload bytes
# (MTU 1500 less 20 of IP, 20 of TCP and 12 of timestamps) in a frame of 1514 (plus the
# Ethernet header's 14), so the payload moves at 1448/1514 of the rate.
TBF_PAYLOAD = 1448.0 / 1514.0


@contextlib.contextmanager
def _env(name: str, value: Optional[str]):
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def oversubscription(ranks: int, cores: Optional[int] = None) -> float:
    """Ranks per core when ``ranks`` share this machine's cores (at least 1)."""
    return max(1.0, ranks / float(cores or os.cpu_count() or 1))


def validate(model, codec, ranks: Sequence[int] = (2, 4), max_bytes: int = 64 << 20,
             iters: int = 10) -> Tuple[List[str], Dict[int, float]]:
    """On this host: ring / sharded / tree over TCP and shm, from 1 MiB, against the
    prediction with the ranks per core of this machine. Returns (table lines, {ranks:
    worst relative error})."""
    from ..bench import BenchConfig, run_benchmark

    lines = [f"{'ranks':>5} {'algorithm':>9} {'size':>9} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"]
    worst: Dict[int, float] = {}
    for n in ranks:
        for transport, algos in (("tcp", DENSE), ("auto", ("shm",))):
            with _env("PYCOMM_TRANSPORT", transport):
                cfg = BenchConfig(nprocs=n, min_bytes=1 << 20, max_bytes=max_bytes, step_factor=4, iters=iters,
                                  warmup=2, algos=algos, peer=None, check=False, quiet=True, tcp_reference=False)
                rows = run_benchmark(cfg).rows
            # Over TCP every rank is a host of its own to the model.
            topology = Topology(1 if transport != "tcp" else n, n if transport != "tcp" else 1,
                                oversubscription=oversubscription(n))
            for row in rows:
                if not row["time_us"]:
                    continue
                costs = predict(model, topology, row["size_bytes"])
                predicted, measured = costs[row["algo"]], row["time_us"] * 1e-6
                if math.isinf(predicted):  # never chosen by auto here (sharded on 2 ranks)
                    continue
                error = (predicted - measured) / measured
                worst[n] = max(worst.get(n, 0.0), abs(error))
                lines.append(f"{n:>5} {row['algo']:>9} {_size(row['size_bytes']):>9} {predicted * 1e3:>13.2f} "
                             f"{measured * 1e3:>12.2f} {100 * error:>+6.0f}%")
    return lines, worst


def _host_rows(hosts: int, rate: Optional[str], algos: Sequence[str], min_bytes: int, max_bytes: int,
               iters: int, warmup: int, cost_path: Optional[str] = None) -> List[dict]:
    """pycomm-bench --hosts ``hosts`` (one rank each, tbf ``rate`` on each host's egress):
    the rows with a time. ``cost_path``: the ranks' PYCOMM_COST_MODEL (what auto uses)."""
    from ..bench import BenchConfig, run_benchmark

    cfg = BenchConfig(nprocs=hosts, hosts=hosts, ranks_per_host=1, rate=rate, min_bytes=min_bytes,
                      max_bytes=max_bytes, step_factor=4, iters=iters, warmup=warmup, algos=tuple(algos),
                      peer=None, check=False, quiet=True, tcp_reference=False, timeout_s=120.0)
    with _env("PYCOMM_COST_MODEL", cost_path):
        return [row for row in run_benchmark(cfg).rows if row["time_us"]]


def calibrate_netns(max_bytes: int = 16 << 20, iters: int = 10, verbose: bool = True,
                    hook_max_bytes: int = 64 << 20, rounds: int = CALIBRATION_ROUNDS) -> dict:
    """The namespace path's constants (veth + bridge, no rate): pycomm's 2-host ring
    from 8 B and tree (each size's median over ``rounds`` sweeps), fitted as calibrate()
    fits loopback (beta 0, the CPU is the limit); the
    shared-memory constants and delta from this host's calibration (or the built-in);
    the compressed hooks' own work per byte over the same path (2 hosts, 1 MiB to
    ``hook_max_bytes``)."""
    gamma, _ = _kernel_costs()
    codec = _hook_costs(_host_rows(2, None, tuple(HOOK_COLUMNS), 1 << 20, max(hook_max_bytes, 4 << 20), 3, 1))
    runs = [_host_rows(2, None, ("ring", "tree"), 8, max_bytes, iters, 3) for _ in range(rounds)]

    def sweeps(algo, min_bytes=0):
        return _median_points([[(float(row["size_bytes"]), row["time_us"] * 1e-6) for row in rows
                                if row["algo"] == algo and row["size_bytes"] >= min_bytes] for rows in runs])

    points, tree = sweeps("ring"), sweeps("tree", _tree_from(max_bytes))
    a, b = _fit_regimes(points)
    path = cost_cache_path()
    base = read_cost_model(path) if os.path.exists(path) else dict(DEFAULT_MODEL)
    model = dict(base, alpha=max(a / 2.0, 1e-7), beta=0.0, gamma=gamma, cpu_beta=max(b - gamma / 2.0, 1e-12),
                 cpu_beta_oneway=_one_way(tree, gamma), link_burst=0.0)  # no rate: no bucket
    calibration = {"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "path": "network namespaces: veth + bridge, 2 hosts x 1 rank, no rate", "model": model,
                   "codec": codec, "points": {"ring_netns": points, "tree_netns": tree},
                   "note": "beta 0 (no rate: the CPU is the limit); with a tbf rate, link_model sets beta"}
    if verbose:
        print("# calibrated the namespace path: " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()))
    return calibration


def link_model(model: Dict[str, float], rate: Optional[str]) -> Dict[str, float]:
    """``model`` with a tbf ``rate`` as its link: beta = 1 / (rate x TBF_PAYLOAD), and the
    bucket's burst (pycomm/netns.py), which a phase that starts on an idle link sends
    at once (link_burst; the tree's phases do)."""
    from ..netns import TBF_BURST_BYTES

    m = dict(model)
    if rate:
        m["beta"] = 8.0 / (_rate(rate) * 1e9 * TBF_PAYLOAD)
        m["link_burst"] = float(TBF_BURST_BYTES)
    return m


def _compressed_name(column: str) -> Optional[str]:
    """The prediction's name of a pycomm-bench compressed column ("topk1%" -> "topk d=0.01",
    "quant8" -> "quantize 8-bit"), or None."""
    from ..bench.runners import compressed_spec

    spec = compressed_spec(column)
    if spec is None:
        return None
    kind, value = spec
    return f"topk d={value:g}" if kind == "topk" else f"quantize {int(value)}-bit"


def validate_hosts(model: Dict[str, float], hosts: Sequence[int] = VALIDATE_HOSTS,
                   rates: Sequence[Optional[str]] = VALIDATE_RATES, min_bytes: int = 1 << 20,
                   max_bytes: int = 64 << 20, iters: int = 5, warmup: int = 2,
                   workdir: Optional[str] = None, progress=None, codec: Optional[Dict[str, float]] = None,
                   compressed: Sequence[str] = ()) -> List[dict]:
    """Across network namespaces (one rank per host, with and without tbf): every dense
    algorithm and auto, measured at sizes from ``min_bytes`` by 4x, against the
    prediction (the namespace model, the rate as the link, only egress limited, the
    hosts' ranks per core of this machine). The ranks' auto reads the same model with
    the rate (PYCOMM_COST_MODEL). One record per (hosts, rate, size, algorithm), and
    one per (hosts, rate, size) for auto. ``compressed``: pycomm-bench's compressed
    columns too ("topk1%", "quant8": a DDP hook's exchange of one bucket), against the
    prediction with ``codec``."""
    import tempfile

    records: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="pycomm-plan-") as tmp:
        for rate in rates:
            m = link_model(model, rate)
            path = save_calibration({"model": m, "path": f"netns, rate {rate or 'none'}"},
                                    os.path.join(workdir or tmp, f"netns-{rate or 'unlimited'}.json"))
            for h in hosts:
                if progress:
                    progress(f"# measuring {h} hosts, rate {rate or 'none'}")
                # sharded does not run on 2 ranks under auto (the ring without its pipeline)
                algos = [a for a in DENSE if h > 2 or a != "sharded"] + ["auto"] + list(compressed)
                rows = _host_rows(h, rate, algos, min_bytes, max_bytes, iters, warmup, path)
                over = oversubscription(h)
                by_size: Dict[int, Dict[str, dict]] = {}
                for row in rows:
                    by_size.setdefault(int(row["size_bytes"]), {})[row["algo"]] = row
                for size, got in sorted(by_size.items()):
                    costs = dict(_C.allreduce_costs(size, h, False, h, _cost_object(m), oversubscription=over,
                                                    ingress_limited=False))
                    measured = {a: got[a]["time_us"] * 1e-6 for a in DENSE
                                if a in got and not math.isinf(costs.get(a, math.inf))}
                    for algo, seconds in measured.items():
                        records.append({"hosts": h, "rate": rate, "size": size, "algo": algo,
                                        "oversubscription": over, "predicted": costs[algo], "measured": seconds,
                                        "error": (costs[algo] - seconds) / seconds})
                    if codec:
                        shape = Topology(h, 1, oversubscription=over, ingress_limited=False)
                        predicted = _compressed(m, shape, size, codec)
                        for column in compressed:
                            name = _compressed_name(column)
                            if column in got and name in predicted:
                                seconds = got[column]["time_us"] * 1e-6
                                records.append({"hosts": h, "rate": rate, "size": size, "algo": column,
                                                "compressed": True, "oversubscription": over,
                                                "predicted": predicted[name], "measured": seconds,
                                                "error": (predicted[name] - seconds) / seconds})
                    if "auto" in got and measured:
                        pick = got["auto"]["selected"] or ""
                        fastest = min(measured, key=measured.get)
                        records.append({"hosts": h, "rate": rate, "size": size, "algo": "auto", "picked": pick,
                                        "predicted_best": min((a for a in DENSE if a in costs), key=costs.get),
                                        "fastest": fastest, "auto_measured": got["auto"]["time_us"] * 1e-6,
                                        "slowdown": measured.get(pick, math.nan) / measured[fastest] - 1.0})
    return records


def validation_table(records: List[dict], goal: float = 0.25, auto_slack: float = 0.10) -> List[str]:
    """The records as a table: predicted against measured with the error, then auto's
    pick against the measured fastest, then the verdicts."""
    lines = [f"{'hosts':>5} {'rate':>7} {'ranks/core':>10} {'algorithm':>9} {'size':>8} {'predicted ms':>13} "
             f"{'measured ms':>12} {'error':>7}"]
    dense = [r for r in records if r["algo"] != "auto"]
    for r in dense:
        lines.append(f"{r['hosts']:>5} {r['rate'] or 'none':>7} {r['oversubscription']:>10g} {r['algo']:>9} "
                     f"{_size(r['size']):>8} {r['predicted'] * 1e3:>13.2f} {r['measured'] * 1e3:>12.2f} "
                     f"{100 * r['error']:>+6.0f}%")
    autos = [r for r in records if r["algo"] == "auto"]
    if autos:
        lines.append("")
        lines.append(f"{'hosts':>5} {'rate':>7} {'size':>8} {'auto took':>9} {'model best':>10} "
                     f"{'fastest':>9} {'auto vs fastest':>15}")
        for r in autos:
            lines.append(f"{r['hosts']:>5} {r['rate'] or 'none':>7} {_size(r['size']):>8} {r['picked']:>9} "
                         f"{r['predicted_best']:>10} {r['fastest']:>9} {100 * r['slowdown']:>+14.0f}%")
    lines.append("")
    groups: Dict[Tuple[int, Optional[str], bool], List[dict]] = {}
    for r in dense:
        groups.setdefault((r["hosts"], r["rate"], r.get("compressed", False)), []).append(r)
    for (h, rate, lossy), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1] or "", kv[0][0])):
        within = sum(abs(r["error"]) <= goal for r in rs)
        worst = max(rs, key=lambda r: abs(r["error"]))
        lines.append(f"# {'compressed: ' if lossy else ''}{h} hosts, rate {rate or 'none'} "
                     f"({rs[0]['oversubscription']:g} ranks per core): "
                     f"{within}/{len(rs)} within {100 * goal:.0f}%, worst {100 * worst['error']:+.0f}% "
                     f"({worst['algo']}, {_size(worst['size'])})")
    if autos:
        good = sum(r["slowdown"] <= auto_slack for r in autos)
        lines.append(f"# auto took the measured fastest or one within {100 * auto_slack:.0f}% of it at "
                     f"{good}/{len(autos)} (hosts, rate, size) points")
    return lines


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


def netns_cache_path() -> str:
    """This host's calibration of the namespace path (next to cost_cache_path())."""
    return cost_cache_path()[: -len(".json")] + "-netns.json"


def _validate_command(args) -> None:
    from ..bench.hosts import hosts_unavailable_reason

    hosts = [int(h) for h in args.validate_hosts.split(",") if h.strip()]
    rates = [None if r.strip().lower() == "none" else r.strip() for r in args.rates.split(",") if r.strip()]
    reason = hosts_unavailable_reason(next((r for r in rates if r), None))
    if reason:
        raise RuntimeError(f"{PREFIX} --validate runs across network namespaces: {reason}")
    header = [f"# python -m pycomm.plan {' '.join(sys.argv[1:]) if args.argv is None else ' '.join(args.argv)}",
              f"# {datetime.datetime.now().isoformat(timespec='seconds')} on {socket.gethostname()}, "
              f"{os.cpu_count()} CPUs; uptime before: {_uptime()}"]
    compressed = [c.strip() for c in args.compressed.split(",") if c.strip()]
    for column in compressed:
        if _compressed_name(column) not in ("topk d=0.01", "topk d=0.001", "quantize 8-bit", "quantize 4-bit"):
            raise ValueError(f"{PREFIX} --compressed {column!r}: the model has topk1%, topk0.1%, quant8, quant4")
    print("\n".join(header), flush=True)
    calibration = calibrate_netns(max_bytes=min(args.max_bytes or 16 << 20, 16 << 20), iters=2 * args.iters,
                                  hook_max_bytes=args.max_bytes or 64 << 20)
    print(f"# cached: {save_calibration(calibration, netns_cache_path())}", flush=True)
    model = calibration["model"]
    records = validate_hosts(model, hosts, rates, max_bytes=args.max_bytes or 64 << 20, iters=args.iters,
                             codec=calibration["codec"], compressed=compressed,
                             progress=lambda text: print(text, flush=True))
    lines = header + [
        "# model (namespace path): " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()),
        f"# with a rate: beta = 1 / (rate x {TBF_PAYLOAD:.3f}), the TCP payload of a 1514-byte frame; only "
        "egress limited (tbf on each host's interface); ranks/core = hosts / this machine's CPUs",
        *([f"# codecs (the hooks' work per byte besides the collective): "
           + ", ".join(f"{k} {v * 1e9:.3f} ns" for k, v in calibration["codec"].items())] if compressed else []),
        f"# uptime after: {_uptime()}"] + validation_table(records)
    print("\n".join(lines[len(header):]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
        print(f"# table: {args.out}")


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as handle:
            return "load average " + ", ".join(handle.read().split()[:3])
    except OSError:
        return "unknown"


def stream_lines(per_stream: Optional[float], link: Optional[float], where: str) -> List[str]:
    """The TCP stream model (pycomm.streams): what 1, 2, 4, 8 and 16 streams move over
    ``link`` Gbit/s when one moves ``per_stream``, and what auto picks."""
    from ..streams import choose_streams, stream_gbps

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
    parser.add_argument("--validate", action="store_true",
                        help="predicted against measured across network namespaces (root): calibrate the "
                             "namespace path, then --validate-hosts x --rates, one rank per host")
    parser.add_argument("--compressed", default="",
                        help="with --validate: also pycomm-bench's compressed columns, e.g. topk1%%,quant8 "
                             "(a DDP hook's exchange of one bucket, against the model with the calibrated codecs)")
    parser.add_argument("--validate-hosts", default=",".join(map(str, VALIDATE_HOSTS)),
                        help="host counts for --validate (default 2,4,8)")
    parser.add_argument("--rates", default=",".join(r or "none" for r in VALIDATE_RATES),
                        help="tc tbf rates for --validate, 'none' for no limit (default none,1gbit)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size for --validate")
    parser.add_argument("--out", help="also write the --validate table to this file")
    parser.add_argument("--validate-local", action="store_true",
                        help="predicted against measured on this host (2 and 4 ranks, TCP loopback and shm)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="largest size measured (default: 16 MiB for --calibrate, 64 MiB for the validations)")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    try:
        if args.calibrate:
            calibration = calibrate(max_bytes=args.max_bytes or 16 << 20)
            print(f"# cached: {save_calibration(calibration, args.model)}")
        model, codec, source = load_calibration(args.model)
        print(f"# model from {source}: " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()))
        from ..config import _per_stream, bind_address, load_config
        from ..streams import link_gbps
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
        if args.validate_local:
            lines, worst = validate(model, codec, max_bytes=max(args.max_bytes or 64 << 20, 1 << 20))
            print("\n".join(lines))
            for n, error in sorted(worst.items()):
                print(f"# {n} ranks on this host's {os.cpu_count()} CPUs: worst error from 1 MiB up "
                      f"{100 * error:.0f}% (goal: within 25%)")
        if args.validate:
            _validate_command(args)
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
        print(message if message.startswith(("pycomm", PREFIX)) else f"{PREFIX} {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
