"""What every runner of the benchmark shares (nccl-tests' common.cu): the sweep of sizes,
iteration counts, the sampling discipline, the closed-form check patterns and the figures.

Figures follow nccl-tests:

* time  = median over the timed iterations on each rank, then the maximum of
  those medians over ranks (the slowest rank is the figure);
* algbw = S / time, with S the bytes of one rank's buffer;
* busbw = algbw * 2(n-1)/n for all-reduce.

Correctness is checked in the same run: before timing, each column reduces a
rank- and position-dependent pattern whose result is known in closed form
(sum of ``(rank + 1) * w[i]`` is ``n(n+1)/2 * w[i]``). The timed loop then
runs on a buffer filled with a value that the reduction keeps stable (0 for
sum, 1 for product), so no re-fill is needed between timed iterations.

Sampling (:func:`time_samples`, the same for every runner), two disciplines (``--timing``):

* ``block`` (default): a sample of a small message is a block of back-to-back calls (16 up
  to 64 KiB, 4 up to 1 MiB, else 1) timed together and divided; when several columns
  alternate, every sample follows one untimed call of its own column, which realigns the
  ranks after the previous column's call. This is the pipelined cost of a call.
* ``barrier``: a sample is a barrier on the control group (never the backend under test),
  then one timed call. This is what a training loop sees: every call starts from ranks
  that arrive together, with the wake-ups a collective after a pause needs.
* ``shm-barrier``: the same with the benchmark's own shared-memory barrier
  (:mod:`.shm_barrier`, ranks on one host), the same code for every column, Open MPI's
  included: the control group's barrier (gloo's) can let the ranks go hundreds of
  microseconds apart on a crowded host, and that skew lands in the time.

A column is a :class:`Runner` (one all-reduce call on a buffer: pycomm with an algorithm,
a torch.distributed peer such as gloo, MPI); the ranks agree on statuses and figures
through a :class:`Control` that never uses the backend under test.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "BLOCK_MEDIUM",
    "BLOCK_MEDIUM_BYTES",
    "BLOCK_SMALL",
    "BLOCK_SMALL_BYTES",
    "BenchConfig",
    "BenchResult",
    "Control",
    "DTYPES",
    "EXACT_LIMIT",
    "LARGE_BYTES",
    "MEMCPY_BYTES",
    "MEMCPY_REPEATS",
    "MIN_LARGE_ITERS",
    "MPI_DTYPES",
    "MPI_OPS",
    "OPS",
    "PREFIX",
    "Runner",
    "TIMINGS",
    "alg_bandwidth",
    "block_for",
    "bus_bandwidth",
    "byte_sizes",
    "format_size",
    "iterations_for",
    "matches",
    "memcpy_bandwidth",
    "parse_size",
    "pattern_blocks",
    "pattern_period",
    "quartiles",
    "run_sweep",
    "size_arg",
    "size_sweep",
    "stable_fill",
    "tiled",
    "time_samples",
]

PREFIX = "pycomm bench:"

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

#: dtypes with an MPI datatype (MPI has no float16 / bfloat16).
MPI_DTYPES = ("float32", "float", "float64", "double", "int8", "uint8", "int16", "int32", "int",
              "int64", "long")
#: ops MPI has (no AVG).
MPI_OPS = ("sum", "min", "max", "product", "prod")

#: Largest integer every value up to which the dtype represents exactly.
EXACT_LIMIT = {
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

#: Sizes at or above this get proportionally fewer iterations.
LARGE_BYTES = 16 * 2 ** 20
# Small messages are timed in blocks of back-to-back calls. Every sample follows one
# untimed call of the same run when several runs alternate: it realigns the ranks
# (the previous column's call may finish at different times on different ranks, and
# that skew would otherwise land in this column's time; after a gloo call of some
# milliseconds it tripled the 8 MiB shm time in some runs).
BLOCK_SMALL_BYTES, BLOCK_SMALL = 64 * 2 ** 10, 16
BLOCK_MEDIUM_BYTES, BLOCK_MEDIUM = 2 ** 20, 4
MIN_LARGE_ITERS = 3

#: Sampling disciplines (``--timing``): blocks of back-to-back calls, or barrier then one call.
TIMINGS = ("block", "barrier", "shm-barrier")

MEMCPY_BYTES = 64 * 2 ** 20
MEMCPY_REPEATS = 10

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


# ---------------------------------------------------------------------------
# Sizes, iteration counts, figures
# ---------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Parse a byte count such as ``8``, ``64K``, ``1.5M``, ``2GiB`` (binary units)."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"{PREFIX} cannot parse size {text!r} (expected e.g. 8, 64K, 16M, 1G)")
    number, unit = match.groups()
    value = float(number) * _SIZE_UNITS[unit.lower()]
    if value != int(value):
        raise ValueError(f"{PREFIX} size {text!r} is not a whole number of bytes")
    return int(value)


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type=``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        raise ValueError(f"{PREFIX} sizes must be non-negative")
    if min_bytes > max_bytes:
        raise ValueError(f"{PREFIX} --minbytes ({min_bytes}) is larger than --maxbytes ({max_bytes})")
    if min_bytes == max_bytes:
        return [min_bytes]
    if step_factor < 2:
        raise ValueError(f"{PREFIX} --stepfactor must be at least 2 (got {step_factor})")
    if min_bytes == 0:
        raise ValueError(f"{PREFIX} --minbytes must be positive for a geometric sweep")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def alg_bandwidth(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): ``S / t`` with S one rank's buffer."""
    if seconds <= 0:
        raise ValueError(f"{PREFIX} time must be positive (got {seconds})")
    return nbytes / seconds / 1e9


