"""The trainer: one readable loop around DistributedDataParallel.

Per optimizer step, on every rank::

    for each of accum_steps micro-batches (from a DistributedSampler, set_epoch per epoch):
        forward under autocast (bf16 on CPU; fp16/bf16 + grad scaler on CUDA)
        backward under ddp.no_sync() except on the last micro-batch of a synchronous step
    unscale + clip the gradient norm, optimizer.step(), scheduler.step()
    strategy.after_step(step)       # local SGD averaging / EASGD elastic update

The process group must exist already (``dist.init_process_group``); :mod:`pycomm.train.cli`
creates it for ``torchrun`` or for locally spawned ranks. Evaluation and checkpoint
traffic go over a separate gloo "control" group, so the bytes and seconds reported
from ``pycomm.stats()`` are the training's own.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from .._control import all_gather_json, broadcast_bytes, bytes_to_tensors, gather_bytes, tensors_to_bytes
from . import checkpoint as ckpt
from .base import _PREFIX, strategy_spec, trainer_factory
from .config import TrainConfig
from .metrics import CommMeter, MetricsLogger
from .memory import RssPeak, memory_report
from .straggler import Straggler
from .strategies import Strategy, build_strategy, flat_parameters
from .tasks import Task, get_task

__all__ = ["Trainer", "train", "build_trainer"]


class _Indices:
    """What DistributedSampler needs of a data set: its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _lr_lambda(cfg: TrainConfig, total_steps: int):
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if cfg.schedule == "cosine":
            return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 0.1 ** int(progress * 3 - 1e-9)  # "step": x0.1 at 1/3 and 2/3 of the run

    return factor


def join_groups(trainer, cfg: TrainConfig, process_group=None, control_group=None) -> None:
    """What every trainer starts with: the validated config, the process group, the
    gloo control group (created here, collectively, when None), rank, world size and
    backend name, as attributes of ``trainer``."""
    if not dist.is_initialized():
        raise RuntimeError(f"{_PREFIX} call dist.init_process_group first (or use pycomm-train)")
    cfg.validate()
    trainer.cfg = cfg
    trainer.group = process_group
    trainer.control = control_group if control_group is not None else dist.new_group(backend="gloo")
    trainer.rank = dist.get_rank(process_group)
    trainer.world_size = dist.get_world_size(process_group)
    trainer.backend = dist.get_backend(process_group)


