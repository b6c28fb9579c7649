"""Decentralised gossip SGD (D-PSGD, Lian et al. 2017): ``--strategy gossip``.

Each rank takes a local optimizer step on its own gradients (no gradient all-reduce),
then replaces its parameters by a weighted average of its own and its neighbours'
parameters, exchanged with point-to-point ``isend`` / ``irecv`` with the neighbours
only -- there is no global all-reduce in training.

Topologies (``--topology``), with n ranks:

``ring``  neighbours r - 1 and r + 1 (mod n);
``exp``   neighbours r +- 2^k (mod n) for 2^k < n (the undirected exponential graph:
          O(log n) neighbours, diameter O(log n); Assran et al. 2019 use its directed form).

Both graphs are circulant, so every rank has the same number d of distinct neighbours,
and the uniform weight 1 / (d + 1) on itself and each neighbour gives a symmetric,
doubly stochastic mixing matrix: the mean of the replicas is preserved by every mixing
step. On 2 ranks (both topologies) and on 3 (ring) or 4 (exp) ranks the graph is
complete, and mixing is exact model averaging.

Consensus distance (Kong et al. 2021): every ``--consensus-every K`` steps, with x_i the
replicas and x_bar their mean, ``sqrt(1/n sum_i ||x_i - x_bar||^2)``, from one all-reduce
of ``[x_i, ||x_i||^2]`` in float64 over the control (gloo) group, so reporting costs the
training's byte counters nothing. It is written to the step records
(``consensus_distance``) and summarised in the run summary.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .base import _PREFIX, register_strategy, StrategySpec
from .strategies import Strategy, _assign_flat, flat_parameters, mean_model

__all__ = ["GossipStrategy", "neighbours", "consensus_distance"]

_GOSSIP_TAG = 7101


def neighbours(rank: int, world_size: int, topology: str) -> List[int]:
    """The distinct neighbours of ``rank`` (sorted), excluding itself."""
    if topology == "ring":
        offsets = [1]
    elif topology == "exp":
        offsets, step = [], 1
        while step < world_size:
            offsets.append(step)
            step *= 2
    else:
        raise ValueError(f"{_PREFIX} unknown gossip topology {topology!r} (ring, exp)")
    peers = set()
    for offset in offsets:
        peers.add((rank + offset) % world_size)
        peers.add((rank - offset) % world_size)
    peers.discard(rank)
    return sorted(peers)


def consensus_distance(flat: torch.Tensor, group=None) -> float:
    """Collective: sqrt(1/n sum_i ||x_i - x_bar||^2) of the ranks' ``flat`` vectors (one all-reduce)."""
    n = dist.get_world_size(group)
    x = flat.detach().double().cpu()
    buffer = torch.cat([x, (x * x).sum().reshape(1)])
    dist.all_reduce(buffer, group=group)
    mean = buffer[:-1] / n
    squared = float(buffer[-1]) / n - float((mean * mean).sum())
    return max(0.0, squared) ** 0.5


class GossipStrategy(Strategy):
    """D-PSGD: local step, then average with the neighbours on a ring or exponential graph."""

    name = "gossip"
    per_rank_models = True

    def __init__(self, group=None, control_group=None, hook: Any = "allreduce", topology: str = "ring",
                 consensus_every: int = 10):
        super().__init__(group, control_group, hook)
        self.topology = topology
        self.consensus_every = int(consensus_every)
        self.peers = neighbours(self.rank, self.world_size, topology)
        self.weight = 1.0 / (len(self.peers) + 1)
        self.history: List[Tuple[int, float]] = []  # (step, consensus distance)

    @classmethod
    def from_config(cls, cfg, group=None, control_group=None) -> "GossipStrategy":
        return cls(group, control_group, cfg.hook, cfg.topology, cfg.consensus_every)

    def sync_gradients(self, step: int) -> bool:
        return False

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def after_step(self, step: int) -> None:
        self.gossip()

    def gossip(self) -> None:
        """One mixing step: x_i <- (x_i + sum_{j in N(i)} x_j) / (|N(i)| + 1)."""
        if not self.peers:
            return
        flat = flat_parameters(self.module)
        inbox = [torch.empty_like(flat) for _ in self.peers]
        with self.comm_timer():
            requests = [dist.irecv(buf, src=self._global(peer), group=self.group, tag=_GOSSIP_TAG)
                        for buf, peer in zip(inbox, self.peers)]
            requests += [dist.isend(flat, dst=self._global(peer), group=self.group, tag=_GOSSIP_TAG)
                         for peer in self.peers]
            for request in requests:
                request.wait()
        mixed = flat.clone()
        for buf in inbox:
            mixed += buf
        _assign_flat(self.module, mixed.mul_(self.weight))

    # -- reporting ----------------------------------------------------------------
    def step_metrics(self, step: int) -> Dict[str, Any]:
        if not self.consensus_every or step % self.consensus_every:
            return {}
        distance = consensus_distance(flat_parameters(self.module), self.control_group)
        self.history.append((step, distance))
        return {"consensus_distance": distance}

    def summary(self) -> Dict[str, Any]:
        values = [d for _, d in self.history]
        return {
            "topology": self.topology, "neighbours": len(self.peers),
            "consensus_distance": list(self.history),
            "consensus_distance_mean": sum(values) / len(values) if values else None,
            "consensus_distance_max": max(values) if values else None,
        }

    # -- evaluation: the mean of the replicas ---------------------------------------
    def consensus_model(self) -> nn.Module:
        return mean_model(self.module, self.control_group, self.world_size)

    def worker_distance(self) -> Optional[float]:
        consensus = flat_parameters(self.consensus_model()).cpu()
        distance = torch.tensor([float((flat_parameters(self.module).cpu() - consensus).norm())])
        dist.all_reduce(distance, op=dist.ReduceOp.MAX, group=self.control_group)
        return float(distance)


register_strategy(StrategySpec("gossip", strategy=GossipStrategy.from_config))
