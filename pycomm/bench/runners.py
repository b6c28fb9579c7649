"""The torch.distributed runners: pycomm with a fixed algorithm, and any other backend
(gloo as the peer, or as the backend under test), plus the gloo control group."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .config import PREFIX, Control, Runner, compressed_spec  # noqa: F401  (compressed_spec: its old home)

__all__ = ["CompressedRunner", "PycommRunner", "TorchControl", "TorchRunner", "compressed_spec", "import_pycomm"]


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


class _OneBucket:
    """The buffer as a DDP GradBucket of one parameter, the last of its step."""

    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> List[torch.Tensor]:
        return [self._buffer]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class CompressedRunner(TorchRunner):
    """One bucket through a compressed DDP hook of pycomm.hooks on the default group, as
    DDP would run it: encode (with error feedback), pycomm's compressed all-reduce, and
    the average written back into the buffer. Lossy, so not checked against the
    closed-form sum (the check column says SKIP); its state (residuals) lives as long as
    the column. Each call first copies a gradient-like buffer in (normal values, seeded
    by the rank and size; the copy is timed too, as DDP's copy into its bucket would
    be): the sweep's constant fill is all ties, which top-k's exact selection handles
    far more slowly than real gradients (benchmarks/results/topk_ties.txt)."""

    exact = False

    def __init__(self, name: str, kind: str, value: float, op: Any):
        super().__init__(name, "pycomm", op)
        self.algo = name
        from .. import hooks

        if kind == "topk":
            self._state, self._hook = hooks.TopKState(density=value), hooks.topk_hook
        else:
            self._state, self._hook = hooks.QuantizeState(bits=int(value)), hooks.quantize_hook

    _grads: dict = {}

    def call(self, buffer: torch.Tensor) -> None:
        grad = self._grads.get(buffer.numel())
        if grad is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            generator = torch.Generator().manual_seed(1000003 * rank + buffer.numel())
            grad = self._grads[buffer.numel()] = torch.randn(buffer.numel(), generator=generator)
        buffer.copy_(grad)
        self._hook(self._state, _OneBucket(buffer)).wait()
