"""What every hook shares: the group queries, the abort-on-error wrapper, the futures' helpers,
the seed mixer and the checks of states and state dicts."""
import functools
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist

_STATE_VERSION = 2  # 2: each rank's tensors under a key of its own (rank<r>), with its rank and world size
_MASK64 = (1 << 64) - 1

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _is_pycomm(group) -> bool:
    """Whether ``group`` (None: the default group) runs on the pycomm backend."""
    return _pycomm_backend(group) is not None


def _pycomm_backend(group):
    """The group's ProcessGroupPycomm, or None when it runs on another backend."""
    try:
        from .. import _C

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
        return backend if isinstance(backend, _C.ProcessGroupPycomm) else None
    except Exception:  # noqa: BLE001  (no such backend on the group, or not initialised)
        return None


def _aborts_group_on_error(op: str) -> Callable[[Callable], Callable]:
    """Wraps a hook: when it raises on this rank, a pycomm group is aborted first, telling
    the peers why. A hook that raises before its collective is issued (a residual of the
    wrong size after one rank loaded another model's state, say) otherwise leaves the
    other ranks waiting in that collective until the group's timeout; now they fail at once
    with "rank R aborted the group: its topk_hook raised ValueError: ...". The group is of
    no further use either way: the ranks' calls no longer line up. Other backends cannot
    be aborted from here; their ranks wait as before."""
    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)  # keeps the annotations DDP checks (inspect follows __wrapped__)
        def run(state, bucket):
            try:
                return hook(state, bucket)
            except TypeError:
                raise  # a state of the wrong type: every rank's alike, and the group stays usable
            except Exception as exc:
                backend = _pycomm_backend(getattr(state, "process_group", None))
                if backend is not None:
                    backend.abort_with_reason(f"its {op} raised {type(exc).__name__}: {exc}")
                raise
        return run
    return wrap


def _copied_into(buffer: torch.Tensor):
    def finish(fut):
        buffer.copy_(_future_tensor(fut))  # re-raises a failed collective
        return buffer
    return finish


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _dense_allreduce(buffer: torch.Tensor, group, world: int) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` in place: scale by 1/world first, then SUM. DDP without a hook
    does the same (it multiplies by 1/world as it copies gradients into the bucket), so
    the results are bit-identical to it."""
    buffer.mul_(1.0 / world)
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _all_gather_bytes(payload: torch.Tensor, group, world: int) -> Tuple[torch.futures.Future, torch.Tensor]:
    """All-gather one uint8 payload per rank; returns (future, [world, len] output)."""
    out = payload.new_empty(world * payload.numel())
    fut = _all_gather_single(out, payload, group=group, async_op=True).get_future()
    return fut, out.view(world, payload.numel())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def _future_tensor(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


def _returned(buffer: torch.Tensor):
    def finish(fut):
        _future_tensor(fut)  # re-raises a failed collective
        return buffer
    return finish


def _averaged_into(buffer: torch.Tensor, world: int):
    def finish(fut):
        total = _future_tensor(fut)  # re-raises a failed collective
        if total.dtype == buffer.dtype:
            torch.div(total, world, out=buffer)
        else:
            buffer.copy_(total.div_(world))
        return buffer
    return finish


def _check_kind(op: str, state: Dict[str, Any], kind: str) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"pycomm {op}: load_state_dict expects a dict (got {type(state).__name__})")
    got = state.get("kind")
    if got != kind:
        raise ValueError(f"pycomm {op}: this state_dict is of a {got!r} hook, not {kind!r}")
    version = state.get("version", _STATE_VERSION)
    if version > _STATE_VERSION:
        raise ValueError(f"pycomm {op}: state_dict version {version} is newer than this pycomm "
                         f"understands ({_STATE_VERSION})")


def _check_state(op: str, state, cls) -> None:
    if not isinstance(state, cls):
        raise TypeError(f"pycomm {op}: state must be a {cls.__name__} (got {type(state).__name__}); "
                        f"register it as ddp.register_comm_hook({cls.__name__}(...), {op})")
