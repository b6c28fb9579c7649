"""The main job on defaults: ``python -m pycomm.demo``.

1. A short all-reduce sweep (8 B .. 16 MiB, step 16, algorithm ``auto``)
   against gloo at 2 ranks, through :mod:`pycomm.bench`.
2. A short data-parallel training run through :mod:`pycomm.train` (DDP on the
   ``pycomm`` backend, dense all-reduce hook): the MLP on scikit-learn's digits.
   Each rank initialises its model from a different seed, so equal parameters
   at the end show that DDP's initial broadcast and every gradient all-reduce
   went through pycomm correctly. The same training also runs on a gloo
   process group in the same processes; pycomm's result must match it.

Exit status 0 when the benchmark checks, the parameter equality across ranks
and the agreement with gloo all pass; 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from pycomm import bench
from pycomm.bench.runners import import_pycomm
from pycomm.bench.sweep import PREFIX as _BENCH_PREFIX
from pycomm.launch import launch_workers, torchrun_env

__all__ = ["DemoConfig", "main", "run_training", "train_config"]

_PREFIX = "pycomm demo:"

# Largest |difference| between the pycomm-trained and gloo-trained parameters
# that still counts as the same training (reduction order may differ).
_REFERENCE_ATOL = 1e-4


@dataclasses.dataclass
class DemoConfig:
    """Settings of the training part; picklable, so it travels to the workers."""

    steps: int = 100
    backend: str = "pycomm"
    reference: Optional[str] = "gloo"
    task: str = "digits-mlp"
    batch_per_rank: int = 32
    learning_rate: float = 0.05
    seed: int = 1234
    timeout_s: float = 120.0


def train_config(cfg: DemoConfig):
    """The :class:`pycomm.train.TrainConfig` of the demo's run."""
    from pycomm.train import TrainConfig

    return TrainConfig(task=cfg.task, strategy="sync", hook="allreduce", backend=cfg.backend,
                       steps=cfg.steps, batch_size=cfg.batch_per_rank, lr=cfg.learning_rate,
                       momentum=0.9, schedule="cosine", seed=cfg.seed, rank_seeds=True,
                       progress=False, timeout_s=cfg.timeout_s)


def _train(cfg: DemoConfig, group, control) -> Dict[str, Any]:
    """One pycomm.train run over ``group``; losses, accuracy, final parameters and comm figures."""
    from pycomm.train import Trainer

    result = Trainer(train_config(cfg), process_group=group, control_group=control).fit()
    losses = [loss for _, loss in result["losses"]]
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "test_loss": result["final"]["test_loss"],
        "accuracy": result["final"]["test_accuracy"],
        "wall_s": result["wall_s"],
        "bytes_sent": result["bytes_sent"],
        "parameters": result["local_params"],
    }


