"""nccl-tests-style all-reduce microbenchmark: ``python -m pycomm.bench``.

For every message size of a geometric sweep, each pycomm all-reduce algorithm
(chosen with ``pycomm.set_algorithm``) and a peer backend (gloo by default)
run on the same buffer in the same processes. Figures follow nccl-tests:

* time  = median over the timed iterations on each rank, then the maximum of
  those medians over ranks (the slowest rank is the figure);
* algbw = S / time, with S the bytes of one rank's buffer;
* busbw = algbw * 2(n-1)/n for all-reduce.

Correctness is checked in the same run: before timing, each algorithm reduces
a rank- and position-dependent pattern whose result is known in closed form
(sum of ``(rank + 1) * w[i]`` is ``n(n+1)/2 * w[i]``). The timed loop then
runs on a buffer filled with a value that the reduction keeps stable (0 for
sum, 1 for product), so no re-fill is needed between timed iterations.

Workers are spawned on this host (``-n``), or, when ``RANK`` and
``WORLD_SIZE`` are set (``torchrun``), the current processes are the ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from pycomm.launch import launch_workers, torchrun_env

__all__ = [
    "BenchConfig",
    "BenchResult",
    "DTYPES",
    "OPS",
    "alg_bandwidth",
    "bus_bandwidth",
    "format_size",
    "join_mpi",
    "launch_workers",
    "main",
    "memcpy_bandwidth",
    "mpi_unavailable_reason",
    "parse_args",
    "parse_size",
    "run_benchmark",
    "size_sweep",
    "write_plot",
]

_PREFIX = "pycomm bench:"

#: Accepted ``--dtype`` names (torch names and the nccl-tests short names).
DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
    "long": torch.int64,
}

#: Accepted ``--op`` names.
OPS: Dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
}

# Largest integer every value up to which the dtype represents exactly.
_EXACT_LIMIT = {
    torch.float16: 2 ** 11,
    torch.bfloat16: 2 ** 8,
    torch.float32: 2 ** 24,
    torch.float64: 2 ** 53,
    torch.int8: 2 ** 7 - 1,
    torch.uint8: 2 ** 8 - 1,
    torch.int16: 2 ** 15 - 1,
    torch.int32: 2 ** 31 - 1,
    torch.int64: 2 ** 63 - 1,
}

# Relative tolerance of the correctness check for floating dtypes. The
# patterns reduce to exactly representable integers, so only "avg" (which an
# implementation may compute as a sum of pre-divided terms) can round.
_RTOL = {
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
    torch.float32: 2e-6,
    torch.float64: 1e-12,
}

# Pattern period cap: a prime, so pattern boundaries do not line up with the
# power-of-two chunk boundaries of the algorithms (a misplaced chunk shows).
_MAX_PERIOD = 251

# Sizes at or above this get proportionally fewer iterations.
_LARGE_BYTES = 16 * 2 ** 20
# Small messages are timed in blocks of back-to-back calls. Every sample follows one
# untimed call of the same run when several runs alternate: it realigns the ranks
# (the previous column's call may finish at different times on different ranks, and
# that skew would otherwise land in this column's time; after a gloo call of some
# milliseconds it tripled the 8 MiB shm time in some runs).
_BLOCK_SMALL_BYTES, _BLOCK_SMALL = 64 * 2 ** 10, 16
_BLOCK_MEDIUM_BYTES, _BLOCK_MEDIUM = 2 ** 20, 4
_MIN_LARGE_ITERS = 3

_MEMCPY_BYTES = 64 * 2 ** 20
_MEMCPY_REPEATS = 10

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


# ---------------------------------------------------------------------------
# Pure helpers (unit-tested)
# ---------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Parse a byte count such as ``8``, ``64K``, ``1.5M``, ``2GiB`` (binary units)."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"{_PREFIX} cannot parse size {text!r} (expected e.g. 8, 64K, 16M, 1G)")
    number, unit = match.groups()
    value = float(number) * _SIZE_UNITS[unit.lower()]
    if value != int(value):
        raise ValueError(f"{_PREFIX} size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    """Human-readable binary size: ``8 B``, ``64 KiB``, ``1.5 MiB``."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def size_sweep(min_bytes: int, max_bytes: int, step_factor: int) -> List[int]:
    """Sizes ``min_bytes * step_factor**k`` up to ``max_bytes`` (nccl-tests' ``-f``), plus
    ``max_bytes`` itself when the geometric steps skip it, so ``-e 64M`` always shows 64M."""
    if min_bytes < 0 or max_bytes < 0:
        raise ValueError(f"{_PREFIX} sizes must be non-negative")
    if min_bytes > max_bytes:
        raise ValueError(f"{_PREFIX} --minbytes ({min_bytes}) is larger than --maxbytes ({max_bytes})")
    if min_bytes == max_bytes:
        return [min_bytes]
    if step_factor < 2:
        raise ValueError(f"{_PREFIX} --stepfactor must be at least 2 (got {step_factor})")
    if min_bytes == 0:
        raise ValueError(f"{_PREFIX} --minbytes must be positive for a geometric sweep")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def alg_bandwidth(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): ``S / t`` with S one rank's buffer."""
    if seconds <= 0:
        raise ValueError(f"{_PREFIX} time must be positive (got {seconds})")
    return nbytes / seconds / 1e9


