"""Asynchronous SGD with a parameter server (``--strategy async_ps``).

Roles: the first ``servers`` ranks are parameter servers, the others workers (worker j is
rank ``servers + j``). The flat parameter vector is cut into ``servers`` contiguous
chunks; server s holds chunk s and the optimizer state for it (``--optimizer``,
``--lr`` and the schedule run on the servers, one optimizer step per applied gradient).
Workers hold no optimizer: a worker receives a *lease* (the current chunk and its version
from every server), computes the gradient of one batch of its own data, pushes its chunks
to the servers, and waits for its next lease. There is no barrier and no collective until
the end: everything goes over pycomm ``send`` / ``recv``.

Versions and staleness. The version is the number of gradients applied so far. A gradient
computed on a lease of version tau and applied when the servers are at version v has
staleness v - tau. ``--max-staleness S`` bounds it (the "bounded delay" consistency of Li
et al., OSDI 2014): S = 0 is sequential consistency (each gradient is applied to the very
parameters it was computed on; with several workers they take turns), larger S lets
workers compute on parameters up to S versions old.

The schedule is decided by server 0 and followed by the other servers, so every server
applies the same gradients in the same order and grants leases in the same order (if
they decided alone, two servers could lease to different workers and wait on each
other). Server 0 keeps the leases handed out and not yet applied and only

* applies an arrived gradient if afterwards every other outstanding lease can still be
  applied within its bound, applying them oldest first (for the leases sorted by version
  tau_0 <= tau_1 <= ...: v - tau_i + i <= S for every i). The oldest lease's gradient
  always passes this test, so the schedule cannot deadlock;
* grants a lease (to the longest-waiting worker) while at most S leases are outstanding:
  a worker that runs ahead waits for its lease.

Termination: a worker's last push is flagged; server 0 stops when every worker's last
gradient is applied, tells the other servers to stop and the workers that training is
over (a worker that finished early polls for that message instead of blocking in a
receive, so no timeout runs while it waits). Then all ranks assemble the final
parameters (one all-reduce over the control group), evaluate, and return the same
summary. Workers may do different numbers of steps (``worker_steps``).

Messages (tags are per message kind; pycomm matches a receive by source rank and tag, in
posting order):

* lease, server -> worker: float64 header [version], then the float32 chunk;
* push, worker -> server: float64 header [worker, worker step, lease version, loss, last],
  then the gradient chunk. Server 0 receives headers from any source;
* schedule, server 0 -> server s: int64 [kind, worker] (apply / grant / stop);
* done, server 0 -> worker: int64 [total versions].
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from .._control import broadcast_bytes, bytes_to_tensors, tensors_to_bytes
from .base import _PREFIX, register_strategy, StrategySpec
from .config import TrainConfig, check_own_loop
from .trainer import join_groups
from .metrics import CommMeter, MetricsLogger
from .straggler import Straggler, parse_straggler
from .strategies import _assign_flat, flat_parameters
from .tasks import get_task

__all__ = ["AsyncPSTrainer", "lease_feasible"]


_TAG_LEASE_HEADER = 301
_TAG_LEASE = 302
_TAG_PUSH_HEADER = 303
_TAG_PUSH = 304
_TAG_SCHEDULE = 305
_TAG_DONE = 306

_APPLY, _GRANT, _STOP = 1, 2, 3


def lease_feasible(lease_versions: Sequence[int], version: int, max_staleness: int) -> bool:
    """Whether outstanding leases of these versions can all be applied, oldest first, from
    server version ``version`` without any exceeding staleness ``max_staleness``."""
    return all(version - tau + i <= max_staleness for i, tau in enumerate(sorted(lease_versions)))


class AsyncPSTrainer:
    """Parameter-server asynchronous SGD; ``fit()`` trains (every rank calls it).

    ``worker_steps``: steps per worker (default: ``cfg.steps``, or ``cfg.epochs`` passes over
    the worker's share of the data); ``worker_delay_s``: seconds each worker sleeps per step
    (to emulate slow workers in tests and experiments).
    """

    def __init__(self, cfg: TrainConfig, process_group=None, control_group=None,
                 worker_steps: Optional[Sequence[int]] = None, worker_delay_s: Optional[Sequence[float]] = None):
        if cfg.strategy != "async_ps":
            raise ValueError(f"{_PREFIX} AsyncPSTrainer runs strategy async_ps (got {cfg.strategy!r})")
        join_groups(self, cfg, process_group, control_group)
        self.servers = cfg.servers
        self.workers = self.world_size - self.servers
        if self.workers < 1:
            raise ValueError(f"{_PREFIX} strategy async_ps with {self.servers} server(s) needs at least "
                             f"{self.servers + 1} ranks (got {self.world_size})")
        self.max_staleness = cfg.max_staleness
        self.is_server = self.rank < self.servers
        self.worker = None if self.is_server else self.rank - self.servers

        self.task = get_task(cfg.task, cfg.dropout, cfg.lm_dim, cfg.lm_layers)
        self.model = self.task.make_model(cfg.seed)  # the same initial weights on every rank
        flat = flat_parameters(self.model)
        self.numel = flat.numel()
        if self.numel < self.servers:
            raise ValueError(f"{_PREFIX} {self.servers} servers for {self.numel} parameters: each needs one")
        size = -(-self.numel // self.servers)
        self.bounds = [(s * size, min(self.numel, (s + 1) * size)) for s in range(self.servers)]

        # the workers' data: a DistributedSampler over the workers, as the trainer's over ranks
        self.sampler = DistributedSampler(range(self.task.x_train.shape[0]), num_replicas=self.workers,
                                          rank=self.worker or 0, shuffle=True, seed=cfg.seed, drop_last=True)
        self.micro_per_epoch = len(self.sampler) // cfg.batch_size
        steps_per_epoch = self.micro_per_epoch // cfg.accum_steps
        if steps_per_epoch < 1:
            raise ValueError(f"{_PREFIX} batch_size x accum_steps = {cfg.batch_size * cfg.accum_steps} is more "
                             f"than the {len(self.sampler)} training samples each of {self.workers} workers gets")
        if worker_steps is None:
            worker_steps = [cfg.epochs * steps_per_epoch if cfg.epochs else cfg.steps] * self.workers
        self.worker_steps = [int(s) for s in worker_steps]
        if len(self.worker_steps) != self.workers or min(self.worker_steps) < 1:
            raise ValueError(f"{_PREFIX} worker_steps must give at least 1 step for each of the "
                             f"{self.workers} workers (got {list(worker_steps)})")
        self.worker_delay_s = [float(d) for d in (worker_delay_s or [0.0] * self.workers)]
        self.total_updates = sum(self.worker_steps)
        if cfg.straggler is not None and parse_straggler(cfg.straggler)[0] < self.servers:
            raise ValueError(f"{_PREFIX} strategy async_ps: the straggler must be a worker, one of ranks "
                             f"{self.servers}..{self.world_size - 1} (got {cfg.straggler!r}; ranks "
                             f"0..{self.servers - 1} are servers)")
        self.straggler = Straggler(cfg.straggler, self.rank, self.world_size)
        # --eval-every: the servers keep a copy of their chunk every E versions (server 0 also the
        # training clock then); the copies are evaluated after training, off the clock
        self.eval_versions = list(range(cfg.eval_every, self.total_updates, cfg.eval_every)) \
            if cfg.eval_every else []
        self._snapshots: Dict[int, "tuple[torch.Tensor, float]"] = {}

        if self.is_server:
            lo, hi = self.bounds[self.rank]
            self.chunk = torch.nn.Parameter(flat[lo:hi].clone())
            if cfg.optimizer == "sgd":
                self.optimizer = torch.optim.SGD([self.chunk], lr=cfg.lr, momentum=cfg.momentum,
                                                 weight_decay=cfg.weight_decay)
            else:
                self.optimizer = torch.optim.AdamW([self.chunk], lr=cfg.lr, weight_decay=cfg.weight_decay)
            from .trainer import _lr_lambda

            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg, self.total_updates))
        torch.manual_seed(cfg.seed * 1000 + 17 + self.rank)  # dropout, per rank
        self.version = 0
        self._pending: List[tuple] = []  # (work, tensor) of posted sends
        self.elapsed_s = 0.0
        self.resumed_from: Optional[str] = None
        self.meter = CommMeter(self.backend == "pycomm")
        self.logger = MetricsLogger(cfg.log_file, self.rank == 0, cfg.progress, self.total_updates)

    # -- p2p helpers ---------------------------------------------------------------
    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _send(self, tensor: torch.Tensor, rank: int, tag: int) -> None:
        """isend, never waiting here: no rank ever blocks in a send, whether or not the backend
        buffers messages whose receive is not posted yet (pycomm does, gloo does not). The
        tensor must not change afterwards (callers pass fresh tensors); finished sends are
        dropped as more are posted, and ``_drain_sends`` waits for the rest."""
        self._pending.append((dist.isend(tensor, self._peer(rank), group=self.group, tag=tag), tensor))
        if len(self._pending) >= 64:
            self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]

    def _drain_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def _recv(self, tensor: torch.Tensor, rank: Optional[int], tag: int) -> int:
        source = dist.recv(tensor, None if rank is None else self._peer(rank), group=self.group, tag=tag)
        return source if self.group is None else dist.get_group_rank(self.group, source)

    # -- server side -------------------------------------------------------------------
    def _apply(self, grad: torch.Tensor) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        self.chunk.grad = grad
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        if self.cfg.eval_every and self.version % self.cfg.eval_every == 0:
            self._snapshots[self.version] = (self.chunk.detach().clone(), self.elapsed_s)
        return lr

    def _grant(self, worker: int) -> None:
        self._send(torch.tensor([float(self.version)], dtype=torch.float64), self.servers + worker,
                   _TAG_LEASE_HEADER)
        self._send(self.chunk.detach().clone(), self.servers + worker, _TAG_LEASE)

    def _recv_gradient(self, worker: Optional[int]) -> "tuple[int, List[float], torch.Tensor]":
        header = torch.zeros(5, dtype=torch.float64)
        source = self._recv(header, None if worker is None else self.servers + worker, _TAG_PUSH_HEADER)
        lo, hi = self.bounds[self.rank]
        grad = torch.empty(hi - lo)
        self._recv(grad, source, _TAG_PUSH)
        return source - self.servers, header.tolist(), grad

    def _schedule(self, kind: int, worker: int) -> None:
        for server in range(1, self.servers):
            self._send(torch.tensor([kind, worker], dtype=torch.int64), server, _TAG_SCHEDULE)

    def _serve_follower(self) -> None:
        """Server s > 0: apply and grant exactly as server 0 says."""
        order = torch.zeros(2, dtype=torch.int64)
        while True:
            self._recv(order, 0, _TAG_SCHEDULE)
            kind, worker = order.tolist()
            if kind == _STOP:
                return
            if kind == _APPLY:
                _, _, grad = self._recv_gradient(worker)
                self._apply(grad)
            else:
                self._grant(worker)

    def _serve_leader(self) -> Dict[str, Any]:
        """Server 0: receive pushes, decide what to apply and whom to lease to, log every update."""
        bound = self.max_staleness
        outstanding: Dict[int, int] = {}      # worker -> version of its lease (gradient not yet applied)
        arrived: Dict[int, tuple] = {}        # worker -> (header, gradient chunk), not yet applied
        waiting = collections.deque(range(self.workers))  # workers without a lease, longest waiting first
        remaining = set(range(self.workers))  # workers whose last gradient is not applied yet
        histogram: Dict[int, int] = collections.Counter()
        losses: List[tuple] = []
        bytes_sent = 0
        last = time.perf_counter()
        batch = self.cfg.batch_size * self.cfg.accum_steps

        def grant_all() -> None:
            while waiting and len(outstanding) <= bound:
                worker = waiting.popleft()
                outstanding[worker] = self.version
                self._schedule(_GRANT, worker)
                self._grant(worker)

        grant_all()
        while remaining:
            applied = True
            while applied:
                applied = False
                for worker in sorted(arrived, key=outstanding.__getitem__):
                    others = [tau for other, tau in outstanding.items() if other != worker]
                    if not lease_feasible(others, self.version + 1, bound):
                        continue
                    header, grad = arrived.pop(worker)
                    tau = outstanding.pop(worker)
                    staleness = self.version - tau
                    histogram[staleness] += 1
                    self._schedule(_APPLY, worker)
                    lr = self._apply(grad)
                    now = time.perf_counter()
                    step_s, last = now - last, now
                    self.elapsed_s += step_s
                    if self.version in self._snapshots:  # the clock at this version, not before it
                        self._snapshots[self.version] = (self._snapshots[self.version][0], self.elapsed_s)
                    comm = self.meter.delta()
                    bytes_sent += comm["bytes_sent"]
                    losses.append((self.version, header[3]))
                    self.logger.log({
                        "event": "step", "step": self.version, "epoch": 0, "loss": header[3], "lr": lr,
                        "worker": worker, "worker_step": int(header[1]), "staleness": staleness,
                        "samples_per_s": batch / max(step_s, 1e-9), "step_s": step_s,
                        "comm_s": comm["comm_s"], "compute_s": max(0.0, step_s - comm["comm_s"]),
                        "bytes_sent": comm["bytes_sent"], "elapsed_s": self.elapsed_s,
                    })
                    if header[4]:
                        remaining.discard(worker)
                    else:
                        waiting.append(worker)
                    grant_all()
                    applied = True
                    break
            if not remaining:
                break
            worker, header, grad = self._recv_gradient(None)
            if worker not in outstanding or worker in arrived or int(header[2]) != outstanding[worker]:
                raise RuntimeError(f"{_PREFIX} async_ps server 0: unexpected push from worker {worker} "
                                   f"(lease {int(header[2])}, outstanding {outstanding.get(worker)})")
            arrived[worker] = (header, grad)
        self._schedule(_STOP, 0)
        for worker in range(self.workers):
            self._send(torch.tensor([self.version], dtype=torch.int64), self.servers + worker, _TAG_DONE)
        count = sum(histogram.values())
        return {
            "losses": losses, "bytes_sent": bytes_sent,
            "staleness": {"histogram": {int(k): int(v) for k, v in sorted(histogram.items())},
                          "mean": sum(k * v for k, v in histogram.items()) / max(1, count),
                          "max": max(histogram, default=0), "bound": bound, "updates": count},
        }

    # -- worker side ----------------------------------------------------------------------
    def _batches(self):
        """The worker's micro-batches, in the trainer's order (a step never straddles two epochs)."""
        cfg, epoch, micro, order = self.cfg, 0, 0, None
        while True:
            if micro + cfg.accum_steps > self.micro_per_epoch:
                epoch, micro, order = epoch + 1, 0, None
            if order is None:
                self.sampler.set_epoch(epoch)
                order = list(iter(self.sampler))
            batches = []
            for _ in range(cfg.accum_steps):
                index = torch.tensor(order[micro * cfg.batch_size: (micro + 1) * cfg.batch_size])
                batches.append((self.task.x_train[index], self.task.y_train[index]))
                micro += 1
            yield batches

    def _autocast(self):
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)

    def _work(self) -> None:
        cfg = self.cfg
        steps = self.worker_steps[self.worker]
        delay = self.worker_delay_s[self.worker]
        flat = torch.empty(self.numel)
        header = torch.zeros(1, dtype=torch.float64)
        batches = self._batches()
        self.model.train()
        for step in range(steps):
            started = time.perf_counter()
            versions = set()
            for server, (lo, hi) in enumerate(self.bounds):
                self._recv(header, server, _TAG_LEASE_HEADER)
                self._recv(flat[lo:hi], server, _TAG_LEASE)
                versions.add(int(header[0]))
            if len(versions) != 1:
                raise RuntimeError(f"{_PREFIX} async_ps worker {self.worker}: servers leased versions "
                                   f"{sorted(versions)} at once")
            lease = versions.pop()
            _assign_flat(self.model, flat)
            self.model.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for x, y in next(batches):
                with self._autocast():
                    loss = self.task.loss(self.model(x), y) / cfg.accum_steps
                loss.backward()
                loss_sum += loss.item()
            if cfg.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad_norm)
            grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                              for p in self.model.parameters()])
            if delay:
                time.sleep(delay)
            self.straggler.delay(time.perf_counter() - started)
            push = torch.tensor([self.worker, step, lease, loss_sum, step == steps - 1], dtype=torch.float64)
            for server, (lo, hi) in enumerate(self.bounds):
                self._send(push, server, _TAG_PUSH_HEADER)
                self._send(grad[lo:hi].clone(), server, _TAG_PUSH)
        # wait for the end of training. On pycomm without a timed receive: poll a posted one
        # (gloo's receives report completion only through wait(), bounded by the group timeout)
        done = torch.zeros(1, dtype=torch.int64)
        request = dist.irecv(done, self._peer(0), group=self.group, tag=_TAG_DONE)
        while self.backend == "pycomm" and not request.is_completed():
            time.sleep(0.02)
        request.wait()
        self.version = int(done[0])

    # -- the whole run -------------------------------------------------------------------------
    def fit(self) -> Dict[str, Any]:
        """Collective over all ranks: serve or work until every worker is done, then evaluate."""
        cfg = self.cfg
        self.logger.log({"event": "start", "config": cfg.to_dict(), "world_size": self.world_size,
                         "backend": self.backend, "total_steps": self.total_updates, "run_name": cfg.run_name,
                         "servers": self.servers, "workers": self.workers, "worker_steps": self.worker_steps,
                         "train_samples": int(self.task.x_train.shape[0])})
        dist.barrier(group=self.control)  # every rank is ready: the clocks start together
        start = time.perf_counter()
        summary: Dict[str, Any] = {}
        try:
            if self.rank == 0:
                summary = self._serve_leader()
            elif self.is_server:
                self._serve_follower()
            else:
                self._work()
            self._drain_sends()
            if self.rank != 0:
                self.elapsed_s = time.perf_counter() - start
            # the final parameters, from the servers' chunks (control group: not counted as training)
            full = torch.zeros(self.numel)
            if self.is_server:
                lo, hi = self.bounds[self.rank]
                full[lo:hi] = self.chunk.detach()
            dist.all_reduce(full, group=self.control)
            _assign_flat(self.model, full)
            summary = bytes_to_tensors(broadcast_bytes(tensors_to_bytes(summary) if self.rank == 0 else None,
                                                       src=0, group=self.control))
            evals = self._evaluate_snapshots()
            final = self.evaluate()
            self.logger.log(final)
            evals.append(final)
            staleness = summary["staleness"]
            self.logger.log({"event": "end", "step": self.total_updates, "wall_s": self.elapsed_s,
                             "test_accuracy": final["test_accuracy"], "test_loss": final["test_loss"],
                             "bytes_sent_rank0": summary["bytes_sent"], "world_size": self.world_size,
                             "strategy": cfg.strategy, "hook": None, "run_name": cfg.run_name,
                             "staleness": staleness})
            return {"losses": summary["losses"], "evals": evals, "step": self.total_updates,
                    "bytes_sent": summary["bytes_sent"], "wall_s": self.elapsed_s, "final": final,
                    "worker_distance": None, "params": full, "local_params": full, "staleness": staleness}
        finally:
            self.logger.close()

    def _evaluate_snapshots(self) -> List[Dict[str, Any]]:
        """Collective, after training: evaluate the parameters the servers held at every
        ``eval_versions`` version, each logged with the training clock of that version."""
        final_params, final_elapsed = [p.detach().clone() for p in self.model.parameters()], self.elapsed_s
        evals = []
        for version in self.eval_versions:
            full = torch.zeros(self.numel)
            clock = torch.zeros(1, dtype=torch.float64)
            if self.is_server:
                lo, hi = self.bounds[self.rank]
                chunk, elapsed = self._snapshots[version]
                full[lo:hi] = chunk
                if self.rank == 0:
                    clock[0] = elapsed
            dist.all_reduce(full, group=self.control)
            dist.all_reduce(clock, group=self.control)
            _assign_flat(self.model, full)
            self.elapsed_s = float(clock[0])
            record = self.evaluate()
            record["step"] = version
            self.logger.log(record)
            evals.append(record)
        with torch.no_grad():
            for p, saved in zip(self.model.parameters(), final_params):
                p.copy_(saved)
        self.elapsed_s = final_elapsed
        return evals

    @torch.no_grad()
    def evaluate(self) -> Dict[str, Any]:
        """Collective: test loss and accuracy of the model, test set sharded over all ranks."""
        self.model.eval()
        x = self.task.x_test[self.rank::self.world_size]
        y = self.task.y_test[self.rank::self.world_size]
        totals = torch.zeros(3, dtype=torch.float64)
        if x.shape[0]:
            with self._autocast():
                out = self.model(x)
            totals += torch.tensor(self.task.score(out, y), dtype=torch.float64)
        dist.all_reduce(totals, group=self.control)
        self.model.train()
        loss, correct, count = totals.tolist()
        return {"event": "eval", "step": self.total_updates, "test_loss": loss / count,
                "test_accuracy": correct / count, "elapsed_s": self.elapsed_s}


register_strategy(StrategySpec("async_ps", trainer=AsyncPSTrainer, validate=check_own_loop))