def _training_worker(rank: int, world_size: int, init_method: str, cfg: DemoConfig) -> Dict[str, Any]:
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if cfg.backend == "pycomm":
        import_pycomm()
    dist.init_process_group(cfg.backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        # Checks travel over an independent gloo group, never over the backend under test.
        control = dist.new_group(backend="gloo", timeout=timeout)
        reference_group = (dist.new_group(backend=cfg.reference, timeout=timeout)
                           if cfg.reference else None)

        result = _train(cfg, None, control)
        params = result.pop("parameters")

        # Same parameters on every rank: compare with rank 0's, bit for bit.
        rank0_params = params.clone()
        dist.broadcast(rank0_params, src=0, group=control)
        max_rank_diff = (params - rank0_params).abs().max().reshape(1)
        dist.all_reduce(max_rank_diff, op=dist.ReduceOp.MAX, group=control)
        result["max_rank_diff"] = float(max_rank_diff)
        result["params_equal"] = result["max_rank_diff"] == 0.0

        # Mean of the first/last step losses over ranks (each rank saw its own batches).
        losses = torch.tensor([result["first_loss"], result["last_loss"]], dtype=torch.float64)
        dist.all_reduce(losses, group=control)
        result["first_loss"], result["last_loss"] = (losses / world_size).tolist()

        if reference_group is not None:
            reference = _train(cfg, reference_group, control)
            result["reference_max_diff"] = float((params - reference["parameters"]).abs().max())
            result["reference_accuracy"] = reference["accuracy"]
            result["reference_wall_s"] = reference["wall_s"]
        dist.barrier(group=control)
        return result
    finally:
        dist.destroy_process_group()


def run_training(cfg: DemoConfig, nprocs: int) -> Dict[str, Any]:
    """Run the DDP training on ``nprocs`` spawned ranks (or the torchrun job); rank 0's result."""
    if cfg.steps < 1:
        raise ValueError(f"{_PREFIX} --steps must be at least 1 (got {cfg.steps})")
    if nprocs < 1:
        raise ValueError(f"{_PREFIX} --nprocs must be at least 1 (got {nprocs})")
    # The worker checks pycomm with the benchmark's import_pycomm, whose errors say "pycomm bench:".
    return launch_workers(_training_worker, nprocs, cfg, prefix=_BENCH_PREFIX,
                          expected_errors=(_BENCH_PREFIX,))


def _is_rank0() -> bool:
    env = torchrun_env()
    return env is None or env[0] == 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point. Returns 0 when everything checked out, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m pycomm.demo",
        description="pycomm on defaults: a short all-reduce benchmark against gloo, then a "
                    "short DDP training run on the pycomm backend with a check that the "
                    "parameters are identical on every rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-n", "--nprocs", type=int, default=2,
                        help="ranks to spawn on this host (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--backend", default="pycomm",
                        help="backend to demonstrate (gloo runs the same demo as a baseline)")
    parser.add_argument("--no-bench", dest="bench", action="store_false",
                        help="skip the benchmark part")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.nprocs < 1:
        parser.error(f"{_PREFIX} --steps and --nprocs must be at least 1")

    ok = True
    say = print if _is_rank0() else (lambda *a, **k: None)
    try:
        if args.bench:
            say(f"== 1/2: all-reduce, {args.backend} vs gloo ==", flush=True)
            bench_cfg = bench.BenchConfig(
                nprocs=args.nprocs, min_bytes=8, max_bytes=16 * 2 ** 20, step_factor=16,
                iters=10, warmup=2, algos=("auto",), backend=args.backend, peer="gloo",
            )
            bench_result = bench.run_benchmark(bench_cfg)
            ok &= bench_result.ok
            say()

        say(f"== 2/2: DDP training on {args.backend} with pycomm.train (digits MLP), "
            f"{args.steps} steps ==", flush=True)
        cfg = DemoConfig(steps=args.steps, backend=args.backend,
                         reference=None if args.backend == "gloo" else "gloo")
        result = run_training(cfg, args.nprocs)
    except (RuntimeError, ValueError) as exc:
        message = str(exc)
        if not message.startswith((_BENCH_PREFIX, _PREFIX)):
            message = f"{_PREFIX} {message}"
        print(message, file=sys.stderr)
        return 1

    say(f"loss: first step {result['first_loss']:.4f} -> last step {result['last_loss']:.4f} "
        f"(test set at the end: {result['test_loss']:.4f})")
    say(f"test accuracy: {result['accuracy'] * 100:.1f}% (digits, 10 classes, chance 10%); "
        f"{result['wall_s']:.2f} s of training, {result['bytes_sent'] / 2 ** 20:.1f} MiB sent by rank 0")
    verdict = "OK" if result["params_equal"] else "FAIL"
    say(f"parameters identical on all ranks: {verdict} (max |difference| {result['max_rank_diff']:.3g})")
    ok &= result["params_equal"]
    if "reference_max_diff" in result:
        same = result["reference_max_diff"] <= _REFERENCE_ATOL
        say(f"matches the same training on gloo: {'OK' if same else 'FAIL'} "
            f"(max |difference| {result['reference_max_diff']:.3g}, tolerance {_REFERENCE_ATOL:g})")
        ok &= same
    say(f"demo: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