def bus_bandwidth(algbw: float, world_size: int, collective: str = "allreduce") -> float:
    """Bus bandwidth from algorithm bandwidth, with nccl-tests' correction factors.

    all-reduce: ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all:
    ``(n-1)/n``; broadcast, reduce: 1.
    """
    if world_size < 1:
        raise ValueError(f"{_PREFIX} world size must be at least 1 (got {world_size})")
    n = world_size
    factors = {
        "allreduce": 2.0 * (n - 1) / n,
        "allgather": (n - 1) / n,
        "reducescatter": (n - 1) / n,
        "alltoall": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    key = collective.replace("_", "").replace("-", "").lower()
    if key not in factors:
        raise ValueError(f"{_PREFIX} unknown collective {collective!r}")
    return algbw * factors[key]


def memcpy_bandwidth(nbytes: int = _MEMCPY_BYTES, repeats: int = _MEMCPY_REPEATS) -> float:
    """Single-thread memcpy bandwidth of this host in GB/s (bytes copied / s, median)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _block_for(nbytes: int) -> int:
    """Calls per timed sample: 16 up to 64 KiB, 4 up to 1 MiB, else 1."""
    if nbytes <= _BLOCK_SMALL_BYTES:
        return _BLOCK_SMALL
    if nbytes <= _BLOCK_MEDIUM_BYTES:
        return _BLOCK_MEDIUM
    return 1


def _iterations_for(nbytes: int, iters: int, warmup: int) -> "tuple[int, int]":
    """Timed and warm-up iterations for one size: fewer for sizes >= 16 MiB."""
    if nbytes < _LARGE_BYTES:
        return iters, warmup
    scaled_iters = max(min(iters, _MIN_LARGE_ITERS), iters * _LARGE_BYTES // nbytes)
    scaled_warmup = max(min(warmup, 1), warmup * _LARGE_BYTES // nbytes)
    return scaled_iters, scaled_warmup


# ---------------------------------------------------------------------------
# Configuration and results
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class BenchConfig:
    """Everything one benchmark run needs; picklable, so it travels to the workers."""

    nprocs: int = 2
    min_bytes: int = 8
    max_bytes: int = 64 * 2 ** 20
    step_factor: int = 4
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    op: str = "sum"
    algos: Sequence[str] = ("auto", "ring", "tree", "sharded")
    backend: str = "pycomm"
    peer: Optional[str] = "gloo"
    check: bool = True
    json_path: Optional[str] = None
    timeout_s: float = 300.0
    quiet: bool = False
    plot_path: Optional[str] = None
    mpi: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` (message prefixed ``pycomm bench:``) on a bad setting."""
        if self.nprocs < 1:
            raise ValueError(f"{_PREFIX} --nprocs must be at least 1 (got {self.nprocs})")
        if self.iters < 1:
            raise ValueError(f"{_PREFIX} --iters must be at least 1 (got {self.iters})")
        if self.warmup < 0:
            raise ValueError(f"{_PREFIX} --warmup must be non-negative (got {self.warmup})")
        if self.dtype not in DTYPES:
            raise ValueError(f"{_PREFIX} unknown --dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.op not in OPS:
            raise ValueError(f"{_PREFIX} unknown --op {self.op!r}; choose from {', '.join(OPS)}")
        if self.op == "avg" and not DTYPES[self.dtype].is_floating_point:
            raise ValueError(f"{_PREFIX} --op avg needs a floating --dtype (got {self.dtype})")
        if self.backend == "pycomm" and not self.algos:
            raise ValueError(f"{_PREFIX} --algos is empty")
        if len(set(self.algos)) != len(self.algos):
            raise ValueError(f"{_PREFIX} --algos names an algorithm twice: {','.join(self.algos)}")
        if self.timeout_s <= 0:
            raise ValueError(f"{_PREFIX} --timeout must be positive")
        if self.plot_path is not None and not self.plot_path.lower().endswith(".png"):
            raise ValueError(f"{_PREFIX} --plot writes a PNG: give a path ending in .png "
                             f"(got {self.plot_path!r})")
        if self.mpi:
            from pycomm.bench_mpi import MPI_DTYPES, MPI_OPS

            if self.dtype not in MPI_DTYPES:
                raise ValueError(f"{_PREFIX} --mpi: MPI has no {self.dtype} datatype "
                                 f"(use one of {', '.join(MPI_DTYPES)})")
            if self.op not in MPI_OPS:
                raise ValueError(f"{_PREFIX} --mpi: MPI has no {self.op} reduction "
                                 "(use sum, min, max or product)")
        size_sweep(self.min_bytes, self.max_bytes, self.step_factor)


@dataclasses.dataclass
class BenchResult:
    """What a run produced: metadata, one row per (size, measured backend/algorithm), overall verdict."""

    meta: Dict[str, Any]
    rows: List[Dict[str, Any]]
    ok: bool

    def to_json(self) -> Dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, "ok": self.ok}


@dataclasses.dataclass
class _Run:
    """One column of the table: a process group, and for pycomm an algorithm name."""

    name: str
    backend: str
    algo: Optional[str]
    is_peer: bool
    group: Any = None


def _import_pycomm():
    try:
        import pycomm  # noqa: F401  (registers the "pycomm" backend)
    except ImportError as exc:
        raise RuntimeError(
            f"{_PREFIX} cannot import pycomm ({exc}); build it with "
            "`pip install --no-build-isolation -e .`, or pass --backend gloo to test the harness"
        ) from exc
    for name in ("set_algorithm", "get_algorithm", "select_algorithm"):
        if not hasattr(pycomm, name):
            raise RuntimeError(
                f"{_PREFIX} pycomm has no {name}() (is the package built? imported from "
                f"{getattr(pycomm, '__path__', '?')}); pass --backend gloo to test the harness"
            )
    return pycomm


# ---------------------------------------------------------------------------
# Data patterns with closed-form reductions
# ---------------------------------------------------------------------------

def _pattern_period(dtype: torch.dtype, op: str, world_size: int) -> int:
    """Period of the position weights ``w[i] = i % period + 1``, kept exactly representable."""
    limit = _EXACT_LIMIT[dtype]
    n = world_size
    if op in ("sum", "avg"):
        largest_factor = n * (n + 1) // 2
    elif op in ("min", "max"):
        largest_factor = n
    else:  # product: one rank contributes w[i] + 1, the others 1
        largest_factor = 1
        limit -= 1
    period = min(_MAX_PERIOD, limit // largest_factor)
    if period < 1:
        raise ValueError(
            f"{_PREFIX} --op {op} over {n} ranks leaves the exactly representable range of "
            f"{dtype} (largest value {largest_factor} > {limit}); use a wider --dtype"
        )
    return period


def _tiled(block: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``block`` repeated to ``count`` elements in ``dtype``, without a full-size int64 temporary."""
    out = torch.empty(count, dtype=dtype)
    length = block.numel()
    whole = count // length
    block = block.to(dtype)
    if whole:
        out[: whole * length].view(whole, length).copy_(block.expand(whole, length))
    tail = count - whole * length
    if tail:
        out[whole * length:].copy_(block[:tail])
    return out


def _pattern_blocks(op: str, rank: int, world_size: int, period: int):
    """(input block, expected block) as float64, one period of the pattern (lcm with n for product)."""
    n = world_size
    if op == "product":
        length = period * n // math.gcd(period, n)
        index = torch.arange(length, dtype=torch.int64)
        weights = (index % period + 1).to(torch.float64)
        mine = (index % n) == rank
        inp = torch.where(mine, weights + 1, torch.ones_like(weights))
        return inp, weights + 1
    weights = torch.arange(period, dtype=torch.float64) + 1
    inp = weights * (rank + 1)
    if op == "sum":
        expected = weights * (n * (n + 1) // 2)
    elif op == "avg":
        expected = weights * ((n + 1) / 2)
    elif op == "min":
        expected = weights
    elif op == "max":
        expected = weights * n
    else:
        raise ValueError(f"{_PREFIX} unknown op {op!r}")
    return inp, expected


def _stable_fill(op: str, rank: int) -> float:
    """A fill value that repeated all-reduces keep bounded (the timed loop does not re-fill)."""
    if op == "sum":
        return 0.0
    if op == "product":
        return 1.0
    return float(rank + 1)


def _quartiles(samples: List[float]) -> List[float]:
    """[median, first quartile, third quartile] of ``samples``; NaN when empty."""
    if not samples:
        return [float("nan")] * 3
    if len(samples) == 1:
        return [samples[0]] * 3
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return [median, q1, q3]


def _us(seconds: float) -> Optional[float]:
    return None if math.isnan(seconds) else seconds * 1e6


def _matches(result: torch.Tensor, expected: torch.Tensor) -> bool:
    if result.dtype.is_floating_point:
        return bool(torch.allclose(result, expected, rtol=_RTOL[result.dtype], atol=0.0))
    return bool(torch.equal(result, expected))


# ---------------------------------------------------------------------------
# The worker: one rank of the benchmark
# ---------------------------------------------------------------------------

def _all_reduce_once(buffer: torch.Tensor, run: _Run, op) -> None:
    dist.all_reduce(buffer, op=op, group=run.group)


def _select(pycomm, run: _Run) -> None:
    """Make ``run``'s algorithm the current one of the default (pycomm) group."""
    if run.algo is not None:
        pycomm.set_algorithm(run.algo)


def _bench_worker(rank: int, world_size: int, init_method: str, cfg: BenchConfig) -> BenchResult:
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    uses_pycomm = "pycomm" in (cfg.backend, cfg.peer)
    module = _import_pycomm() if uses_pycomm else None
    pycomm = module if cfg.backend == "pycomm" else None
    dist.init_process_group(cfg.backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        return _bench_body(rank, world_size, cfg, pycomm, timeout)
    finally:
        dist.destroy_process_group()


def _bench_body(rank: int, world_size: int, cfg: BenchConfig, pycomm, timeout) -> BenchResult:
    # Same creation order on every rank: control group first, then the peer.
    control = dist.new_group(backend="gloo", timeout=timeout)
    runs: List[_Run] = []
    if cfg.backend == "pycomm":
        for algo in cfg.algos:
            try:
                pycomm.set_algorithm(algo)
            except Exception as exc:  # a usage error: same on every rank
                raise RuntimeError(f"{_PREFIX} pycomm.set_algorithm({algo!r}) failed: {exc}") from exc
            runs.append(_Run(name=algo, backend="pycomm", algo=algo, is_peer=False, group=None))
        pycomm.set_algorithm("auto")
    else:
        runs.append(_Run(name=cfg.backend, backend=cfg.backend, algo=None, is_peer=False, group=None))
    if cfg.peer:
        peer_group = dist.new_group(backend=cfg.peer, timeout=timeout)
        runs.append(_Run(name=f"peer:{cfg.peer}" if cfg.peer == cfg.backend else cfg.peer,
                         backend=cfg.peer, algo=None, is_peer=True, group=peer_group))

    dtype = DTYPES[cfg.dtype]
    op = OPS[cfg.op]
    op_name = "product" if cfg.op == "prod" else cfg.op
    element_size = torch.empty((), dtype=dtype).element_size()

    memcpy_gbps = memcpy_bandwidth() if rank == 0 else 0.0
    dist.barrier(group=control)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "collective": "allreduce",
        "world_size": world_size,
        "launcher": "torchrun" if torchrun_env() else "spawn",
        "torch_version": torch.__version__,
        "pycomm_version": getattr(pycomm, "__version__", None) if pycomm else None,
        "python_version": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "memcpy_gbps": memcpy_gbps,
        "dtype": cfg.dtype,
        "op": op_name,
        "backend": cfg.backend,
        "algos": [run.name for run in runs if not run.is_peer],
        "peer": cfg.peer,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
    }

    sizes = []
    for size in size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor):
        count = size // element_size
        if count > 0 and count * element_size not in sizes:
            sizes.append(count * element_size)
    skipped = len(size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor)) - len(sizes)

    period = _pattern_period(dtype, op_name, world_size) if cfg.check else 1
    if cfg.check:
        in_block, expected_block = _pattern_blocks(op_name, rank, world_size, period)

    printer = _TablePrinter(runs, world_size, enabled=(rank == 0 and not cfg.quiet))
    printer.header(meta, skipped)

    rows: List[Dict[str, Any]] = []
    all_ok = True
    for nbytes in sizes:
        count = nbytes // element_size
        iters, warmup = _iterations_for(nbytes, cfg.iters, cfg.warmup)
        buffer = torch.empty(count, dtype=dtype)
        if cfg.check:
            pattern = _tiled(in_block, count, dtype)
            expected = _tiled(expected_block, count, dtype)
        statuses = [-1] * len(runs)  # 1 OK, 0 FAIL, -1 not checked, -2 error
        errors: List[Optional[str]] = [None] * len(runs)
        selected: List[Optional[str]] = [None] * len(runs)

        # Phase 1, per run: correctness on the closed-form pattern, then warm-up.
        # A usage error (unsupported dtype/op) is raised on every rank alike;
        # it marks that run ERR and the sweep goes on.
        for i, run in enumerate(runs):
            try:
                _select(pycomm, run)
                if run.algo == "auto":
                    selected[i] = pycomm.select_algorithm(nbytes)
                if cfg.check:
                    buffer.copy_(pattern)
                    _all_reduce_once(buffer, run, op)
                    statuses[i] = 1 if _matches(buffer, expected) else 0
                buffer.fill_(_stable_fill(op_name, rank))
                for _ in range(warmup):
                    _all_reduce_once(buffer, run, op)
            except Exception as exc:
                statuses[i] = -2
                errors[i] = f"{type(exc).__name__}: {exc}"
        # Every rank must agree on which runs are timed, or collectives would pair up wrongly.
        status_t = torch.tensor(statuses, dtype=torch.int64)
        dist.all_reduce(status_t, op=dist.ReduceOp.MIN, group=control)
        timed = [i for i in range(len(runs)) if int(status_t[i]) != -2]

        # Phase 2: timed iterations, interleaved across runs (the starting run
        # rotates each round) so that load changing over time on a shared host
        # affects every column alike. No barriers: a sample is `block` calls
        # timed together (after one untimed call when runs alternate), divided by block.
        buffer.fill_(_stable_fill(op_name, rank))
        times: List[List[float]] = [[] for _ in runs]
        block = _block_for(nbytes)
        for round_index in range(iters):
            shift = round_index % len(timed) if timed else 0
            for i in timed[shift:] + timed[:shift]:
                run = runs[i]
                _select(pycomm, run)
                if len(timed) > 1:
                    _all_reduce_once(buffer, run, op)
                start = time.perf_counter()
                for _ in range(block):
                    _all_reduce_once(buffer, run, op)
                times[i].append((time.perf_counter() - start) / block)
        if pycomm is not None:
            pycomm.set_algorithm("auto")
        # Per run: median, first and third quartile of this rank's iterations.
        stats = [_quartiles(t) for t in times]

        # Slowest rank's figures; a check passes only if it passed everywhere.
        stats_t = torch.tensor(stats, dtype=torch.float64).reshape(len(runs), 3)
        dist.all_reduce(stats_t, op=dist.ReduceOp.MAX, group=control)
        times_t = stats_t[:, 0]

        size_rows = []
        for i, run in enumerate(runs):
            seconds = float(times_t[i])
            status = int(status_t[i])
            check = {1: "OK", 0: "FAIL", -1: "SKIP", -2: "ERR"}[status]
            if math.isnan(seconds):
                check = "ERR"
            # A peer that cannot run this dtype/op (gloo has no int16) is reported,
            # not counted as a failure; a wrong result from anyone is.
            if check == "FAIL" or (check == "ERR" and not run.is_peer):
                all_ok = False
            algbw = alg_bandwidth(nbytes, seconds) if not math.isnan(seconds) else None
            busbw = bus_bandwidth(algbw, world_size) if algbw is not None else None
            size_rows.append({
                "size_bytes": nbytes,
                "count": count,
                "dtype": cfg.dtype,
                "op": op_name,
                "world_size": world_size,
                "name": run.name,
                "backend": run.backend,
                "algo": run.algo,
                "selected": selected[i],
                "peer": run.is_peer,
                "iters": iters,
                "warmup": warmup,
                "time_us": None if math.isnan(seconds) else seconds * 1e6,
                "time_us_q1": _us(float(stats_t[i, 1])),
                "time_us_q3": _us(float(stats_t[i, 2])),
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
                "check": check,
                "error": errors[i],
                "vs_peer": None,
            })
        peer_rows = [row for row in size_rows if row["peer"]]
        peer_bw = peer_rows[0]["busbw_gbps"] if peer_rows else None
        if peer_bw:
            for row in size_rows:
                if not row["peer"] and row["busbw_gbps"] is not None:
                    row["vs_peer"] = row["busbw_gbps"] / peer_bw
        rows.extend(size_rows)
        printer.row(nbytes, count, cfg.dtype, size_rows)

    result = BenchResult(meta=meta, rows=rows, ok=all_ok)
    printer.footer(result)
    dist.barrier(group=control)
    return result


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

def _fmt(value: Optional[float], width: int, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    if digits and abs(value) >= 1000:
        digits = 0
    return f"{value:>{width}.{digits}f}"


class _TablePrinter:
    """Prints the nccl-tests-like table row by row (rank 0 only)."""

    def __init__(self, runs: List[_Run], world_size: int, enabled: bool):
        self.runs = runs
        self.tested = [run for run in runs if not run.is_peer]
        self.peer = next((run for run in runs if run.is_peer), None)
        self.world_size = world_size
        self.enabled = enabled
        self.tested_label = self.tested[0].backend if self.tested else "tested"

    def _print(self, line: str = "") -> None:
        if self.enabled:
            print(line, flush=True)

    def header(self, meta: Dict[str, Any], skipped: int) -> None:
        self._print(f"# pycomm bench: all-reduce, op {meta['op']}, dtype {meta['dtype']}")
        self._print(f"# date {meta['date']}  host {meta['hostname']}")
        pycomm_version = meta["pycomm_version"] or ("-" if meta["backend"] != "pycomm" else "?")
        self._print(f"# world size {meta['world_size']} ({meta['launcher']}), torch {meta['torch_version']}, "
                    f"pycomm {pycomm_version}, python {meta['python_version']}, "
                    f"torch threads/rank {meta['torch_threads']}")
        self._print(f"# memcpy (1 thread, {format_size(_MEMCPY_BYTES)}, median of {_MEMCPY_REPEATS}): "
                    f"{meta['memcpy_gbps']:.2f} GB/s")
        self._print(f"# backend {meta['backend']}, algorithms {','.join(meta['algos'])}, "
                    f"peer {meta['peer'] or 'none'}; iters {meta['iters']} (fewer from "
                    f"{format_size(_LARGE_BYTES)} up, at least {_MIN_LARGE_ITERS}), warmup {meta['warmup']}, "
                    f"check {'on' if meta['check'] else 'off'}")
        self._print(f"# time = median over iterations, max over ranks; an iteration up to "
                    f"{format_size(_BLOCK_SMALL_BYTES)} is {_BLOCK_SMALL} back-to-back calls, up to "
                    f"{format_size(_BLOCK_MEDIUM_BYTES)} {_BLOCK_MEDIUM}, divided (each after one untimed call "
                    "when columns alternate); "
                    "algbw = S/t (S = bytes per rank); busbw = algbw*2(n-1)/n; GB/s = 1e9 B/s")
        if skipped:
            self._print(f"# skipped {skipped} size(s) smaller than one element or duplicated after rounding")
        self._print("#")
        top = f"#{'':>12} {'':>12} {'':>8}"
        sub = f"#{'size(B)':>12} {'count':>12} {'type':>8}"
        for run in self.tested:
            top += f" {run.name[:28]:^28}"
            sub += f" {'time(us)':>10} {'algbw':>8} {'busbw':>8}"
        if self.peer is not None:
            top += f" {self.peer.name[:19]:^19}"
            sub += f" {'time(us)':>10} {'busbw':>8}"
            top += f" {'best/':>9}"
            sub += f" {'peer':>9}"
        top += f" {'':>6}"
        sub += f" {'check':>6}"
        self._print(top)
        self._print(sub)

    def row(self, nbytes: int, count: int, dtype: str, rows: List[Dict[str, Any]]) -> None:
        by_name = {row["name"]: row for row in rows}
        line = f" {nbytes:>12} {count:>12} {dtype:>8}"
        for run in self.tested:
            row = by_name[run.name]
            if row["check"] == "ERR":
                line += f" {'ERR':>10} {'-':>8} {'-':>8}"
            else:
                line += (f" {_fmt(row['time_us'], 10, 1)} {_fmt(row['algbw_gbps'], 8)}"
                         f" {_fmt(row['busbw_gbps'], 8)}")
        if self.peer is not None:
            row = by_name[self.peer.name]
            if row["check"] == "ERR":
                line += f" {'ERR':>10} {'-':>8}"
            else:
                line += f" {_fmt(row['time_us'], 10, 1)} {_fmt(row['busbw_gbps'], 8)}"
            ratios = [r["vs_peer"] for r in rows if r["vs_peer"] is not None]
            line += f" {_fmt(max(ratios) if ratios else None, 9)}"
        checks = [row["check"] for row in rows if not (row["peer"] and row["check"] == "ERR")]
        if "ERR" in checks:
            verdict = "ERR"
        elif "FAIL" in checks:
            verdict = "FAIL"
        elif all(check == "SKIP" for check in checks):
            verdict = "-"
        else:
            verdict = "OK"
        line += f" {verdict:>6}"
        self._print(line)

    def footer(self, result: BenchResult) -> None:
        rows = result.rows
        if self.peer is not None and self.world_size > 1:
            self._print("#")
            self._print(f"# busbw ratio vs {self.peer.name} per algorithm (auto: the algorithm it picked)")
            line = f"#{'size(B)':>12}"
            for run in self.tested:
                line += f" {run.name[:18]:>18}"
            self._print(line)
            sizes = sorted({row["size_bytes"] for row in rows})
            for nbytes in sizes:
                line = f" {nbytes:>12}"
                for run in self.tested:
                    row = next(r for r in rows if r["size_bytes"] == nbytes and r["name"] == run.name)
                    cell = _fmt(row["vs_peer"], 6)
                    if row["selected"]:
                        cell = f"{cell.strip()} ({row['selected']})"
                    line += f" {cell:>18}"
                self._print(line)
        self._print("#")
        for run in self.runs:
            values = [row["busbw_gbps"] for row in rows
                      if row["name"] == run.name and row["busbw_gbps"] is not None]
            average = sum(values) / len(values) if values else float("nan")
            self._print(f"# avg busbw {run.name:<16}: {_fmt(average, 8).strip()} GB/s")
        failures = [row for row in rows if row["check"] in ("FAIL", "ERR")]
        for row in failures[:10]:
            detail = f": {row['error']}" if row["error"] else ""
            self._print(f"# {row['check']} size {row['size_bytes']} {row['name']}{detail}")
        tested = [row for row in rows if not row["peer"]]
        checked = [row for row in tested if row["check"] != "SKIP"]
        bad = [row for row in tested if row["check"] in ("FAIL", "ERR")]
        peer_errors = [row for row in rows if row["peer"] and row["check"] == "ERR"]
        note = f"; the peer could not run {len(peer_errors)} size(s)" if peer_errors else ""
        if not checked and not bad:
            self._print(f"# check: skipped (--no-check){note}")
        else:
            self._print(f"# check: {'OK' if result.ok else 'FAIL'} "
                        f"({len(checked) - len(bad)}/{len(checked)} {self.tested_label} runs correct{note})")


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------

def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run the sweep (spawning ``cfg.nprocs`` ranks, or as one rank of a torchrun job).

    Rank 0 prints the table unless ``cfg.quiet``; rank 0 writes ``cfg.json_path``
    if set. Returns the result (the same on every rank under torchrun).
    """
    cfg.validate()
    if cfg.mpi:
        if torchrun_env() is not None:
            raise RuntimeError(f"{_PREFIX} --mpi starts its own mpirun on this host; "
                               "run pycomm-bench -n N --mpi outside torchrun")
        reason = mpi_unavailable_reason()
        if reason:
            raise RuntimeError(f"{_PREFIX} --mpi: {reason}")
    if cfg.plot_path:
        _import_pyplot()  # fail before the sweep, not after it
    if "pycomm" in (cfg.backend, cfg.peer) and torchrun_env() is None:
        _import_pycomm()  # fail here, once, rather than in every spawned rank
    if cfg.check:
        # Fail fast (before spawning) if the pattern cannot be exact.
        world = torchrun_env()[1] if torchrun_env() else cfg.nprocs
        _pattern_period(DTYPES[cfg.dtype], "product" if cfg.op == "prod" else cfg.op, world)
    result = launch_workers(_bench_worker, cfg.nprocs, cfg, prefix=_PREFIX, expected_errors=(_PREFIX,))
    if cfg.mpi:
        result = join_mpi(result, _run_mpi_sweep(cfg, result.meta["world_size"]))
        if not cfg.quiet:
            _print_peers(result)
    env = torchrun_env()
    if env is None or env[0] == 0:
        if cfg.json_path:
            directory = os.path.dirname(os.path.abspath(cfg.json_path))
            os.makedirs(directory, exist_ok=True)
            with open(cfg.json_path, "w") as handle:
                json.dump(result.to_json(), handle, indent=1)
        if cfg.plot_path:
            write_plot(result, cfg.plot_path)
            if not cfg.quiet:
                print(f"# plot: {cfg.plot_path}", flush=True)
    return result


# ---------------------------------------------------------------------------
# Open MPI as a third peer (--mpi) and the plot (--plot)
# ---------------------------------------------------------------------------

def mpi_unavailable_reason() -> Optional[str]:
    """Why ``--mpi`` cannot run here (no mpirun, no mpi4py), or None when it can."""
    missing = []
    if shutil.which("mpirun") is None:
        missing.append("mpirun (Debian: apt-get install openmpi-bin libopenmpi-dev)")
    if importlib.util.find_spec("mpi4py") is None:
        missing.append("mpi4py (pip install mpi4py, after the MPI library)")
    return ("needs " + " and ".join(missing)) if missing else None


def _mpi_command(cfg: BenchConfig, world_size: int, json_path: str) -> List[str]:
    cmd = [shutil.which("mpirun") or "mpirun"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "-np", str(world_size), sys.executable, "-m", "pycomm.bench_mpi",
            "-b", str(cfg.min_bytes), "-e", str(cfg.max_bytes), "-f", str(cfg.step_factor),
            "--iters", str(cfg.iters), "--warmup", str(cfg.warmup), "--dtype", cfg.dtype,
            "--op", cfg.op, "--check" if cfg.check else "--no-check", "--quiet",
            "--json", json_path]
    return cmd


def _run_mpi_sweep(cfg: BenchConfig, world_size: int) -> BenchResult:
    """The same sweep through Open MPI (pycomm.bench_mpi under mpirun), right after ours."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="pycomm-bench-mpi-") as tmpdir:
        json_path = os.path.join(tmpdir, "mpi.json")
        cmd = _mpi_command(cfg, world_size, json_path)
        # Every size is bounded by cfg.timeout_s in our sweep; give MPI's the same per size.
        limit = cfg.timeout_s * (len(size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor)) + 1)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{_PREFIX} --mpi: the MPI sweep did not finish in {limit:.0f} s: "
                               f"{' '.join(cmd)}") from None
        if proc.returncode != 0 or not os.path.exists(json_path):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
            raise RuntimeError(f"{_PREFIX} --mpi: {' '.join(cmd)} exited with code "
                               f"{proc.returncode}:\n" + "\n".join(tail))
        with open(json_path) as handle:
            data = json.load(handle)
    data["meta"]["command"] = " ".join(cmd[:cmd.index(sys.executable)] + ["python"]
                                       + cmd[cmd.index(sys.executable) + 1:-2])
    return BenchResult(meta=data["meta"], rows=data["rows"], ok=data["ok"])


