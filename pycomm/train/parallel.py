"""Model parallelism for ``pycomm-train`` (``--parallel``), with torch's own engines.

``ddp``    data parallel (:class:`~pycomm.train.trainer.Trainer`, DDP + a comm hook, every
           strategy); each rank holds the whole model, its gradients and optimizer state.
``fsdp``   FSDP2 (``torch.distributed.fsdp.fully_shard``) over all ranks, ZeRO-3 style:
           parameters, gradients and optimizer state are sharded (1/n each), parameters are
           all-gathered for a layer's forward / backward and gradients reduce-scattered.
``tp``     DTensor tensor parallel (``parallelize_module``) over all ranks, Megatron-style:
           q / k / v and the MLP's first Linear split by columns, attention's out and the
           MLP's second Linear by rows; embeddings, norms and the output head are replicated.
           Every rank sees the same batch.
``pp``     ``torch.distributed.pipelining``: the model cut into one stage per rank,
           ``--microbatches`` per step, schedule ``--pp-schedule`` (GPipe or 1F1B).
``dp_tp``  a 2 x 2 DeviceMesh ("dp", "tp") on 4 ranks: tensor parallel inside each pair,
           FSDP2 over the "dp" dimension (torch's 2-D recipe; DDP does not take DTensors).
``dp_pp``  a 2 x 2 DeviceMesh ("dp", "pp") on 4 ranks: a 2-stage pipeline in each pair,
           each stage FSDP2-sharded over the "dp" dimension.

Data: the batch of a step is ``batch_size`` samples per *data-parallel replica* (all
ranks for ddp / fsdp, none for tp / pp, the "dp" dimension for the hybrids), drawn by a
DistributedSampler over the replicas, so a run equals single-process training on
``batch_size x replicas`` samples per step (tests/train/test_train_parallel.py checks it).

The model-parallel modes (everything but ddp) run strategy ``sync`` on the CPU in fp32;
they have no comm hook (gradients are reduced by FSDP2 / DTensor / the pipeline), no
checkpoints, no gradient clipping and no per-rank seeds; pp / dp_pp use micro-batches
instead of ``accum_steps``. :func:`validate_parallel` rejects the other combinations.
Evaluation and the final parameters use the model gathered whole on every rank.

Memory per rank, for every mode: :mod:`pycomm.train.memory`.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from .strategies import Strategy, _Timer, flat_parameters
from .._control import all_gather_bytes, bytes_to_tensors, tensors_to_bytes
from .base import _PREFIX, register_trainer
from .config import (DEFAULT_MICROBATCHES, HYBRID_WORLD_SIZE, MODES, PP_SCHEDULES, PP_TASKS,  # noqa: F401
                     TP_TASKS, validate_parallel)
from .trainer import Trainer

__all__ = ["MODES", "PP_SCHEDULES", "HYBRID_WORLD_SIZE", "ParallelTrainer", "validate_parallel",
           "check_world_size", "describe_parallel"]


_PP_LAYERS = {"digits-mlp": 3, "digits-cnn": 4}  # layers with parameters: the most stages


# ---------------------------------------------------------------------------
# configuration checks
# ---------------------------------------------------------------------------

def check_world_size(cfg, world_size: int) -> None:
    """The checks of ``--parallel`` against the number of ranks (ValueError)."""
    mode = cfg.parallel
    if mode in ("dp_tp", "dp_pp") and world_size != HYBRID_WORLD_SIZE:
        raise ValueError(f"{_PREFIX} parallel {mode} runs on a 2 x 2 mesh: it needs exactly "
                         f"{HYBRID_WORLD_SIZE} ranks (got {world_size})")
    if mode in ("fsdp", "tp", "pp") and world_size < 2:
        raise ValueError(f"{_PREFIX} parallel {mode} needs at least 2 ranks (got {world_size}); "
                         f"on one rank use parallel ddp")
    tp = {"tp": world_size, "dp_tp": 2}.get(mode)
    if tp and cfg.task == "tinylm-mp" and (4 % tp or cfg.lm_dim % tp):
        raise ValueError(f"{_PREFIX} parallel {mode}: {tp}-way tensor parallel must divide the 4 heads "
                         f"and lm_dim {cfg.lm_dim}")
    if tp and cfg.task == "digits-mlp" and (64 % tp):
        raise ValueError(f"{_PREFIX} parallel {mode}: {tp}-way tensor parallel must divide digits-mlp's "
                         f"hidden width 64")
    stages = {"pp": world_size, "dp_pp": 2}.get(mode)
    if stages and cfg.task == "tinylm-mp" and stages > cfg.lm_layers:
        raise ValueError(f"{_PREFIX} parallel {mode}: {stages} pipeline stages need lm_layers >= {stages} "
                         f"(got {cfg.lm_layers})")
    if stages and stages > _PP_LAYERS.get(cfg.task, stages):
        raise ValueError(f"{_PREFIX} parallel {mode}: {cfg.task} has {_PP_LAYERS[cfg.task]} layers with "
                         f"parameters, too few for {stages} pipeline stages")


def describe_parallel(cfg) -> str:
    """``fsdp``, ``pp (gpipe, 4 micro-batches)``, ...: what ``--parallel`` ran."""
    if cfg.parallel in ("pp", "dp_pp"):
        micro = cfg.microbatches if cfg.microbatches is not None else DEFAULT_MICROBATCHES
        return f"{cfg.parallel} ({cfg.pp_schedule or 'gpipe'}, {micro} micro-batches)"
    return cfg.parallel


# ---------------------------------------------------------------------------
# building the parallel model
# ---------------------------------------------------------------------------

def _fsdp_units(model: nn.Module) -> List[nn.Module]:
    """The submodules FSDP2 shards as units of their own (then the root takes the rest)."""
    from .tasks import SplitTransformerLM

    if isinstance(model, SplitTransformerLM):
        return list(model.blocks)
    if isinstance(model, nn.Sequential):
        return [m for m in model if any(True for _ in m.parameters())]
    return []


def _fully_shard(model: nn.Module, mesh) -> None:
    import warnings

    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns once per module whose output is a view (a Linear on 3-D input returns one)
    # that an in-place op on it would skip the backward all-gather; the tasks' losses are
    # out of place, so the warning would only be noise on every rank.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    for unit in _fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _tp_plan(model: nn.Module) -> Dict[str, Any]:
    """Megatron-style: column-split the first Linear of each pair, row-split the second (one
    all-reduce per pair in the forward, one in the backward)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .tasks import SplitTransformerLM

    if isinstance(model, SplitTransformerLM):
        plan = {}
        for i in range(len(model.blocks)):
            for name in ("q", "k", "v"):
                plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
            plan[f"blocks.{i}.attn.out"] = RowwiseParallel()
            plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
            plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
        return plan
    # digits-mlp: Linear(64, 128) ReLU Dropout Linear(128, 64) ReLU Dropout Linear(64, 10)
    return {"0": ColwiseParallel(), "3": RowwiseParallel()}


