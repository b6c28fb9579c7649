"""Hogwild! (Recht, Re, Wright and Niu 2011): ``--strategy hogwild``, one host.

The parent process builds the model, moves its parameters to shared memory
(``Module.share_memory()``, i.e. ``share_memory_()`` on every tensor) and starts ``n``
worker processes (``torch.multiprocessing``, spawn), which start training together
behind a barrier. Every worker computes gradients on its own shard of the data (the same
``DistributedSampler`` split as the data-parallel strategies) and applies its optimizer
step straight to the shared parameters, without locks: workers may read parameters
that another worker is half-way through writing. Recht et al. prove this converges when
updates are sparse (each step touches few coordinates, so collisions are rare); for dense
models like the digits MLP it still trains, with some lost updates.

There is no process group and no communication: ``pycomm-train -n N --strategy
hogwild`` runs on this host only (not under torchrun). Optimizer state (momentum) and
gradients are per worker; only the parameters are shared. After the workers finish, the
parent evaluates the shared model and (with ``--log-file``) writes worker 0's step
records. ``--straggler RANK:FACTOR`` slows worker RANK as for the other strategies.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

from .base import _PREFIX, register_strategy, StrategySpec
from .config import ConfigError, TrainConfig
from .metrics import MetricsLogger
from .straggler import Straggler
from .tasks import get_task

__all__ = ["run_hogwild", "hogwild_order"]


def _check(cfg: TrainConfig, nprocs: int) -> None:
    from ..launch import torchrun_env

    if torchrun_env() is not None:
        raise ConfigError(f"{_PREFIX} hogwild shares one model in this host's memory: run it with "
                          f"pycomm-train -n N, not under torchrun")
    unsupported = [(name, value) for name, value in (
        ("device", cfg.device != "cpu" and cfg.device), ("precision", cfg.precision != "fp32" and cfg.precision),
        ("accum_steps", cfg.accum_steps != 1 and cfg.accum_steps),
        ("checkpoint_dir", cfg.checkpoint_dir), ("resume", cfg.resume),
        ("clip_grad_norm", cfg.clip_grad_norm)) if value]
    if unsupported:
        raise ConfigError(f"{_PREFIX} hogwild does not support {', '.join(n for n, _ in unsupported)} "
                          f"(got {', '.join(f'{n}={v!r}' for n, v in unsupported)})")
    if nprocs < 1:
        raise ConfigError(f"{_PREFIX} hogwild needs at least 1 worker (got {nprocs})")


def hogwild_order(num_samples: int, worker: int, workers: int, seed: int, epoch: int) -> List[int]:
    """The sample indices of ``worker`` in ``epoch`` (DistributedSampler, as the other strategies)."""
    from torch.utils.data import DistributedSampler

    from .trainer import _Indices

    sampler = DistributedSampler(_Indices(num_samples), num_replicas=workers, rank=worker, shuffle=True,
                                 seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return list(iter(sampler))


def _worker(worker: int, workers: int, cfg: TrainConfig, model, threads: int, conn, start_barrier=None) -> None:
    try:
        torch.set_num_threads(threads)
        from .trainer import _lr_lambda

        task = get_task(cfg.task, cfg.dropout, cfg.lm_dim, cfg.lm_layers)
        torch.manual_seed(cfg.seed * 1000 + 17 + worker)
        if cfg.optimizer == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                        weight_decay=cfg.weight_decay)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        count = task.x_train.shape[0]
        per_worker = count // workers
        steps_per_epoch = per_worker // cfg.batch_size
        if steps_per_epoch < 1:
            raise ValueError(f"{_PREFIX} batch_size {cfg.batch_size} is more than the {per_worker} training "
                             f"samples each of {workers} workers gets")
        total = cfg.epochs * steps_per_epoch if cfg.epochs else cfg.steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg, total))
        straggler = Straggler(cfg.straggler, worker, workers)
        model.train()
        records: List[Dict[str, Any]] = []
        snapshots: List[Any] = []  # --eval-every, worker 0: (step, its clock, the shared parameters then)
        order: List[int] = []
        elapsed = 0.0
        if start_barrier is not None:  # start together: process start-up takes seconds and varies
            start_barrier.wait(timeout=cfg.timeout_s)
        for step in range(total):
            start = time.perf_counter()
            epoch, position = divmod(step, steps_per_epoch)
            if position == 0:
                order = hogwild_order(count, worker, workers, cfg.seed, epoch)
            index = torch.tensor(order[position * cfg.batch_size: (position + 1) * cfg.batch_size])
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model(task.x_train[index]), task.y_train[index])
            loss.backward()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()  # in place, into the shared parameters, no lock
            scheduler.step()
            straggler.delay(time.perf_counter() - start)
            step_s = time.perf_counter() - start
            elapsed += step_s
            records.append({"event": "step", "step": step + 1, "epoch": epoch, "loss": loss.item(), "lr": lr,
                            "samples_per_s": cfg.batch_size / step_s, "step_s": step_s, "comm_s": 0.0,
                            "compute_s": step_s, "bytes_sent": 0, "elapsed_s": elapsed, "worker": worker})
            if worker == 0 and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total:
                # numpy copies: a tensor would travel through the pipe as a shared-memory handle
                # that dies with this process before the launcher reads it
                snapshots.append((step + 1, elapsed, [p.detach().numpy().copy() for p in model.parameters()]))
        conn.send(("ok", worker, {"records": records, "wall_s": elapsed, "slept_s": straggler.slept_s,
                                  "snapshots": snapshots}))
    except BaseException:
        conn.send(("error", worker, traceback.format_exc()))
    finally:
        conn.close()


@torch.no_grad()
def _evaluate(task, model) -> Dict[str, Any]:
    model.eval()
    loss, correct, count = task.score(model(task.x_test), task.y_test)
    return {"event": "eval", "test_loss": loss / count, "test_accuracy": correct / count}


def run_hogwild(cfg: TrainConfig, nprocs: int = 2, threads: Optional[int] = None,
                timeout_s: Optional[float] = None) -> Dict[str, Any]:
    """Train ``cfg`` with ``nprocs`` Hogwild! workers on one shared model; a run summary.

    The summary has the keys of ``pycomm-train``'s (``bytes_sent`` is 0), plus
    ``params`` (the final shared parameters, flat) and ``workers`` (each worker's losses
    and seconds). A worker that fails or outlives ``timeout_s`` (default: the config's
    ``timeout_s`` x 10) ends the run with RuntimeError."""
    import torch.multiprocessing as mp

    cfg.validate()
    _check(cfg, nprocs)
    task = get_task(cfg.task, cfg.dropout, cfg.lm_dim, cfg.lm_layers)
    model = task.make_model(cfg.seed)
    model.share_memory()  # every parameter tensor: share_memory_()
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    barrier = ctx.Barrier(nprocs)
    for worker in range(nprocs):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(worker, nprocs, cfg, model, threads, writer, barrier),
                           name=f"pycomm-hogwild{worker}", daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else 10 * cfg.timeout_s)
    try:
        pending = dict(enumerate(conns))
        while pending:
            ready = multiprocessing.connection.wait(list(pending.values()), timeout=0.5)
            for conn in ready:
                worker = next(w for w, c in pending.items() if c is conn)
                try:
                    kind, _, payload = conn.recv()
                except EOFError:
                    raise RuntimeError(f"{_PREFIX} hogwild worker {worker} died (exit code "
                                       f"{procs[worker].exitcode}) without reporting") from None
                if kind == "error":
                    raise RuntimeError(f"{_PREFIX} hogwild worker {worker} failed:\n{payload}")
                results[worker] = payload
                del pending[worker]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{_PREFIX} hogwild workers {sorted(pending)} did not finish in time")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
    # training wall-clock, as for the other strategies: the slowest worker's steps (not the
    # seconds it takes to spawn processes and import torch)
    wall_s = max(r["wall_s"] for r in results.values())
    evals = []
    if results[0]["snapshots"]:  # evaluated now, off the clock
        evaluated = task.make_model(cfg.seed)
        for step, elapsed, params in results[0]["snapshots"]:
            with torch.no_grad():
                for p, saved in zip(evaluated.parameters(), params):
                    p.copy_(torch.from_numpy(saved))
            evals.append({**_evaluate(task, evaluated), "step": step, "elapsed_s": elapsed})
    final = _evaluate(task, model)
    records = results[0]["records"]
    final["step"] = len(records)
    final["elapsed_s"] = wall_s
    logger = MetricsLogger(cfg.log_file, True, False, len(records))
    try:
        logger.log({"event": "start", "config": cfg.to_dict(), "world_size": nprocs, "backend": None,
                    "total_steps": len(records), "run_name": cfg.run_name,
                    "train_samples": int(task.x_train.shape[0])})
        for record in sorted(records + evals, key=lambda r: (r["step"], r["event"] == "eval")):
            logger.log(record)
        logger.log(final)
        logger.log({"event": "end", "step": len(records), "wall_s": wall_s, "test_accuracy": final["test_accuracy"],
                    "test_loss": final["test_loss"], "bytes_sent_rank0": 0, "world_size": nprocs,
                    "strategy": "hogwild", "hook": None, "run_name": cfg.run_name})
    finally:
        logger.close()
    params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return {
        "world_size": nprocs, "strategy": "hogwild", "hook": None, "task": cfg.task, "steps": len(records),
        "wall_s": wall_s, "bytes_sent": 0, "final": final, "evals": evals + [final], "worker_distance": None,
        "resumed_from": None,
        "last_loss": records[-1]["loss"] if records else None,
        "strategy_summary": {"workers": nprocs, "updates": sum(len(r["records"]) for r in results.values()),
                             "slept_s": [results[w]["slept_s"] for w in sorted(results)]},
        "params": params,
        "workers": {w: {"losses": [r["loss"] for r in results[w]["records"]], "wall_s": results[w]["wall_s"]}
                    for w in sorted(results)},
    }


register_strategy(StrategySpec(
    "hogwild", run=run_hogwild, summary="one host", refusal="hogwild is not a process-group strategy: its workers share one model in this host's memory; "
                       "use pycomm.train.hogwild.run_hogwild or pycomm-train -n N"))