def join_mpi(result: BenchResult, mpi: BenchResult) -> BenchResult:
    """``result`` with MPI's rows added (name "mpi") and, on each tested row of the same
    size, ``vs_mpi`` = busbw / MPI's busbw; ``meta["mpi"]`` holds MPI's metadata."""
    mpi_bw = {row["size_bytes"]: row["busbw_gbps"] for row in mpi.rows}
    rows = []
    for row in result.rows:
        row = dict(row)
        if not row["peer"]:
            peer_bw = mpi_bw.get(row["size_bytes"])
            row["vs_mpi"] = (row["busbw_gbps"] / peer_bw
                             if peer_bw and row["busbw_gbps"] is not None else None)
        rows.append(row)
    rows += [dict(row) for row in mpi.rows]
    rows.sort(key=lambda row: row["size_bytes"])  # stable: each size keeps its column order
    meta = dict(result.meta, mpi=mpi.meta)
    return BenchResult(meta=meta, rows=rows, ok=result.ok and mpi.ok)


def _column_names(rows: List[Dict[str, Any]]) -> List[str]:
    names: List[str] = []
    for row in rows:
        if row["name"] not in names:
            names.append(row["name"])
    return names


def _print_peers(result: BenchResult) -> None:
    """One table with every column and peer: time and busbw side by side, then the ratios."""
    rows = result.rows
    names = _column_names(rows)
    tested = [name for name in names
              if not next(row for row in rows if row["name"] == name)["peer"]]
    peers = [name for name in names if name not in tested]
    mpi_meta = result.meta.get("mpi", {})
    print("#")
    print(f"# all peers, one run: pycomm {','.join(tested)} and "
          f"{', '.join(p for p in peers if p != 'mpi')} in the same processes; mpi = "
          f"{mpi_meta.get('mpi_library', 'MPI').split(',')[0]} ({mpi_meta.get('command', 'mpirun')}),"
          " right after")
    print(f"# memcpy 1 thread: {result.meta['memcpy_gbps']:.2f} GB/s (this sweep), "
          f"{mpi_meta.get('memcpy_gbps', float('nan')):.2f} GB/s (MPI sweep)")
    width = 9
    head = f"#{'':>12}" + f" {'time (us)':^{(width + 1) * len(names) - 1}}"
    head += f" {'busbw (GB/s)':^{(width + 1) * len(names) - 1}}"
    head += f" {'best pycomm busbw /':^{(width + 1) * len(peers) - 1}}"
    print(head)
    sub = f"#{'size(B)':>12}" + "".join(f" {name[:width]:>{width}}" for name in names) * 2
    sub += "".join(f" {name[:width]:>{width}}" for name in peers)
    print(sub)
    for nbytes in sorted({row["size_bytes"] for row in rows}):
        at = {row["name"]: row for row in rows if row["size_bytes"] == nbytes}
        line = f" {nbytes:>12}"
        line += "".join(f" {_fmt(at[n]['time_us'] if n in at else None, width, 1)}" for n in names)
        line += "".join(f" {_fmt(at[n]['busbw_gbps'] if n in at else None, width, 3)}"
                        for n in names)
        best = max((at[n]["busbw_gbps"] for n in tested
                    if n in at and at[n]["busbw_gbps"] is not None), default=None)
        for peer in peers:
            peer_bw = at[peer]["busbw_gbps"] if peer in at else None
            line += f" {_fmt(best / peer_bw if best and peer_bw else None, width)}"
        print(line)
    print(f"# check: {'OK' if result.ok else 'FAIL'} (pycomm and MPI results against the closed form)",
          flush=True)


