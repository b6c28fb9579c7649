"""The figures of a row, as nccl-tests computes them: algorithm and bus bandwidth, the
quartiles of the samples, and this host's memcpy bandwidth for reference."""

from __future__ import annotations

import math
import statistics
import time
from typing import List, Optional

from .config import PREFIX

MEMCPY_BYTES = 64 * 2 ** 20
MEMCPY_REPEATS = 10


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


def quartiles(samples: List[float]) -> List[float]:
    """[median, first quartile, third quartile] of ``samples``; NaN when empty."""
    if not samples:
        return [float("nan")] * 3
    if len(samples) == 1:
        return [samples[0]] * 3
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return [median, q1, q3]


def _us(seconds: float) -> Optional[float]:
    return None if math.isnan(seconds) else seconds * 1e6
