"""allreduce_hook: dense averaging, the same numbers as DDP without a hook."""
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..config import ALGORITHMS as _ALGORITHMS  # "auto" and the C++ table's names
from ._common import _STATE_VERSION, _aborts_group_on_error, _check_kind, _dense_allreduce, _group_size, _is_pycomm


class AllreduceState:
    """State of :func:`allreduce_hook`: the process group and the all-reduce algorithm.

    ``algorithm`` (``"auto"`` or a name of ``pycomm.config.ALGORITHMS``; None keeps
    the group's setting) is applied with :func:`pycomm.set_algorithm` on the first call, so
    it is a setting of the whole group, not of this hook alone. It needs a pycomm group
    (other backends accept only None or ``"auto"``)."""

    def __init__(self, process_group=None, algorithm: Optional[str] = None):
        if algorithm is not None and algorithm not in _ALGORITHMS:
            raise ValueError(f"pycomm allreduce_hook: algorithm must be one of {', '.join(_ALGORITHMS)} "
                             f"or None (got {algorithm!r})")
        self.process_group = process_group
        self.algorithm = algorithm
        self.step = 0
        self._applied = False

    def _apply_algorithm(self) -> None:
        if self._applied:
            return
        self._applied = True
        if self.algorithm is None:
            return
        if _is_pycomm(self.process_group):
            from .._backend import set_algorithm

            set_algorithm(self.algorithm, self.process_group)
        elif self.algorithm != "auto":
            raise ValueError(f"pycomm allreduce_hook: algorithm {self.algorithm!r} needs a pycomm process "
                             f"group (this group's backend is {dist.get_backend(self.process_group)})")

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "allreduce", "version": _STATE_VERSION, "step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_kind("allreduce_hook", state, "allreduce")
        self.step = int(state.get("step", 0))


@_aborts_group_on_error("allreduce_hook")
def allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Dense gradient averaging (the same numbers as DDP without a hook). ``state``: an
    :class:`AllreduceState`, a process group, or None (default group)."""
    if isinstance(state, AllreduceState):
        state._apply_algorithm()
        group = state.process_group
        if bucket.is_last():
            state.step += 1
    else:
        group = state
    buffer = bucket.buffer()
    return _dense_allreduce(buffer, group, _group_size(group))
