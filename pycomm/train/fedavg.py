"""Federated averaging (McMahan et al. 2017): ``--strategy fedavg``.

Each rank is a client that keeps its own shard of the training set for the whole run:

* ``--noniid ALPHA``: a by-label split. For every label, the proportions of its samples
  that go to each rank are drawn from a symmetric Dirichlet(ALPHA) (Hsu, Qi and Brown
  2019); small ALPHA gives each rank few labels, large ALPHA approaches IID. Seeded
  (``--seed``), the same on every rank, and every sample lands on exactly one rank.
* without it: a seeded random split into equal parts (IID).

Training runs in rounds. In round t a seeded subset S_t of
``max(1, round(participation x n))`` ranks (the same on every rank) trains: each rank
takes ``local_epochs x E`` local optimizer steps on its shard, where E is the steps of
one epoch of the *mean* shard size (``len(train) // n`` samples), so all ranks stay in
step (McMahan's client k would take ``local_epochs x n_k / B`` steps; here a small
client passes over its data more often than a large one). Then one all-reduce computes
the new global model, the average of the participants' models weighted by their sample
counts ``n_k / sum_{j in S_t} n_j``, and every rank -- participant or not -- continues
from it. Ranks outside S_t also compute their local steps (the processes stay in lock
step), but their result gets weight 0.

The optimizer state (momentum) of a client is kept across rounds, as for local SGD in
this package; with ``--momentum 0`` each round is McMahan's ClientUpdate exactly.
Evaluation scores the latest global model.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .base import _PREFIX, register_strategy, StrategySpec
from .strategies import Strategy, _assign_flat, flat_parameters

__all__ = ["FedAvgStrategy", "ShardSampler", "dirichlet_split", "iid_split", "participants"]


def iid_split(num_samples: int, world_size: int, seed: int) -> List[torch.Tensor]:
    """A seeded random split of ``range(num_samples)`` into ``world_size`` parts of equal size (+-1)."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(10007 * seed + 3))
    return [part.sort().values for part in torch.tensor_split(order, world_size)]