def bus_bandwidth(algbw: float, world_size: int, collective: str = "allreduce") -> float:
    """Bus bandwidth from algorithm bandwidth, with nccl-tests' correction factors.

    all-reduce: ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all:
    ``(n-1)/n``; broadcast, reduce: 1.
    """
    if world_size < 1:
        raise ValueError(f"{PREFIX} world size must be at least 1 (got {world_size})")
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
        raise ValueError(f"{PREFIX} unknown collective {collective!r}")
    return algbw * factors[key]


def memcpy_bandwidth(nbytes: int = MEMCPY_BYTES, repeats: int = MEMCPY_REPEATS) -> float:
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


def block_for(nbytes: int) -> int:
    """Calls per timed sample: 16 up to 64 KiB, 4 up to 1 MiB, else 1."""
    if nbytes <= BLOCK_SMALL_BYTES:
        return BLOCK_SMALL
    if nbytes <= BLOCK_MEDIUM_BYTES:
        return BLOCK_MEDIUM
    return 1


def iterations_for(nbytes: int, iters: int, warmup: int) -> Tuple[int, int]:
    """Timed and warm-up iterations for one size: fewer for sizes >= 16 MiB."""
    if nbytes < LARGE_BYTES:
        return iters, warmup
    scaled_iters = max(min(iters, MIN_LARGE_ITERS), iters * LARGE_BYTES // nbytes)
    scaled_warmup = max(min(warmup, 1), warmup * LARGE_BYTES // nbytes)
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
    # How a sample is taken (TIMINGS): "block" of back-to-back calls, or a barrier ("barrier": the
    # control group's, "shm-barrier": the benchmark's own on one host) then one call.
    timing: str = "block"
    # The raw-TCP reference line (pycomm.bench.link): None = on when pycomm runs over TCP
    # only (PYCOMM_TRANSPORT=tcp) or across hosts with one rank each (--hosts N; with more
    # ranks per host half the ring's links stay inside a host, so it is no ceiling).
    tcp_reference: Optional[bool] = None
    # --hosts N: N network namespaces made for the run (pycomm.bench.hosts), ranks_per_host
    # ranks in each (nprocs is then hosts * ranks_per_host); rate: tc tbf on each host's egress.
    hosts: Optional[int] = None
    ranks_per_host: int = 1
    rate: Optional[str] = None
    # The ranks' pycomm settings (PYCOMM_* name -> value) over their environment, handed to
    # the group as pg_options (pycomm.config.with_settings): how a caller such as
    # python -m pycomm.plan picks the transport or the streams of a run without touching
    # os.environ. None: the environment alone.
    settings: Optional[Dict[str, str]] = None

    @property
    def op_name(self) -> str:
        """The reduction's canonical name (``prod`` is ``product``)."""
        return "product" if self.op == "prod" else self.op

    def validate(self) -> None:
        """Raise ``ValueError`` (message prefixed ``pycomm bench:``) on a bad setting."""
        if self.hosts is not None:
            from .hosts import HOSTS_MPI_REASON, valid_rate

            if self.hosts < 1:
                raise ValueError(f"{PREFIX} --hosts must be at least 1 (got {self.hosts})")
            if self.ranks_per_host < 1:
                raise ValueError(f"{PREFIX} --ranks-per-host must be at least 1 (got {self.ranks_per_host})")
            if self.nprocs != self.hosts * self.ranks_per_host:
                raise ValueError(f"{PREFIX} --hosts {self.hosts} x --ranks-per-host {self.ranks_per_host} "
                                 f"makes {self.hosts * self.ranks_per_host} ranks, not -n {self.nprocs}")
            if self.rate is not None and not valid_rate(self.rate):
                raise ValueError(f"{PREFIX} --rate {self.rate!r} is not a tc rate (e.g. 10gbit, 1gbit, "
                                 "100mbit)")
            if self.mpi:
                raise ValueError(f"{PREFIX} {HOSTS_MPI_REASON}")
        elif self.rate is not None or self.ranks_per_host != 1:
            raise ValueError(f"{PREFIX} --rate and --ranks-per-host need --hosts")
        if self.nprocs < 1:
            raise ValueError(f"{PREFIX} --nprocs must be at least 1 (got {self.nprocs})")
        if self.settings:
            from ..config import load_config, with_settings

            try:
                load_config(with_settings(self.settings))
            except ValueError as exc:
                raise ValueError(f"{PREFIX} settings: {exc}") from None
        if self.iters < 1:
            raise ValueError(f"{PREFIX} --iters must be at least 1 (got {self.iters})")
        if self.warmup < 0:
            raise ValueError(f"{PREFIX} --warmup must be non-negative (got {self.warmup})")
        if self.dtype not in DTYPES:
            raise ValueError(f"{PREFIX} unknown --dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.op not in OPS:
            raise ValueError(f"{PREFIX} unknown --op {self.op!r}; choose from {', '.join(OPS)}")
        if self.op == "avg" and not DTYPES[self.dtype].is_floating_point:
            raise ValueError(f"{PREFIX} --op avg needs a floating --dtype (got {self.dtype})")
        if self.backend == "pycomm" and not self.algos:
            raise ValueError(f"{PREFIX} --algos is empty")
        if len(set(self.algos)) != len(self.algos):
            raise ValueError(f"{PREFIX} --algos names an algorithm twice: {','.join(self.algos)}")
        from .runners import compressed_spec

        compressed = [a for a in self.algos if compressed_spec(a) is not None]
        if compressed and (self.backend != "pycomm" or self.dtype != "float32" or self.op not in ("sum", "avg")
                           or self.mpi):
            raise ValueError(f"{PREFIX} {','.join(compressed)}: the compressed hooks' exchange needs the pycomm "
                             f"backend, --dtype float32 and --op sum or avg, without --mpi (got {self.backend}, "
                             f"{self.dtype}, {self.op})")
        if self.timing not in TIMINGS:
            raise ValueError(f"{PREFIX} unknown --timing {self.timing!r}; choose from {', '.join(TIMINGS)}")
        if self.timing == "shm-barrier" and self.hosts is not None:
            raise ValueError(f"{PREFIX} --timing shm-barrier needs every rank on one host (not --hosts)")
        if self.timeout_s <= 0:
            raise ValueError(f"{PREFIX} --timeout must be positive")
        if self.plot_path is not None and not self.plot_path.lower().endswith(".png"):
            raise ValueError(f"{PREFIX} --plot writes a PNG: give a path ending in .png "
                             f"(got {self.plot_path!r})")
        if self.mpi:
            if self.dtype not in MPI_DTYPES:
                raise ValueError(f"{PREFIX} --mpi: MPI has no {self.dtype} datatype "
                                 f"(use one of {', '.join(MPI_DTYPES)})")
            if self.op not in MPI_OPS:
                raise ValueError(f"{PREFIX} --mpi: MPI has no {self.op} reduction "
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


# ---------------------------------------------------------------------------
# Data patterns with closed-form reductions
# ---------------------------------------------------------------------------

def pattern_period(dtype: torch.dtype, op: str, world_size: int) -> int:
    """Period of the position weights ``w[i] = i % period + 1``, kept exactly representable."""
    limit = EXACT_LIMIT[dtype]
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
            f"{PREFIX} --op {op} over {n} ranks leaves the exactly representable range of "
            f"{dtype} (largest value {largest_factor} > {limit}); use a wider --dtype"
        )
    return period


def tiled(block: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
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


def pattern_blocks(op: str, rank: int, world_size: int, period: int):
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
        raise ValueError(f"{PREFIX} unknown op {op!r}")
    return inp, expected


def stable_fill(op: str, rank: int) -> float:
    """A fill value that repeated all-reduces keep bounded (the timed loop does not re-fill)."""
    if op == "sum":
        return 0.0
    if op == "product":
        return 1.0
    return float(rank + 1)


def quartiles(samples: List[float]) -> List[float]:
    """[median, first quartile, third quartile] of ``samples``; NaN when empty."""
    if not samples:
        return [float("nan")] * 3
    if len(samples) == 1:
        return [samples[0]] * 3
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return [median, q1, q3]


def matches(result: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``result`` is the closed-form ``expected`` (exact, or within _RTOL for floats)."""
    if result.dtype.is_floating_point:
        return bool(torch.allclose(result, expected, rtol=_RTOL[result.dtype], atol=0.0))
    return bool(torch.equal(result, expected))


def _us(seconds: float) -> Optional[float]:
    return None if math.isnan(seconds) else seconds * 1e6


# ---------------------------------------------------------------------------
# The runner interface and the sweep every runner goes through
# ---------------------------------------------------------------------------

class Runner:
    """One column of the table: one in-place all-reduce of a buffer through some backend.

    ``name`` heads the column; ``backend`` and ``algo`` go into its rows; a peer
    (``is_peer``) is measured for comparison: a dtype or op it cannot run is reported,
    not counted as a failure.
    """

    name: str = ""
    backend: str = ""
    algo: Optional[str] = None
    is_peer: bool = False

    def select(self) -> None:
        """Make this column's settings current; called before each batch of its calls."""

    def selected(self, nbytes: int) -> Optional[str]:
        """What this column runs at ``nbytes`` when it chooses by itself (pycomm's auto)."""
        return None

    def call(self, buffer: torch.Tensor) -> None:
        """One all-reduce of ``buffer`` in place."""
        raise NotImplementedError

    def release(self) -> None:
        """Called after the timed samples of every size."""


class Control:
    """How the ranks agree on statuses and figures, never through the backend under test."""

    def min_ints(self, values: List[int]) -> List[int]:
        """Element-wise minimum over ranks."""
        raise NotImplementedError

    def max_floats(self, rows: List[List[float]]) -> List[List[float]]:
        """Element-wise maximum over ranks."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


def byte_sizes(cfg: BenchConfig) -> Tuple[List[int], int]:
    """The sweep's sizes rounded down to whole elements of ``cfg.dtype`` (sizes below one
    element and duplicates dropped), and how many were dropped."""
    element_size = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
    swept = size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor)
    sizes: List[int] = []
    for size in swept:
        count = size // element_size
        if count > 0 and count * element_size not in sizes:
            sizes.append(count * element_size)
    return sizes, len(swept) - len(sizes)


def time_samples(runners: Sequence[Runner], timed: Sequence[int], buffer: torch.Tensor, iters: int,
                 block: int, realign: bool,
                 barrier: Optional[Callable[[], None]] = None,
                 exits: Optional[List[List[float]]] = None) -> List[List[float]]:
    """Seconds per call, ``iters`` samples of each column in ``timed`` (indices into ``runners``).

    Rounds interleave the columns (the starting column rotates each round) so that load
    changing over time on a shared host affects every column alike. Without ``barrier``
    (``--timing block``) a sample is ``block`` calls timed together, divided by ``block``;
    with ``realign`` it follows one untimed call of its own column. With ``barrier``
    (``--timing barrier``; the control group's, never the backend under test) a sample is
    ``barrier()`` then one timed call; ``block`` and ``realign`` are not used, and ``exits``
    (one list per runner), when given, receives the ``time.perf_counter()`` at which each
    sample left the barrier (CLOCK_MONOTONIC: comparable between processes of one host).
    """
    times: List[List[float]] = [[] for _ in runners]
    for round_index in range(iters):
        shift = round_index % len(timed) if timed else 0
        for i in list(timed[shift:]) + list(timed[:shift]):
            runner = runners[i]
            runner.select()
            call = runner.call
            if barrier is not None:
                barrier()
                start = time.perf_counter()
                call(buffer)
                times[i].append(time.perf_counter() - start)
                if exits is not None:
                    exits[i].append(start)
                continue
            if realign:
                call(buffer)
            start = time.perf_counter()
            for _ in range(block):
                call(buffer)
            times[i].append((time.perf_counter() - start) / block)
    return times


def run_sweep(cfg: BenchConfig, runners: Sequence[Runner], control: Control, rank: int, world_size: int,
              sizes: Sequence[int],
              on_size: Optional[Callable[[int, int, List[Dict[str, Any]]], None]] = None,
              realign: Optional[bool] = None,
              same_clock: bool = True,
              barrier: Optional[Callable[[], None]] = None) -> Tuple[List[Dict[str, Any]], bool]:
    """Every size of ``sizes`` through every runner: check, warm up, time; ``(rows, ok)``.

    Per size, each runner first reduces the closed-form pattern (``cfg.check``) and runs its
    warm-up calls; a runner that raises there (a dtype or op it cannot run, the same on
    every rank) is marked ERR and left out of the timing. Then :func:`time_samples` in
    ``cfg.timing``'s discipline (``barrier``: ``control.barrier`` before each call;
    ``shm-barrier``: ``barrier``, the caller's :class:`~.shm_barrier.ShmBarrier`), with
    ``realign`` when columns alternate unless ``realign`` says otherwise. With ``barrier``
    timing and ``same_clock`` (every rank on this host's clock), each row also gives the
    barrier's exit skew: the median over samples of the latest rank's exit minus the
    earliest's. The earliest rank's time includes it, so the slowest rank's time is at
    least about the skew, whatever the call costs. ``on_size(nbytes,
    count, rows)`` sees each size's rows as they are made.
    """
    dtype = DTYPES[cfg.dtype]
    op_name = cfg.op_name
    element_size = torch.empty((), dtype=dtype).element_size()
    period = pattern_period(dtype, op_name, world_size) if cfg.check else 1
    if cfg.check:
        in_block, expected_block = pattern_blocks(op_name, rank, world_size, period)

    rows: List[Dict[str, Any]] = []
    all_ok = True
    for nbytes in sizes:
        count = nbytes // element_size
        iters, warmup = iterations_for(nbytes, cfg.iters, cfg.warmup)
        buffer = torch.empty(count, dtype=dtype)
        if cfg.check:
            pattern = tiled(in_block, count, dtype)
            expected = tiled(expected_block, count, dtype)
        statuses = [-1] * len(runners)  # 1 OK, 0 FAIL, -1 not checked, -2 error
        errors: List[Optional[str]] = [None] * len(runners)
        selected: List[Optional[str]] = [None] * len(runners)

        # Phase 1, per runner: correctness on the closed-form pattern, then warm-up.
        # A usage error (unsupported dtype/op) is raised on every rank alike;
        # it marks that runner ERR and the sweep goes on.
        for i, runner in enumerate(runners):
            try:
                runner.select()
                selected[i] = runner.selected(nbytes)
                if cfg.check and getattr(runner, "exact", True):  # lossy columns (compressed) are not checked
                    buffer.copy_(pattern)
                    runner.call(buffer)
                    statuses[i] = 1 if matches(buffer, expected) else 0
                buffer.fill_(stable_fill(op_name, rank))
                for _ in range(warmup):
                    runner.call(buffer)
            except Exception as exc:
                statuses[i] = -2
                errors[i] = f"{type(exc).__name__}: {exc}"
        # Every rank must agree on which runners are timed, or collectives would pair up wrongly.
        agreed = control.min_ints(statuses)
        timed = [i for i in range(len(runners)) if agreed[i] != -2]

        # Phase 2: timed samples.
        buffer.fill_(stable_fill(op_name, rank))
        barrier_timing = cfg.timing != "block"
        exits: List[List[float]] = [[] for _ in runners]
        times = time_samples(runners, timed, buffer, iters, block_for(nbytes),
                             len(timed) > 1 if realign is None else realign,
                             barrier=(barrier or control.barrier) if barrier_timing else None,
                             exits=exits)
        skews: List[Optional[float]] = [None] * len(runners)
        if barrier_timing and same_clock and timed:
            # Latest and (negated) earliest exit of every sample, over ranks.
            latest = control.max_floats([exits[i] for i in timed] + [[-t for t in exits[i]] for i in timed])
            for k, i in enumerate(timed):
                spread = [late + early for late, early in zip(latest[k], latest[len(timed) + k])]
                skews[i] = statistics.median(spread) * 1e6
        for runner in runners:
            runner.release()
        # Slowest rank's median, first and third quartile; a check passes only if it passed everywhere.
        stats = control.max_floats([quartiles(t) for t in times])

        size_rows = []
        for i, runner in enumerate(runners):
            seconds = stats[i][0]
            check = {1: "OK", 0: "FAIL", -1: "SKIP", -2: "ERR"}[agreed[i]]
            if math.isnan(seconds):
                check = "ERR"
            # A peer that cannot run this dtype/op (gloo has no int16) is reported,
            # not counted as a failure; a wrong result from anyone is.
            if check == "FAIL" or (check == "ERR" and not runner.is_peer):
                all_ok = False
            algbw = alg_bandwidth(nbytes, seconds) if not math.isnan(seconds) else None
            busbw = bus_bandwidth(algbw, world_size) if algbw is not None else None
            size_rows.append({
                "size_bytes": nbytes,
                "count": count,
                "dtype": cfg.dtype,
                "op": op_name,
                "world_size": world_size,
                "name": runner.name,
                "backend": runner.backend,
                "algo": runner.algo,
                "selected": selected[i],
                "peer": runner.is_peer,
                "iters": iters,
                "warmup": warmup,
                "timing": cfg.timing,
                "barrier_skew_us": skews[i],
                "time_us": _us(seconds),
                "time_us_q1": _us(stats[i][1]),
                "time_us_q3": _us(stats[i][2]),
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
        if on_size is not None:
            on_size(nbytes, count, size_rows)
    return rows, all_ok