def _import_pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(f"{_PREFIX} --plot needs matplotlib (pip install matplotlib): {exc}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(result: BenchResult, path: str) -> None:
    """PNG of busbw vs message size (log x), one line per column (pycomm algorithms, gloo,
    MPI, ...), the machine's single-thread memcpy as a horizontal line; a second panel
    shows the median time (log-log) for the small-message end."""
    plt = _import_pyplot()
    meta, rows = result.meta, result.rows
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5.2))
    for name in _column_names(rows):
        mine = [row for row in rows if row["name"] == name and row["busbw_gbps"] is not None]
        if not mine:
            continue
        first = mine[0]
        if first["backend"] == "pycomm":
            label, style = f"pycomm {name}" + (" (auto)" if name == "auto" else ""), "-o"
        else:
            label = {"openmpi": "Open MPI", "gloo": "gloo"}.get(first["backend"], first["backend"])
            style = "--s"
        sizes = [row["size_bytes"] for row in mine]
        ax_bw.plot(sizes, [row["busbw_gbps"] for row in mine], style, label=label, markersize=4)
        ax_t.plot(sizes, [row["time_us"] for row in mine], style, label=label, markersize=4)
    memcpy = meta.get("memcpy_gbps")
    if memcpy:
        ax_bw.axhline(memcpy, color="black", linestyle=":", linewidth=1.2,
                      label=f"memcpy, 1 thread ({memcpy:.1f} GB/s)")
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        sizes = sorted({row["size_bytes"] for row in rows})
        ticks = sizes if len(sizes) <= 14 else sizes[::2]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(size).replace(" ", "") for size in ticks], rotation=45,
                           fontsize=8)
        ax.set_xlabel("message size per rank")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("busbw (GB/s) = S/t x 2(n-1)/n")
    ax_bw.set_ylim(bottom=0)
    ax_bw.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time (us), median of the slowest rank")
    fig.suptitle(f"all-reduce {meta.get('op', '')} {meta.get('dtype', '')}, "
                 f"{meta.get('world_size', '?')} ranks on {meta.get('hostname', '?')} "
                 f"({meta.get('date', '')})")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycomm-bench",
        description=(
            "All-reduce microbenchmark in the style of nccl-tests. Each pycomm algorithm and a "
            "peer backend run on the same buffers in the same processes; the table reports the "
            "median time over iterations (slowest rank), algbw = S/t and busbw = algbw*2(n-1)/n, "
            "and checks every result against a closed-form value. Under torchrun (RANK and "
            "WORLD_SIZE set) the launched processes are the ranks; otherwise -n ranks are "
            "spawned on this host."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-n", "--nprocs", type=int, default=2,
                        help="ranks to spawn on this host (ignored under torchrun)")
    parser.add_argument("-b", "--minbytes", type=_size_arg, default="8",
                        help="smallest message in bytes per rank; suffixes K, M, G (binary)")
    parser.add_argument("-e", "--maxbytes", type=_size_arg, default="64M",
                        help="largest message; sizes are minbytes*stepfactor^k <= maxbytes")
    parser.add_argument("-f", "--stepfactor", type=int, default=4,
                        help="multiply the size by this factor between rows")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations per size and algorithm (scaled down from 16 MiB up, "
                             f"at least {_MIN_LARGE_ITERS})")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before timing")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="element type")
    parser.add_argument("--op", default="sum", choices=sorted(OPS), help="reduction operation")
    parser.add_argument("--algos", default="auto,ring,tree,sharded",
                        help="comma-separated pycomm algorithms to measure: auto (what pycomm "
                             "picks: shm when every rank shares a host), ring, tree, sharded, "
                             "shm, hierarchical")
    parser.add_argument("--backend", default="pycomm",
                        help="backend under test; any other than pycomm (e.g. gloo) is measured "
                             "as a single column and --algos is ignored")
    parser.add_argument("--peer", default="gloo",
                        help="peer backend measured in the same run for comparison; 'none' to skip")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="check every algorithm's result against the closed-form value")
    parser.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                        help="write metadata and one row per (size, algorithm) to this JSON file")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a collective is declared hung")
    parser.add_argument("--plot", dest="plot_path", metavar="PATH.png", default=None,
                        help="write a PNG of busbw (and time) vs message size, one line per "
                             "algorithm / peer, memcpy as a reference line (needs matplotlib)")
    parser.add_argument("--mpi", action="store_true",
                        help="after the sweep, run the same sweep through Open MPI (mpirun + "
                             "mpi4py, python -m pycomm.bench_mpi) and print one table with every "
                             "peer; its rows go to --json and --plot too")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchConfig:
    """Parse command-line arguments into a validated :class:`BenchConfig`."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    algos = tuple(name.strip() for name in args.algos.split(",") if name.strip())
    peer = None if args.peer.strip().lower() in ("", "none") else args.peer.strip()
    cfg = BenchConfig(
        nprocs=args.nprocs,
        min_bytes=args.minbytes,
        max_bytes=args.maxbytes,
        step_factor=args.stepfactor,
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        op=args.op,
        algos=algos,
        backend=args.backend,
        peer=peer,
        check=args.check,
        json_path=args.json_path,
        timeout_s=args.timeout,
        plot_path=args.plot_path,
        mpi=args.mpi,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (``pycomm-bench``). Returns 0 when every check passed, 1 otherwise."""
    cfg = parse_args(argv)
    try:
        result = run_benchmark(cfg)
    except (RuntimeError, ValueError) as exc:
        message = str(exc)
        if not message.startswith(_PREFIX):
            message = f"{_PREFIX} {message}"
        print(message, file=sys.stderr)
        return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
