"""Communication strategies: how the ranks of a data-parallel run keep their models in step.

Each strategy wraps the model in ``DistributedDataParallel`` (which broadcasts rank 0's
parameters at construction) and tells the trainer two things per optimizer step:

* :meth:`Strategy.sync_gradients` -- whether DDP all-reduces the gradients of this step
  (the trainer runs the backward under ``no_sync()`` otherwise);
* :meth:`Strategy.after_step` -- what to do with the parameters after ``optimizer.step()``.

Strategies:

``sync``       (:class:`SyncStrategy`) synchronous data parallel: every step averages the
               gradients through a DDP comm hook (:func:`pycomm.hooks.allreduce_hook`, torch's
               fp16 / bf16 compress hooks, pycomm's ``topk`` / ``quantize`` / ``powersgd`` hooks,
               torch's ``torch_powersgd``, or any hook
               registered with :func:`register_hook` or named as ``package.module:attribute``).
``local_sgd``  (:class:`LocalSGDStrategy`) Lin et al. 2018: after an optional warm-up of
               synchronous steps, each rank steps on its own gradients and the models are
               averaged every H steps.
``easgd``      (:class:`EASGDStrategy`) synchronous elastic averaging SGD (Zhang,
               Choromanska, LeCun 2015): every tau steps each worker moves towards a centre
               variable, and the centre towards the workers' mean, by the moving rate alpha.
               The centre is stored sharded: rank r owns 1/n of it.

Comm hooks: anything usable as ``ddp.register_comm_hook(state, hook)``. A hook is
registered under a name with a *state factory* ``factory(process_group) -> state``; if
the state has ``state_dict()`` / ``load_state_dict()`` it is saved in checkpoints.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from .. import hooks
from ..hooks import allreduce_hook
from .base import _PREFIX, register_strategy, strategy_spec, StrategySpec

__all__ = [
    "allreduce_hook",
    "register_hook",
    "resolve_hook",
    "hook_names",
    "Strategy",
    "SyncStrategy",
    "LocalSGDStrategy",
    "EASGDStrategy",
    "build_strategy",
    "flat_parameters",
]


# ---------------------------------------------------------------------------
# comm hooks
# ---------------------------------------------------------------------------

def _group_state(group):
    return group


def _torch_powersgd_state(group):
    """torch's own PowerSGD (rank 1, error feedback, warm start), for side-by-side runs with
    ``powersgd``; it needs 2 dense steps first (DDP rebuilds its buckets after step 1)."""
    return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)


# The hooks selectable by name without registering anything: name -> (hook, state factory).
# The state of the dense and 16-bit hooks is the process group itself.
_BUILTIN_HOOKS: Dict[str, "tuple[Callable, Callable]"] = {
    "allreduce": (allreduce_hook, _group_state),
    "fp16": (default_hooks.fp16_compress_hook, _group_state),
    "bf16": (default_hooks.bf16_compress_hook, _group_state),
    "topk": (hooks.topk_hook, hooks.TopKState),
    "quantize": (hooks.quantize_hook, hooks.QuantizeState),
    "powersgd": (hooks.powersgd_hook, hooks.PowerSGDState),
    "torch_powersgd": (powerSGD_hook.powerSGD_hook, _torch_powersgd_state),
}

# Every name --hook takes: the built-ins from the start, so a hook registered before the
# first lookup adds to them instead of standing alone.
_HOOKS: Dict[str, "tuple[Callable, Callable]"] = dict(_BUILTIN_HOOKS)


def register_hook(name: str, hook: Callable, state_factory: Callable[[Any], Any] = _group_state) -> None:
    """Make ``hook`` selectable as ``--hook name``; ``state_factory(process_group)`` builds its state."""
    if not callable(hook) or not callable(state_factory):
        raise TypeError(f"{_PREFIX} register_hook({name!r}): hook and state_factory must be callable")
    _HOOKS[name] = (hook, state_factory)


def hook_names() -> "tuple[str, ...]":
    return tuple(sorted(_HOOKS))


def resolve_hook(spec: Any, group=None) -> "tuple[Callable, Any]":
    """``(hook, state)`` for a registered name, a ``package.module:attribute`` path, or a callable."""
    if callable(spec):
        return spec, group
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{_PREFIX} hook must be a name or a callable (got {spec!r})")
    if spec in _HOOKS:
        hook, factory = _HOOKS[spec]
        return hook, factory(group)
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            hook = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"{_PREFIX} cannot import hook {spec!r}: {exc}") from None
        if not callable(hook):
            raise ValueError(f"{_PREFIX} hook {spec!r} is not callable")
        return hook, group
    raise ValueError(f"{_PREFIX} unknown hook {spec!r} (choose from {', '.join(hook_names())}, "
                     f"or give package.module:attribute)")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def flat_parameters(module: nn.Module) -> torch.Tensor:
    """All parameters of ``module`` in one new 1-D tensor (float32 copies)."""
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def mean_model(module: nn.Module, control_group, world_size: int) -> nn.Module:
    """A copy of ``module`` holding the mean of every rank's parameters (collective:
    one all-reduce over ``control_group``, so the run's byte counters do not see it)."""
    import copy

    flat = flat_parameters(module).cpu()
    dist.all_reduce(flat, group=control_group)
    model = copy.deepcopy(module)
    _assign_flat(model, flat.div_(world_size))
    return model


