"""The sweep every runner of the benchmark goes through (nccl-tests' common.cu): the sizes,
iteration counts and the sampling discipline; the settings live in :mod:`.config`, the
closed-form check patterns in :mod:`.patterns`, the figures in :mod:`.figures`.

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

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .config import (MPI_DTYPES, MPI_OPS, OPS, DTYPES, PREFIX, TIMINGS, BenchConfig, BenchResult, Control,
                     Runner, format_size, parse_size, size_arg, size_sweep)
from .figures import MEMCPY_BYTES, MEMCPY_REPEATS, _us, alg_bandwidth, bus_bandwidth, memcpy_bandwidth, quartiles
from .patterns import EXACT_LIMIT, matches, pattern_blocks, pattern_period, stable_fill, tiled

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

#: Sizes at or above this get proportionally fewer iterations.
LARGE_BYTES = 16 * 2 ** 20
# Small messages are timed in blocks of back-to-back calls. Every sample follows one
# untimed call of the same run when several runs alternate: it realigns the ranks
# (the previous column's call may finish at different times on different ranks, and
# that skew would otherwise land in this column's time).
BLOCK_SMALL_BYTES, BLOCK_SMALL = 64 * 2 ** 10, 16
BLOCK_MEDIUM_BYTES, BLOCK_MEDIUM = 2 ** 20, 4
MIN_LARGE_ITERS = 3


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