def _pipeline_pieces(model: nn.Module, count: int) -> List[nn.Module]:
    """``count`` consecutive pieces of ``model`` sharing its parameters."""
    if hasattr(model, "pipeline_stages"):
        return model.pipeline_stages(count)
    children = list(model)  # an nn.Sequential (validate_parallel allows only those)
    weighted = [i for i, m in enumerate(children) if any(True for _ in m.parameters())]
    if len(weighted) < count:
        raise ValueError(f"{_PREFIX} a pipeline of {count} stages needs {count} layers with parameters "
                         f"(the model has {len(weighted)})")
    # cut before the weighted layers that start each stage; stage 0 starts at 0
    starts = [0] + [weighted[len(weighted) * i // count] for i in range(1, count)] + [len(children)]
    return [nn.Sequential(*children[starts[i]: starts[i + 1]]) for i in range(count)]


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().clone()


class _ParallelStrategy(Strategy):
    """What the trainer's loop asks of a strategy, for the model-parallel modes: synchronous
    steps; the model to evaluate is the one gathered whole."""

    name = "sync"

    def __init__(self, trainer: "ParallelTrainer"):  # no DDP, no hook
        self.group = trainer.group
        self.control_group = trainer.control
        self.world_size = trainer.world_size
        self.rank = trainer.rank
        self.hook_spec, self.hook, self.hook_state = None, None, None
        self.ddp = None
        self.comm_timer = _Timer()
        self._trainer = trainer

    @property
    def module(self) -> nn.Module:
        return self._trainer.model

    def consensus_model(self) -> nn.Module:
        return self._trainer.gathered_model()


class ParallelTrainer(Trainer):
    """:class:`~pycomm.train.trainer.Trainer` for ``--parallel`` fsdp, tp, pp, dp_tp, dp_pp:
    the same loop, logs, schedule and evaluation; the model built by FSDP2, DTensor or
    torch.distributed.pipelining over a DeviceMesh of the default process group."""

    def __init__(self, cfg, process_group=None, control_group=None):
        if process_group is not None:
            raise ValueError(f"{_PREFIX} parallel {cfg.parallel} builds its DeviceMesh over the default "
                             f"process group: pass process_group=None")
        self._gathered = None
        super().__init__(cfg, process_group, control_group)

    # -- construction (called by Trainer.__init__) ------------------------------------
    def _build_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        cfg, mode = self.cfg, self.cfg.parallel
        check_world_size(cfg, self.world_size)
        self.strategy = _ParallelStrategy(self)
        self.schedule = None
        self.pp_rank, self.pp_size = 0, 1
        model = self.task.make_model(cfg.seed)
        if mode in ("fsdp", "tp", "pp"):
            self.mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=(mode,))
        else:
            self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", mode[3:]))
        if mode == "fsdp":
            _fully_shard(model, self.mesh)
            self.dp_rank, self.dp_size = self.rank, self.world_size
        elif mode in ("tp", "dp_tp"):
            from torch.distributed.tensor.parallel import parallelize_module

            model = parallelize_module(model, self.mesh["tp"], _tp_plan(model))
            if mode == "dp_tp":
                _fully_shard(model, self.mesh["dp"])
                self.dp_rank, self.dp_size = self.mesh["dp"].get_local_rank(), 2
            else:
                self.dp_rank, self.dp_size = 0, 1
        else:
            model = self._build_stage(model)
            if mode == "dp_pp":
                self.dp_rank, self.dp_size = self.mesh["dp"].get_local_rank(), 2
            else:
                self.dp_rank, self.dp_size = 0, 1
        self.ddp = self.model = model

    def _build_stage(self, model: nn.Module) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        cfg = self.cfg
        pp_mesh = self.mesh["pp"]
        self.pp_rank, self.pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
        pieces = _pipeline_pieces(model, self.pp_size)
        stage = pieces[self.pp_rank]
        names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
        # this stage's state-dict keys -> the whole model's (to gather the model whole)
        self._stage_names = {k: names[id(t)] for k, t in stage.state_dict(keep_vars=True).items()}
        del pieces, model  # the other stages' parameters go with them
        if cfg.parallel == "dp_pp":
            _fully_shard(stage, self.mesh["dp"])
        self.pipeline_stage = PipelineStage(stage, self.pp_rank, self.pp_size, self.device,
                                            group=pp_mesh.get_group())
        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.pp_schedule or "gpipe"]
        micro = cfg.microbatches if cfg.microbatches is not None else DEFAULT_MICROBATCHES
        self.schedule = schedule_cls(self.pipeline_stage, n_microbatches=micro, loss_fn=self.task.loss)
        return stage

    # -- one step ---------------------------------------------------------------------
    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
        self._gathered = None
        if self.schedule is None:  # fsdp / tp / dp_tp: the engine reduces in the backward
            loss = self.task.loss(self.ddp(x), y) / self.cfg.accum_steps
            loss.backward()
            return loss.item()
        first, last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        losses: List[torch.Tensor] = []
        self.schedule.step(*((x,) if first else ()), target=y if last else None,
                           losses=losses if last else None)
        # every rank logs the loss of data-parallel replica 0 (its last stage has it)
        mine = torch.zeros(1, dtype=torch.float64)
        if last and self.dp_rank == 0:
            mine += sum(float(l.detach()) for l in losses) / len(losses)
        dist.all_reduce(mine, group=self.control)
        return float(mine)

    # -- the whole model ----------------------------------------------------------------
    @torch.no_grad()
    def gathered_model(self) -> nn.Module:
        """Collective: a plain copy of the whole model on every rank (cached until the next step)."""
        if self._gathered is not None:
            return self._gathered
        if self.schedule is None:
            state = {k: _full_tensor(v) for k, v in self.model.state_dict().items()}
        else:
            mine = {self._stage_names[k]: _full_tensor(v) for k, v in self.model.state_dict().items()}
            state = {}
            for part in all_gather_bytes(tensors_to_bytes(mine), group=self.control):
                state.update(bytes_to_tensors(part))  # weights_only: tensors only
        with torch.random.fork_rng():  # make_model seeds the global RNG; training's stays as it was
            model = self.task.make_model(self.cfg.seed)
        model.load_state_dict(state)
        self._gathered = model.to(self.device)
        return self._gathered

    def local_parameters(self) -> torch.Tensor:
        return flat_parameters(self.gathered_model())


register_trainer("parallel", ParallelTrainer)