def _assign_flat(module: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            n = p.numel()
            p.copy_(flat[offset: offset + n].view_as(p))
            offset += n


# torch >= 2.12 names them *_single; older versions only have *_into_tensor / *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Timer:
    """Wall time spent in a strategy's blocking communication."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def __call__(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


# ---------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------

def _no_forward_buffer_sync(ddp_class) -> Dict[str, bool]:
    """DDP's keyword for no buffer broadcast before each forward: torch 2.13 names it
    forward_sync_buffers=False (broadcast_buffers is deprecated there, with a warning);
    torch 2.11, the GPU machine's, has only broadcast_buffers=False, which also leaves
    buffers out of DDP's initial sync (the models here are built alike on every rank)."""
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class Strategy:
    """Base class: synchronous gradients every step, no parameter communication."""

    name = "base"
    per_rank_models = False  # do ranks' models differ between synchronisation points?

    def __init__(self, group=None, control_group=None, hook: Any = "allreduce"):
        self.group = group
        self.control_group = control_group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.hook_spec = hook
        self.hook, self.hook_state = resolve_hook(hook, group)
        self.ddp: Optional[DistributedDataParallel] = None
        self.comm_timer = _Timer()

    def wrap(self, model: nn.Module, device_ids=None) -> DistributedDataParallel:
        self.ddp = DistributedDataParallel(model, process_group=self.group, device_ids=device_ids,
                                           **_no_forward_buffer_sync(DistributedDataParallel))
        self.ddp.register_comm_hook(self.hook_state, self.hook)
        return self.ddp

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def sync_gradients(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) all-reduces gradients."""
        return True

    def after_step(self, step: int) -> None:
        """Called after optimizer step ``step`` (1-based count of completed steps)."""

    def finish(self, step: int) -> None:
        """End of training: leave every rank with the consensus model where that is cheap."""

    def consensus_model(self) -> nn.Module:
        """The model to evaluate (collective: every rank calls it)."""
        return self.module

    def worker_distance(self) -> Optional[float]:
        """Collective: max over ranks of ||x_rank - consensus|| (None if not meaningful)."""
        return None

    def make_sampler(self, task, seed: int):
        """This rank's sampler of training indices, or None for the trainer's DistributedSampler."""
        return None

    def step_metrics(self, step: int) -> Dict[str, Any]:
        """Collective: extra fields for the step record of step ``step`` (1-based)."""
        return {}

    def summary(self) -> Dict[str, Any]:
        """Strategy-specific figures for the run summary (the same on every rank)."""
        return {}

    # -- checkpoint state ------------------------------------------------------
    def rank_state(self) -> Dict[str, Any]:
        """This rank's strategy state (saved per rank)."""
        state = {}
        if hasattr(self.hook_state, "state_dict"):
            state["hook_state"] = self.hook_state.state_dict()
        return state

    def load_rank_state(self, state: Dict[str, Any]) -> None:
        if "hook_state" in state and hasattr(self.hook_state, "load_state_dict"):
            self.hook_state.load_state_dict(state["hook_state"])

    def shared_state(self) -> Dict[str, Any]:
        """Collective: state that is one for the whole job (returned complete on every rank)."""
        return {}

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        pass


class SyncStrategy(Strategy):
    """Synchronous data parallel through a DDP comm hook."""

    name = "sync"


class LocalSGDStrategy(Strategy):
    """Local SGD (Lin et al. 2018): local steps, model averaging every ``period`` steps after
    ``warmup`` synchronous steps."""

    name = "local_sgd"
    per_rank_models = True

    def __init__(self, group=None, control_group=None, hook: Any = "allreduce", period: int = 4,
                 warmup: int = 0):
        super().__init__(group, control_group, hook)
        self.period = int(period)
        self.warmup = int(warmup)
        self._last_average = 0

    def sync_gradients(self, step: int) -> bool:
        return step < self.warmup

    def after_step(self, step: int) -> None:
        if step > self.warmup and (step - self.warmup) % self.period == 0:
            self.average()
            self._last_average = step
        elif step <= self.warmup:
            self._last_average = step

    def average(self) -> None:
        """Replace every rank's parameters by their mean over ranks (one all-reduce)."""
        flat = flat_parameters(self.module)
        with self.comm_timer():
            dist.all_reduce(flat, group=self.group)
        _assign_flat(self.module, flat.div_(self.world_size))

    def finish(self, step: int) -> None:
        if self._last_average != step:
            self.average()
            self._last_average = step

    def consensus_model(self) -> nn.Module:
        return mean_model(self.module, self.control_group, self.world_size)

    def worker_distance(self) -> float:
        consensus = flat_parameters(self.consensus_model()).cpu()
        distance = torch.tensor([float((flat_parameters(self.module).cpu() - consensus).norm())])
        dist.all_reduce(distance, op=dist.ReduceOp.MAX, group=self.control_group)
        return float(distance)

    def rank_state(self) -> Dict[str, Any]:
        state = super().rank_state()
        state["last_average"] = self._last_average
        return state

    def load_rank_state(self, state: Dict[str, Any]) -> None:
        super().load_rank_state(state)
        self._last_average = int(state.get("last_average", 0))


class EASGDStrategy(Strategy):
    """Synchronous EASGD with the centre variable sharded across ranks.

    Every ``period`` steps, with x_i the worker parameters and c the centre (both taken
    before the update, as in the paper's synchronous rule)::

        x_i <- x_i - alpha (x_i - c)
        c   <- c + alpha sum_i (x_i - c)        (beta = n alpha)

    Rank r stores only shard r of c. One update costs an all-gather of the centre and a
    reduce-scatter of the workers' parameters: the bytes of one ring all-reduce.
    """

    name = "easgd"
    per_rank_models = True

    def __init__(self, group=None, control_group=None, hook: Any = "allreduce", period: int = 4,
                 alpha: Optional[float] = None):
        super().__init__(group, control_group, hook)
        self.period = int(period)
        self.alpha = 0.9 / self.world_size if alpha is None else float(alpha)
        self.numel = 0
        self.shard_numel = 0
        self.centre_shard: Optional[torch.Tensor] = None

    def wrap(self, model: nn.Module, device_ids=None) -> DistributedDataParallel:
        ddp = super().wrap(model, device_ids)
        self._init_centre(flat_parameters(self.module))  # after DDP's broadcast: rank 0's weights
        return ddp

    def _init_centre(self, full: torch.Tensor) -> None:
        self.numel = full.numel()
        self.shard_numel = -(-self.numel // self.world_size)
        padded = full.new_zeros(self.shard_numel * self.world_size)
        padded[: self.numel] = full
        start = self.rank * self.shard_numel
        self.centre_shard = padded[start: start + self.shard_numel].clone()

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        padded = flat.new_zeros(self.shard_numel * self.world_size)
        padded[: self.numel] = flat
        return padded

    def gather_centre(self, group=None) -> torch.Tensor:
        """Collective: the full centre on every rank (on the CPU when gathered over the gloo
        control group)."""
        group = self.group if group is None else group
        shard = self.centre_shard if group is self.group else self.centre_shard.cpu()
        full = shard.new_empty(self.shard_numel * self.world_size)
        _all_gather_single(full, shard, group=group)
        return full[: self.numel]

    def sync_gradients(self, step: int) -> bool:
        return False

    def after_step(self, step: int) -> None:
        if step % self.period == 0:
            self.elastic_update()

    def elastic_update(self) -> None:
        x = self._padded(flat_parameters(self.module))
        summed = x.new_empty(self.shard_numel)
        with self.comm_timer():
            centre = self.gather_centre()
            _reduce_scatter_single(summed, x, op=dist.ReduceOp.SUM, group=self.group)
        # centre shard: c += alpha * sum_i (x_i - c)
        self.centre_shard += self.alpha * (summed - self.world_size * self.centre_shard)
        x = x[: self.numel]
        _assign_flat(self.module, x - self.alpha * (x - centre))

    def consensus_model(self) -> nn.Module:
        import copy

        model = copy.deepcopy(self.module)
        _assign_flat(model, self.gather_centre(self.control_group))
        return model

    def worker_distance(self) -> float:
        centre = self.gather_centre(self.control_group)
        distance = torch.tensor([float((flat_parameters(self.module).cpu() - centre).norm())])
        dist.all_reduce(distance, op=dist.ReduceOp.MAX, group=self.control_group)
        return float(distance)

    def shared_state(self) -> Dict[str, Any]:
        return {"centre": self.gather_centre(self.control_group).clone(), "alpha": self.alpha}

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        if "centre" in state:
            self._init_centre(state["centre"].to(next(self.module.parameters()).device))


def build_strategy(cfg, group=None, control_group=None) -> Strategy:
    """The strategy named by ``cfg.strategy`` (a :class:`~pycomm.train.config.TrainConfig`),
    as the registry (pycomm.train.base) builds it."""
    spec = strategy_spec(cfg.strategy)
    if spec.strategy is not None:
        return spec.strategy(cfg, group, control_group)
    if spec.trainer is not None:
        raise ValueError(f"{_PREFIX} strategy {spec.name} has a trainer of its own: use "
                         f"pycomm.train.build_trainer(cfg) (pycomm-train does)")
    raise ValueError(f"{_PREFIX} {spec.refusal}")


register_strategy(StrategySpec("sync", strategy=lambda cfg, group, control: SyncStrategy(group, control, cfg.hook),
                               describe=lambda cfg: f"hook {cfg.hook}", summary="DDP + comm hook"))
register_strategy(StrategySpec("local_sgd", strategy=lambda cfg, group, control: LocalSGDStrategy(
    group, control, cfg.hook, cfg.local_sgd_period, cfg.local_sgd_warmup),
    describe=lambda cfg: (f"hook {cfg.hook} for {cfg.local_sgd_warmup} warm-up steps"
                          if cfg.local_sgd_warmup > 0 else None)))
register_strategy(StrategySpec("easgd", strategy=lambda cfg, group, control: EASGDStrategy(
    group, control, cfg.hook, cfg.easgd_period, cfg.easgd_alpha)))
