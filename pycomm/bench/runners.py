"""The torch.distributed runners: pycomm with a fixed algorithm, and any other backend
(gloo as the peer, or as the backend under test), plus the gloo control group."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .sweep import PREFIX, Control, Runner

__all__ = ["PycommRunner", "TorchControl", "TorchRunner", "import_pycomm"]


def import_pycomm():
    """``import pycomm`` (registers the backend), or a ``pycomm bench:`` RuntimeError saying
    how to build it."""
    try:
        import pycomm  # noqa: F401  (registers the "pycomm" backend)
    except ImportError as exc:
        raise RuntimeError(
            f"{PREFIX} cannot import pycomm ({exc}); build it with "
            "`pip install --no-build-isolation -e .`, or pass --backend gloo to test the harness"
        ) from exc
    for name in ("set_algorithm", "get_algorithm", "select_algorithm"):
        if not hasattr(pycomm, name):
            raise RuntimeError(
                f"{PREFIX} pycomm has no {name}() (is the package built? imported from "
                f"{getattr(pycomm, '__path__', '?')}); pass --backend gloo to test the harness"
            )
    return pycomm


class TorchRunner(Runner):
    """``dist.all_reduce`` on ``group`` (None: the default group)."""

    def __init__(self, name: str, backend: str, op: Any, group: Any = None, is_peer: bool = False):
        self.name = name
        self.backend = backend
        self.algo = None
        self.is_peer = is_peer
        self.op = op
        self.group = group

    def call(self, buffer: torch.Tensor) -> None:
        dist.all_reduce(buffer, op=self.op, group=self.group)


class PycommRunner(TorchRunner):
    """pycomm's default group with one all-reduce algorithm fixed (``pycomm.set_algorithm``);
    for ``auto``, the rows name the algorithm pycomm picked at each size."""

    def __init__(self, pycomm, algo: str, op: Any):
        super().__init__(algo, "pycomm", op)
        self.algo = algo
        self._pycomm = pycomm

    def select(self) -> None:
        self._pycomm.set_algorithm(self.algo)

    def selected(self, nbytes: int) -> Optional[str]:
        return self._pycomm.select_algorithm(nbytes) if self.algo == "auto" else None

    def release(self) -> None:
        self._pycomm.set_algorithm("auto")


class TorchControl(Control):
    """Agreement over a gloo group of its own."""

    def __init__(self, group):
        self.group = group

    def min_ints(self, values: List[int]) -> List[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t]

    def max_floats(self, rows: List[List[float]]) -> List[List[float]]:
        t = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def barrier(self) -> None:
        dist.barrier(group=self.group)
