"""A barrier of the benchmark's own for ranks on one host (``--timing shm-barrier``).

Each rank owns one cache line of a small file in /dev/shm and writes its barrier
generation there; a rank leaves the barrier once every line holds at least its
generation, polling with ``sched_yield`` in between (as Open MPI waits on an
oversubscribed node). It is the same Python code in every column, pycomm's, gloo's and
Open MPI's, and it uses none of them, so "barrier, then one call" compares the calls
and not the control group's barrier: gloo's barrier lets 4 ranks on 2 busy cores go
hundreds of microseconds apart, and the first rank out waits that long in its call.

The file is made by rank 0 under a random name, mapped by everyone, and removed by
rank 0 as soon as every rank said it mapped it, so nothing is left behind whatever
happens to the ranks later.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from typing import Any, Callable, Optional

import numpy as np

from .config import PREFIX

__all__ = ["ShmBarrier"]

# One 64-byte line per rank: int64 generation at its start.
_LINE_WORDS = 8
_CHECK_EVERY = 1024  # polls between deadline checks


class ShmBarrier:
    """``barrier()`` for the ``world_size`` ranks of one host.

    ``broadcast(value)`` returns rank 0's ``value`` on every rank and ``sync()`` is a
    barrier of the control group; both are used only here, while it is made.
    """

    def __init__(self, rank: int, world_size: int, broadcast: Callable[[Any], Any],
                 sync: Callable[[], None], timeout_s: float):
        self._rank = rank
        self._timeout_s = timeout_s
        self._generation = 0
        size = max(mmap.PAGESIZE, world_size * _LINE_WORDS * 8)
        path: Optional[str] = None
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="pycomm-bench-barrier-", dir=_shm_dir())
            os.ftruncate(fd, size)
            os.close(fd)
        path = broadcast(path)
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        finally:
            sync()  # everyone mapped it (or failed): the name can go
            if rank == 0:
                os.unlink(path)
        words = np.frombuffer(self._map, dtype=np.int64, count=world_size * _LINE_WORDS)
        self._lines = words[::_LINE_WORDS]  # a view: rank j's generation is self._lines[j]

    def __call__(self) -> None:
        self._generation += 1
        generation = self._generation
        lines = self._lines
        lines[self._rank] = generation
        polls = 0
        deadline = None
        while (lines < generation).any():
            os.sched_yield()
            polls += 1
            if polls % _CHECK_EVERY == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._timeout_s
                elif now > deadline:
                    late = [j for j in range(len(lines)) if lines[j] < generation]
                    raise RuntimeError(f"{PREFIX} shm barrier {generation}: ranks {late} did not arrive "
                                       f"in {self._timeout_s:g} s")

    def close(self) -> None:
        self._lines = None
        self._map.close()


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