def dirichlet_split(labels: torch.Tensor, world_size: int, alpha: float, seed: int,
                    min_size: int = 1, attempts: int = 100) -> List[torch.Tensor]:
    """Split sample indices over ranks by label, Dirichlet(alpha) proportions per label.

    Deterministic in ``seed``; every index appears in exactly one part. Draws again (a new
    seeded attempt) until every part holds at least ``min_size`` samples."""
    import numpy as np

    if labels.dim() != 1:
        raise ValueError(f"{_PREFIX} noniid needs one label per sample (this task's targets have shape "
                         f"{tuple(labels.shape)})")
    y = labels.cpu().numpy()
    classes = np.unique(y)
    for attempt in range(attempts):
        rng = np.random.default_rng([int(seed), attempt, 0xFED])
        parts: List[list] = [[] for _ in range(world_size)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(y == label))
            shares = rng.dirichlet(np.full(world_size, float(alpha)))
            cuts = (np.cumsum(shares)[:-1] * members.size).round().astype(np.int64)
            for rank, piece in enumerate(np.split(members, cuts)):
                parts[rank].extend(piece.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [torch.tensor(sorted(p), dtype=torch.int64) for p in parts]
    raise ValueError(f"{_PREFIX} noniid {alpha}: no split in {attempts} draws gives every one of {world_size} "
                     f"ranks {min_size} sample(s); use a larger alpha")


def participants(round_index: int, world_size: int, fraction: float, seed: int) -> List[int]:
    """The ranks that train in round ``round_index`` (sorted; the same on every rank)."""
    count = max(1, min(world_size, int(round(fraction * world_size))))
    if count == world_size:
        return list(range(world_size))
    rng = random.Random(1_000_003 * int(seed) + int(round_index))
    return sorted(rng.sample(range(world_size), count))


class ShardSampler:
    """One rank's training indices: ``length`` per epoch, drawn from its own shard in
    seeded passes (a fresh permutation of the shard each pass, continued as needed).
    Has what the trainer uses of a DistributedSampler: ``set_epoch``, ``len``, ``iter``."""

    def __init__(self, shard: torch.Tensor, length: int, seed: int, rank: int):
        if shard.numel() == 0:
            raise ValueError(f"{_PREFIX} rank {rank} has no training samples")
        self.shard = shard
        self.length = int(length)
        self.seed = int(seed)
        self.rank = int(rank)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(((self.seed * 7919 + self.rank) * 104729 + self.epoch) % (2**62))
        pieces, total = [], 0
        while total < self.length:
            pieces.append(self.shard[torch.randperm(self.shard.numel(), generator=generator)])
            total += self.shard.numel()
        return iter(torch.cat(pieces)[: self.length].tolist())


class FedAvgStrategy(Strategy):
    """Federated averaging with local epochs, partial participation and sample-count weights."""

    name = "fedavg"
    per_rank_models = True

    def __init__(self, group=None, control_group=None, hook: Any = "allreduce", local_epochs: int = 1,
                 participation: float = 1.0, noniid: Optional[float] = None, seed: int = 0,
                 samples_per_step: int = 32):
        super().__init__(group, control_group, hook)
        self.local_epochs = int(local_epochs)
        self.participation = float(participation)
        self.noniid = noniid
        self.seed = int(seed)
        self.samples_per_step = int(samples_per_step)
        self.shard_sizes: List[int] = []
        self.round_steps = 1
        self.global_flat: Optional[torch.Tensor] = None
        self.rounds_done = 0
        self._last_round_step = 0
        self.participation_log: List[List[int]] = []  # participants of each completed round

    @classmethod
    def from_config(cls, cfg, group=None, control_group=None) -> "FedAvgStrategy":
        return cls(group, control_group, cfg.hook, cfg.local_epochs, cfg.participation, cfg.noniid, cfg.seed,
                   cfg.batch_size * cfg.accum_steps)

    def make_sampler(self, task, seed: int) -> ShardSampler:
        count = task.x_train.shape[0]
        if self.noniid is None:
            shards = iid_split(count, self.world_size, seed)
        else:
            shards = dirichlet_split(task.y_train, self.world_size, self.noniid, seed)
        self.shard_sizes = [int(s.numel()) for s in shards]
        length = count // self.world_size
        self.round_steps = self.local_epochs * max(1, length // self.samples_per_step)
        return ShardSampler(shards[self.rank], length, seed, self.rank)

    def sync_gradients(self, step: int) -> bool:
        return False

    def after_step(self, step: int) -> None:
        if step % self.round_steps == 0:
            self.aggregate(step)

    def aggregate(self, step: int) -> None:
        """End the round that ``step`` closes: the weighted mean of the participants' models."""
        chosen = participants((step - 1) // self.round_steps, self.world_size, self.participation, self.seed)
        total = sum(self.shard_sizes[r] for r in chosen)
        weight = self.shard_sizes[self.rank] / total if self.rank in chosen else 0.0
        flat = flat_parameters(self.module).mul_(weight)
        with self.comm_timer():
            dist.all_reduce(flat, group=self.group)
        _assign_flat(self.module, flat)
        self.global_flat = flat
        self.rounds_done += 1
        self._last_round_step = step
        self.participation_log.append(chosen)

    def finish(self, step: int) -> None:
        if self._last_round_step != step:
            self.aggregate(step)  # the last, shorter round

    def _global_model_flat(self) -> torch.Tensor:
        """Collective: the latest global model; before the first round of this process (a
        fresh start, where the replicas are equal, or a resume from a checkpoint of another
        strategy) the sample-weighted mean of the replicas, over the control group."""
        if self.global_flat is None:
            flat = flat_parameters(self.module).cpu().mul_(self.shard_sizes[self.rank] / sum(self.shard_sizes))
            dist.all_reduce(flat, group=self.control_group)
            self.global_flat = flat.to(next(self.module.parameters()).device)
        return self.global_flat

    def consensus_model(self) -> nn.Module:
        model = copy.deepcopy(self.module)
        _assign_flat(model, self._global_model_flat())
        return model

    def worker_distance(self) -> Optional[float]:
        distance = torch.tensor([float((flat_parameters(self.module) - self._global_model_flat()).norm())])
        dist.all_reduce(distance, op=dist.ReduceOp.MAX, group=self.control_group)
        return float(distance)

    def summary(self) -> Dict[str, Any]:
        return {"rounds": self.rounds_done, "round_steps": self.round_steps, "shard_sizes": self.shard_sizes,
                "participants": self.participation_log}

    # -- checkpoint state ------------------------------------------------------------------
    def rank_state(self) -> Dict[str, Any]:
        state = super().rank_state()
        state.update(rounds_done=self.rounds_done, last_round_step=self._last_round_step,
                     participation_log=self.participation_log)
        return state

    def load_rank_state(self, state: Dict[str, Any]) -> None:
        super().load_rank_state(state)
        if "rounds_done" in state:
            self.rounds_done = int(state["rounds_done"])
            self._last_round_step = int(state["last_round_step"])
            self.participation_log = [list(p) for p in state["participation_log"]]

    def shared_state(self) -> Dict[str, Any]:
        return {"global_model": self._global_model_flat().cpu().clone()}  # the same on every rank

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        if "global_model" in state:
            self.global_flat = state["global_model"].to(next(self.module.parameters()).device)


register_strategy(StrategySpec("fedavg", strategy=FedAvgStrategy.from_config))
