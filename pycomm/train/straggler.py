"""Straggler injection (``--straggler RANK:FACTOR``), for every strategy.

Rank RANK sleeps after the local part of each optimizer step (forward, backward,
optimizer step) so that the step takes FACTOR times the compute time it measured for
itself: it sleeps ``(FACTOR - 1) * compute_s``. The sleep comes before the strategy's
communication of that step (averaging, gossip, aggregation), so the peers feel it
where they would feel a slow machine. Other ranks are not touched.

With ``sync`` the measured time includes the part of DDP's gradient all-reduce that
does not overlap the backward; on the straggler that is mostly its own compute, as the
others are faster.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

__all__ = ["parse_straggler", "check_straggler_rank", "Straggler"]

from .base import _PREFIX


def parse_straggler(spec: str) -> Tuple[int, float]:
    """``"RANK:FACTOR"`` -> (rank, factor); ValueError (``pycomm train: ...``) when malformed."""
    text = str(spec).strip()
    rank_text, sep, factor_text = text.partition(":")
    try:
        if not sep:
            raise ValueError
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise ValueError(f"{_PREFIX} straggler must be RANK:FACTOR, e.g. 1:3 (got {spec!r})") from None
    if rank < 0:
        raise ValueError(f"{_PREFIX} straggler rank must be >= 0 (got {rank})")
    if not factor >= 1.0 or factor == float("inf"):
        raise ValueError(f"{_PREFIX} straggler factor must be a finite number >= 1 (got {factor_text})")
    return rank, factor


def check_straggler_rank(spec: Optional[str], world_size: int) -> None:
    """ValueError when the straggler's rank is not one of ``world_size`` ranks."""
    if spec is None:
        return
    rank, _ = parse_straggler(spec)
    if rank >= world_size:
        raise ValueError(f"{_PREFIX} straggler rank {rank} does not exist: the job has {world_size} "
                         f"rank(s), 0..{world_size - 1}")


class Straggler:
    """Sleeps on the chosen rank; a no-op everywhere else (and when ``spec`` is None)."""

    def __init__(self, spec: Optional[str], rank: int, world_size: int):
        check_straggler_rank(spec, world_size)
        self.factor = 1.0
        if spec is not None:
            straggler_rank, factor = parse_straggler(spec)
            if straggler_rank == rank:
                self.factor = factor
        self.slept_s = 0.0    # total injected sleep
        self.compute_s = 0.0  # total measured compute of the steps it slowed

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def delay(self, compute_s: float) -> float:
        """Sleep (FACTOR - 1) x ``compute_s``; returns the seconds slept."""
        if not self.active:
            return 0.0
        pause = (self.factor - 1.0) * max(0.0, compute_s)
        start = time.perf_counter()
        time.sleep(pause)
        slept = time.perf_counter() - start
        self.slept_s += slept
        self.compute_s += compute_s
        return slept