class Trainer:
    """Builds task, model, strategy, optimizer, schedule and sampler; ``fit()`` trains.

    ``process_group``: the group the model trains over (None: the default group).
    ``control_group``: a gloo group over the same ranks for evaluation / checkpoint
    traffic (None: created here, collectively).
    """

    def __init__(self, cfg: TrainConfig, process_group=None, control_group=None):
        join_groups(self, cfg, process_group, control_group)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cfg.device == "cuda" \
            else torch.device("cpu")
        if cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"{_PREFIX} device cuda requested but torch sees no GPU")
            torch.cuda.set_device(self.device)
        if cfg.algorithm and self.backend == "pycomm":
            import pycomm

            pycomm.set_algorithm(cfg.algorithm, group=process_group)

        self.task: Task = get_task(cfg.task, cfg.dropout, cfg.lm_dim, cfg.lm_layers)
        self.rss = RssPeak()  # the resident set before the model (memory_report)
        # data-parallel replicas: each draws its own batches (model-parallel ranks share theirs)
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self._build_model()

        if cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                             weight_decay=cfg.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                               weight_decay=cfg.weight_decay)

        self.sampler = self.strategy.make_sampler(self.task, cfg.seed)  # fedavg: the rank's own shard
        if self.sampler is None:
            self.sampler = DistributedSampler(_Indices(self.task.x_train.shape[0]), num_replicas=self.dp_size,
                                              rank=self.dp_rank, shuffle=True, seed=cfg.seed, drop_last=True)
        self.straggler = Straggler(cfg.straggler, self.rank, self.world_size)
        self.micro_per_epoch = len(self.sampler) // cfg.batch_size
        self.steps_per_epoch = self.micro_per_epoch // cfg.accum_steps
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{_PREFIX} batch_size x accum_steps = {cfg.batch_size * cfg.accum_steps} is more than "
                f"the {len(self.sampler)} training samples each of {self.dp_size} data-parallel ranks gets")
        self.total_steps = cfg.epochs * self.steps_per_epoch if cfg.epochs else cfg.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg, self.total_steps))
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.device == "cuda" and cfg.precision != "fp32")

        # position and clocks
        self.step = 0
        self.epoch = 0
        self.micro_in_epoch = 0
        self.elapsed_s = 0.0
        self._order: Optional[List[int]] = None
        self.resumed_from: Optional[str] = None
        # randomness of training itself (dropout): per rank, from the run's seed
        torch.manual_seed(cfg.seed * 1000 + 17 + self.rank)

        if cfg.resume:
            path = ckpt.find_checkpoint(cfg.resume, cfg.checkpoint_dir)
            if path is not None:
                self.load_checkpoint(path)

        self.is_logger = self.rank == 0
        self.meter = CommMeter(self.backend == "pycomm")
        self.logger = MetricsLogger(cfg.log_file, self.is_logger, cfg.progress, self.total_steps,
                                    initial_step=self.step, append=self.resumed_from is not None)
        self.rss.reset_peak()  # from here on: the training steps

    def _build_model(self) -> None:
        """The model, its strategy, ``self.ddp`` (what the step calls) and ``self.model`` (the
        module whose parameters the optimizer steps). :class:`~pycomm.train.parallel.ParallelTrainer`
        builds them its own way."""
        cfg = self.cfg
        model_seed = cfg.seed + (self.rank if cfg.rank_seeds else 0)
        model = self.task.make_model(model_seed).to(self.device)
        self.strategy: Strategy = build_strategy(cfg, self.group, self.control)
        self.ddp = self.strategy.wrap(model, device_ids=[self.device.index] if cfg.device == "cuda" else None)
        self.model = self.ddp.module

    # -- data --------------------------------------------------------------------
    def _micro_batch(self):
        if self._order is None:
            self.sampler.set_epoch(self.epoch)
            self._order = list(iter(self.sampler))
        b = self.cfg.batch_size
        index = torch.tensor(self._order[self.micro_in_epoch * b: (self.micro_in_epoch + 1) * b])
        self.micro_in_epoch += 1
        x, y = self.task.x_train[index], self.task.y_train[index]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _start_step_position(self) -> None:
        # an optimizer step never straddles two epochs
        if self.micro_in_epoch + self.cfg.accum_steps > self.micro_per_epoch:
            self.epoch += 1
            self.micro_in_epoch = 0
            self._order = None

    def _autocast(self):
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    # -- one step -------------------------------------------------------------------
    def train_step(self) -> Dict[str, Any]:
        cfg = self.cfg
        self._maybe_inject_failure()
        self.ddp.train()
        start = time.perf_counter()
        comm_before = self.strategy.comm_timer.seconds
        self._start_step_position()
        sync = self.strategy.sync_gradients(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in range(cfg.accum_steps):
            x, y = self._micro_batch()
            loss_sum += self._micro_step(x, y, sync and micro == cfg.accum_steps - 1)
        if cfg.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        self.straggler.delay(time.perf_counter() - start)
        self.strategy.after_step(self.step)
        step_s = time.perf_counter() - start
        self.elapsed_s += step_s
        comm = self.meter.delta()
        if self.backend != "pycomm":
            comm["comm_s"] = self.strategy.comm_timer.seconds - comm_before
        samples = cfg.batch_size * cfg.accum_steps * self.dp_size
        return {
            "event": "step", "step": self.step, "epoch": self.epoch, "loss": loss_sum, "lr": lr,
            "samples_per_s": samples / step_s, "step_s": step_s, "comm_s": comm["comm_s"],
            "compute_s": max(0.0, step_s - comm["comm_s"]), "bytes_sent": comm["bytes_sent"],
            "elapsed_s": self.elapsed_s, **self.strategy.step_metrics(self.step),
        }

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
        """Forward and backward of one micro-batch (DDP all-reduces when ``sync``); its loss."""
        context = contextlib.nullcontext() if sync else self.ddp.no_sync()
        with context:
            with self._autocast():
                loss = self.task.loss(self.ddp(x), y) / self.cfg.accum_steps
            self.scaler.scale(loss).backward()
        return loss.item()

    def local_parameters(self) -> torch.Tensor:
        """This rank's parameters, flat (its replica's, for the data-parallel strategies)."""
        return flat_parameters(self.model)

    def memory_report(self) -> List[Dict[str, Any]]:
        """Collective: every rank's :func:`~pycomm.train.parallel.memory_report`, in rank order."""
        return all_gather_json(memory_report(self.model, self.optimizer, self.rss), group=self.control)

    def _maybe_inject_failure(self) -> None:
        fail = self.cfg.fail_at_step
        if fail is None or self.step != fail or self.rank != self.world_size - 1:
            return
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return  # the restarted job runs through
        raise RuntimeError(f"{_PREFIX} injected failure on rank {self.rank} at step {self.step} "
                           f"(fail_at_step, for testing the restart path)")

    # -- evaluation --------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> Dict[str, Any]:
        """Collective: test loss and accuracy of the consensus model, test set sharded over ranks."""
        model = self.strategy.consensus_model()
        was_training = model.training
        model.eval()
        x = self.task.x_test[self.rank::self.world_size]
        y = self.task.y_test[self.rank::self.world_size]
        totals = torch.zeros(3, dtype=torch.float64)
        for begin in range(0, x.shape[0], 512):
            xb, yb = x[begin: begin + 512].to(self.device), y[begin: begin + 512].to(self.device)
            with self._autocast():
                out = model(xb)
            totals += torch.tensor(self.task.score(out, yb), dtype=torch.float64)
        dist.all_reduce(totals, group=self.control)
        model.train(was_training)
        loss, correct, count = totals.tolist()
        return {"event": "eval", "step": self.step, "test_loss": loss / count,
                "test_accuracy": correct / count, "elapsed_s": self.elapsed_s}

    # -- the loop ------------------------------------------------------------------------
    def fit(self, max_steps: Optional[int] = None) -> Dict[str, Any]:
        """Train to the end (or stop after step ``max_steps``, without the end-of-run work)."""
        cfg = self.cfg
        stop = self.total_steps if max_steps is None else min(max_steps, self.total_steps)
        if self.resumed_from is None:
            self.logger.log({"event": "start", "config": cfg.to_dict(), "world_size": self.world_size,
                             "backend": self.backend, "total_steps": self.total_steps,
                             "steps_per_epoch": self.steps_per_epoch, "run_name": cfg.run_name,
                             "train_samples": int(self.task.x_train.shape[0])})
        else:
            self.logger.log({"event": "resume", "step": self.step, "from": self.resumed_from,
                             "world_size": self.world_size})
        losses, evals = [], []
        bytes_sent = 0
        try:
            while self.step < stop:
                record = self.train_step()
                losses.append((record["step"], record["loss"]))
                bytes_sent += record["bytes_sent"]
                self.logger.log(record)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                    evals.append(self.evaluate())
                    self.logger.log(evals[-1])
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
            result: Dict[str, Any] = {"losses": losses, "evals": evals, "step": self.step,
                                      "bytes_sent": bytes_sent, "wall_s": self.elapsed_s,
                                      "memory": self.memory_report()}
            if self.step < self.total_steps:
                return result
            self.strategy.finish(self.step)
            final = self.evaluate()
            evals.append(final)
            self.logger.log(final)
            result["worker_distance"] = self.strategy.worker_distance()
            result["strategy_summary"] = self.strategy.summary()
            result["final"] = final
            result["params"] = flat_parameters(self.strategy.consensus_model())
            result["local_params"] = self.local_parameters()
            if cfg.checkpoint_dir and not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                self.save_checkpoint()
            self.logger.log({"event": "end", "step": self.step, "wall_s": self.elapsed_s,
                             "test_accuracy": final["test_accuracy"], "test_loss": final["test_loss"],
                             "bytes_sent_rank0": bytes_sent, "world_size": self.world_size,
                             "strategy": cfg.strategy, "hook": cfg.hook, "parallel": cfg.parallel,
                             "run_name": cfg.run_name, "memory": result["memory"],
                             **result["strategy_summary"]})
            return result
        finally:
            self.logger.close()

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path: Optional[str] = None) -> Optional[str]:
        """Collective: gather every rank's state to rank 0, which writes it atomically."""
        directory = self.cfg.checkpoint_dir
        if path is None:
            if not directory:
                raise ValueError(f"{_PREFIX} save_checkpoint needs a path or checkpoint_dir")
            path = ckpt.checkpoint_path(directory, self.step)
        entry = {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": ckpt.rng_state(),
            "strategy": self.strategy.rank_state(),
        }
        shared = self.strategy.shared_state()
        # tensors and plain values, as torch.save bytes, read back with weights_only (no pickle)
        parts = gather_bytes(tensors_to_bytes(entry), dst=0, group=self.control)
        if self.rank == 0:
            gathered = [bytes_to_tensors(part) for part in parts]
            state = {
                "format": ckpt.FORMAT_VERSION, "config": self.cfg.to_dict(), "task": self.cfg.task,
                "strategy": self.cfg.strategy, "world_size": self.world_size, "step": self.step,
                "epoch": self.epoch, "micro_in_epoch": self.micro_in_epoch, "elapsed_s": self.elapsed_s,
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "shared": shared, "ranks": gathered,
            }
            ckpt.atomic_save(state, path)
            if directory and os.path.dirname(os.path.abspath(path)) == os.path.abspath(directory):
                ckpt.atomic_write_text(os.path.basename(path) + "\n", os.path.join(directory, "latest"))
        dist.barrier(group=self.control)
        return path

    def load_checkpoint(self, path: str) -> None:
        """Collective: rank 0 reads ``path`` and broadcasts it; every rank restores its part.

        Same world size and strategy: everything is restored exactly (the run continues as
        if it had not stopped). Otherwise the ranks start from the mean of the saved
        models (equal to each of them for ``sync``), the optimizer state of saved rank
        ``rank % old_world_size``, the EASGD centre re-sharded, the sampler at the same
        fraction of the epoch, and fresh RNG / hook states.
        """
        box = None
        if self.rank == 0:
            try:
                box = {"state": ckpt.load(path)}  # weights_only: tensors and plain values
            except Exception as exc:  # surfaced on every rank below
                text = str(exc)
                box = {"error": text if text.startswith(_PREFIX) else f"{_PREFIX} cannot read checkpoint {path}: "
                                                                        f"{text}"}
        # the checkpoint reaches the other ranks as torch.save bytes, read with weights_only
        box = bytes_to_tensors(broadcast_bytes(tensors_to_bytes(box) if self.rank == 0 else None, src=0,
                                               group=self.control))
        if "error" in box:
            raise RuntimeError(box["error"])
        state = box["state"]
        if state.get("format") != ckpt.FORMAT_VERSION:
            raise RuntimeError(f"{_PREFIX} {path} has checkpoint format {state.get('format')}, "
                               f"expected {ckpt.FORMAT_VERSION}")
        if state["task"] != self.cfg.task:
            raise RuntimeError(f"{_PREFIX} {path} is a checkpoint of task {state['task']!r}, "
                               f"not {self.cfg.task!r}")
        old_world = state["world_size"]
        exact = old_world == self.world_size and state["strategy"] == self.cfg.strategy
        entries = state["ranks"]
        if exact:
            mine = entries[self.rank]
            self.model.load_state_dict(mine["model"])
            self.optimizer.load_state_dict(mine["optimizer"])
            self.strategy.load_rank_state(mine["strategy"])
        else:
            mean = {k: sum(e["model"][k].double() for e in entries) / len(entries) for k in entries[0]["model"]}
            self.model.load_state_dict({k: v.to(entries[0]["model"][k].dtype) for k, v in mean.items()})
            self.optimizer.load_state_dict(entries[self.rank % old_world]["optimizer"])
        if state["strategy"] == self.cfg.strategy:
            self.strategy.load_shared_state(state["shared"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.epoch = state["epoch"]
        self.elapsed_s = state["elapsed_s"]
        if old_world == self.world_size:
            self.micro_in_epoch = state["micro_in_epoch"]
        else:
            seen = state["micro_in_epoch"] * old_world  # micro-batches of all ranks in this epoch
            self.micro_in_epoch = min(seen // self.world_size, self.micro_per_epoch)
        self._order = None
        if exact:
            ckpt.set_rng_state(entries[self.rank]["rng"])
        else:
            torch.manual_seed(self.cfg.seed * 1000 + 17 + self.rank + 7919 * self.step)
        self.resumed_from = path


def train(cfg: TrainConfig, process_group=None, control_group=None, max_steps: Optional[int] = None):
    """``Trainer(cfg, ...).fit(max_steps)`` inside an initialised process group."""
    if strategy_spec(cfg.strategy).trainer is not None:
        return build_trainer(cfg, process_group, control_group).fit()
    return build_trainer(cfg, process_group, control_group).fit(max_steps)


def build_trainer(cfg: TrainConfig, process_group=None, control_group=None):
    """The trainer for ``cfg``: :class:`Trainer` (DDP), a strategy's loop of its own
    (``async_ps``: :mod:`.async_ps`, ``cocoa``: :mod:`.cocoa`; the registry in
    pycomm.train.base says which), or for ``parallel`` other than ddp
    :class:`~pycomm.train.parallel.ParallelTrainer`."""
    own = strategy_spec(cfg.strategy).trainer
    if own is not None:
        return own(cfg, process_group, control_group)
    if cfg.parallel != "ddp":
        return trainer_factory("parallel")(cfg, process_group, control_group)
    return Trainer(cfg, process_group, control_group)
