"""--calibrate: the constants fitted to pycomm's own benchmark on this host (2 ranks), cached."""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _C
from ..config import cost_cache_path, read_cost_model
from .model import DEFAULT_MODEL, QUANT_BLOCK, _fmt_const, _size


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
    missing from a run count from the others). One sweep on a shared host can move a
    lot from the next (benchmarks/results/planner_runs.md); the median of three keeps
    one slow or fast sweep out of the fit."""
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

    settings = {"PYCOMM_TRANSPORT": transport, "PYCOMM_SOCKETS_PER_PEER": str(sockets),
                "PYCOMM_IO_THREADS": str(sockets)}
    cfg = BenchConfig(nprocs=2, min_bytes=min_bytes, max_bytes=max_bytes, step_factor=4, iters=iters,
                      warmup=3, algos=(algo,), peer=None, check=False, quiet=True, tcp_reference=False,
                      settings=settings)
    result = run_benchmark(cfg)
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
    bytes. The codec kernels alone (_kernel_costs) are a fraction of it (docs/planner.md)."""
    costs = {}
    for column, key in HOOK_COLUMNS.items():
        points = [(float(row["size_bytes"]), row["time_us"] * 1e-6) for row in rows
                  if row["name"] == column and row["time_us"]]
        costs[key] = max(_fit_regimes(points)[1], 1e-12)
    return costs


def _hook_rows(iters: int = 3) -> List[dict]:
    """pycomm-bench's compressed columns, 2 ranks over TCP loopback, 1-64 MiB."""
    from ..bench import BenchConfig, run_benchmark

    cfg = BenchConfig(nprocs=2, min_bytes=1 << 20, max_bytes=64 << 20, step_factor=4, iters=iters, warmup=1,
                      algos=tuple(HOOK_COLUMNS), peer=None, check=False, quiet=True, tcp_reference=False,
                      settings={"PYCOMM_TRANSPORT": "tcp"})
    return run_benchmark(cfg).rows


def _tree_from(max_bytes: int) -> int:
    """The smallest size of the calibration's tree sweep: from LARGE_MIN, or the top three
    sizes (a factor of 4 apart) when the sweep ends below it."""
    return min(LARGE_MIN, max(max_bytes // 16, 1))


def _one_way(tree: Sequence[Tuple[float, float]], gamma: float) -> float:
    """cpu_beta_oneway from the 2-rank tree's large sizes: its slope is 2 w + gamma (S up,
    reduced at rank 0, then S down, one way at a time). Measured rather than taken as half
    of cpu_beta (the two-way exchange's): the two need not agree (docs/planner.md). A fit that leaves nothing for the transfers (slope <= gamma: noisy
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
