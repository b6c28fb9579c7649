"""Registration of the "pycomm" torch.distributed backend and per-group controls."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os

import torch
import torch.distributed as dist

from . import _C
from .config import bind_address, group_config, load_config, with_settings

__all__ = [
    "BACKEND_NAME",
    "register",
    "set_algorithm",
    "get_algorithm",
    "select_algorithm",
    "last_algorithm",
    "monitored_barrier",
    "init_process_group",
]

BACKEND_NAME = "pycomm"


def _timedelta(timeout) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _store_prefix() -> str:
    # torchrun lets every restart attempt share the agent's store, where the failed
    # attempt's keys remain: keep each attempt's keys apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"pycomm/attempt{attempt}/"


def _shared_cost_model(store, rank: int, model):
    """Rank 0's cost model, on every rank: `auto` must choose the same algorithm
    everywhere, and hosts may hold different calibrations. One store round trip."""
    key = _store_prefix() + "cost_model"
    if rank == 0:
        store.set(key, json.dumps(model))
        return model
    return json.loads(store.get(key).decode())


def _create_backend(dist_opts, backend_options=None):
    # pg_options: PYCOMM_* settings over the environment (config.with_settings)
    config = load_config(with_settings(backend_options))
    if dist_opts.group_size > 1:
        config = dataclasses.replace(
            config, cost_model=_shared_cost_model(dist_opts.store, dist_opts.group_rank, config.cost_model))
    options = group_config(
        config,
        timeout=_timedelta(dist_opts.timeout),
        bind_address=bind_address(config, dist_opts.store),
        global_ranks=dist_opts.global_ranks_in_group,
        store_prefix=_store_prefix(),
    )
    return _C.ProcessGroupPycomm(
        store=dist_opts.store, rank=dist_opts.group_rank, size=dist_opts.group_size, config=options
    )


def register() -> None:
    """Registers the backend with torch.distributed (done by `import pycomm`)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    # cpu, and every device type with a device seam (csrc/backend/device_seam.h): the
    # CUDA build also takes CUDA tensors, staged through pinned host memory
    # (cuda_staging.h); the CPU build is registered for cpu only.
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=_C._devices())


def _default_group_is_pycomm() -> bool:
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):  # no CPU backend in the default group
        return False
    return isinstance(backend, _C.ProcessGroupPycomm)


def init_process_group(init_method=None, *, timeout=None, world_size: int = -1, rank: int = -1,
                       store=None, group_name: str = "", device_id=None, **kwargs) -> None:
    """``dist.init_process_group(backend="pycomm", ...)``, idempotent: for code that
    runs before a framework which creates the group itself (Accelerate, the
    transformers Trainer) or may be run twice (notebooks).

    No default group yet: creates one with the pycomm backend (the arguments are
    torch's; rank and world size come from the environment as usual, e.g. under
    torchrun). A default group whose CPU backend is pycomm already: returns
    quietly, unless ``world_size`` or ``rank`` is given and differs from it
    (ValueError). A default group of another backend: RuntimeError naming it."""
    op = "pycomm init_process_group"
    if dist.is_initialized():
        if not _default_group_is_pycomm():
            raise RuntimeError(
                f"{op}: the default process group already exists with backend "
                f"{dist.get_backend()!r}, not {BACKEND_NAME!r}; call this before the code that "
                f"created it, or dist.destroy_process_group() first"
            )
        have = {"world_size": dist.get_world_size(), "rank": dist.get_rank()}
        asked = {"world_size": world_size, "rank": rank}
        for name, value in asked.items():
            if value is not None and value >= 0 and value != have[name]:
                raise ValueError(f"{op}: the pycomm default group exists with {name}={have[name]}, "
                                 f"not the {name}={value} asked for")
        return
    if timeout is not None:
        timeout = _timedelta(timeout)
    dist.init_process_group(BACKEND_NAME, init_method=init_method, timeout=timeout, world_size=world_size,
                            rank=rank, store=store, group_name=group_name, device_id=device_id, **kwargs)


def _backend_of(group) -> "_C.ProcessGroupPycomm":
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupPycomm):
        raise ValueError(
            f"pycomm: the group's CPU backend is {type(backend).__name__}, not pycomm"
        )
    return backend


def set_algorithm(name: str, group=None) -> None:
    """Fixes the all-reduce algorithm of `group` (default group if None): a name
    of `pycomm.config.ALGORITHMS` ("ring", "tree", "sharded", "shm", ...), or
    "auto" to let the cost model choose."""
    _backend_of(group).set_algorithm(name)


def get_algorithm(group=None) -> str:
    """The algorithm setting of `group` ("auto" unless fixed)."""
    return _backend_of(group).get_algorithm()


def select_algorithm(nbytes: int, group=None) -> str:
    """The algorithm an all-reduce of `nbytes` bytes would use on `group`."""
    return _backend_of(group).select_algorithm(int(nbytes))


def last_algorithm(group=None) -> str:
    """The algorithm the last all-reduce on `group` used ("" before the first)."""
    return _backend_of(group).last_algorithm()


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for a pycomm group, which torch's own
    refuses ("only implemented for GLOO backend") before it reaches the backend.

    The same contract as gloo's: every rank but 0 tells rank 0 it arrived and waits for
    its answer; rank 0 waits up to ``timeout`` (a timedelta or seconds; default torch's
    30 minutes) and raises ``Rank 1 failed to pass monitoredBarrier in 2000 ms`` for the
    first rank that did not arrive, or with ``wait_all_ranks`` for all of them (``Ranks
    1, 2 failed ...``); a rank 0 out of time before it comes to a rank that has not
    arrived says ``Rank 0 timed out in monitoredBarrier after N ms.`` and the ranks it
    processed, as gloo. The ranks that did arrive raise too, saying rank 0 found a fault.
    After a failure the group is unusable, as after any pycomm failure. A group whose
    CPU backend is not pycomm goes to ``torch.distributed.monitored_barrier``."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return  # as torch's: a rank outside the group has nothing to wait for
    timeout = dist.constants.default_pg_timeout if timeout is None else _timedelta(timeout)
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"pycomm monitored_barrier: timeout must be positive (got {timeout})")
    if not isinstance(group._get_backend(torch.device("cpu")), _C.ProcessGroupPycomm):
        dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all_ranks)
        return
    group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
