"""``pycomm-train``: distributed training with pycomm in one command.

Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) each process is one rank and joins the
job through ``env://``::

    torchrun --standalone --nproc_per_node 2 -m pycomm.train --task digits-mlp --strategy sync

Without torchrun, ``-n N`` spawns N ranks on this host (a convenience for trying things)::

    pycomm-train -n 2 --config run.yaml --steps 300

Settings come from the defaults of :class:`~pycomm.train.config.TrainConfig`, then a YAML
file (``--config``), then flags (``--batch-size 64``). ``pycomm-train plot A.jsonl B.jsonl
-o cmp.png`` draws loss against step and wall-clock for logged runs.

Exit status: 0 on success, 1 when training failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from typing import Any, Dict, Optional, Sequence

from ..launch import launch_workers, torchrun_env
from .base import _PREFIX, strategy_names, strategy_spec
from .config import ConfigError, TrainConfig, load_yaml
from .parallel import check_world_size
from .straggler import check_straggler_rank

__all__ = ["main", "build_parser", "parse_config", "run", "describe_comm"]


_HELP = {
    "task": "built-in task: digits-mlp, digits-cnn, digits-logreg, tinylm, tinylm-mp (tinylm for model parallelism)",
    "dropout": "dropout probability (default: the task's)",
    "lm_dim": "tinylm-mp: model width",
    "lm_layers": "tinylm-mp: Transformer blocks",
    "parallel": "ddp (data parallel; the strategies), fsdp (FSDP2), tp (DTensor tensor parallel), pp (pipeline), "
                "dp_tp, dp_pp (2 x 2 mesh, 4 ranks); see docs/training.md",
    "microbatches": "pp, dp_pp: micro-batches per step, dividing --batch-size (None: 4)",
    "pp_schedule": "pp, dp_pp: pipeline schedule gpipe or 1f1b (None: gpipe)",
    "hook": "comm hook for sync steps: allreduce, fp16, bf16, topk, quantize, powersgd, torch_powersgd, "
            "or package.module:attribute",
    "local_sgd_period": "local SGD: average the models every H steps",
    "local_sgd_warmup": "local SGD: synchronous steps before going local",
    "easgd_period": "EASGD: elastic update every tau steps",
    "easgd_alpha": "EASGD moving rate (default 0.9 / world size)",
    "servers": "async_ps: parameter-server ranks (the first ranks; the others are workers)",
    "max_staleness": "async_ps: most versions a gradient may lag behind when applied (0: sequential)",
    "cocoa_gamma": "cocoa: aggregation parameter gamma in (0, 1], sigma' = gamma x ranks (1: add, 1/K: average)",
    "cocoa_lambda": "cocoa: L2 regularisation lambda",
    "cocoa_local_passes": "cocoa: local SDCA passes over the rank's partition per round",
    "backend": "torch.distributed backend (pycomm, gloo, nccl)",
    "algorithm": "pycomm all-reduce algorithm: auto, ring, tree, sharded",
    "timeout_s": "process-group timeout in seconds",
    "steps": "optimizer steps (ignored with --epochs)",
    "epochs": "train this many epochs instead of --steps",
    "batch_size": "samples per rank and micro-step",
    "accum_steps": "gradient accumulation: micro-steps per optimizer step",
    "optimizer": "sgd or adamw",
    "schedule": "learning-rate schedule: constant, cosine, step",
    "warmup_steps": "linear learning-rate warm-up steps",
    "clip_grad_norm": "clip the global gradient norm to this value",
    "precision": "fp32, bf16 (autocast), fp16 (CUDA only, grad scaler)",
    "device": "cpu or cuda",
    "rank_seeds": "initialise each rank's model from seed + rank (DDP broadcasts rank 0's)",
    "eval_every": "evaluate every N steps (0: only at the end)",
    "log_file": "JSON-lines log written by rank 0",
    "progress": "progress bar on rank 0",
    "run_name": "name of the run in logs and plots",
    "checkpoint_dir": "directory for checkpoints (written by rank 0)",
    "checkpoint_every": "checkpoint every N steps (0: at the end only)",
    "resume": "checkpoint file or directory to resume from, or 'auto' (latest in --checkpoint-dir, if any)",
    "fail_at_step": argparse.SUPPRESS,
    "topology": "gossip: ring or exp (exponential graph) of neighbours",
    "consensus_every": "gossip: report the consensus distance every K steps (0: never)",
    "local_epochs": "fedavg: local epochs per round",
    "participation": "fedavg: fraction of ranks (seeded subset) that train in each round",
    "noniid": "fedavg: split the data by label, Dirichlet(ALPHA) per label over ranks (None: IID)",
    "straggler": "RANK:FACTOR: rank RANK sleeps so that its steps take FACTOR x its compute time",
}


def _field_type(field: dataclasses.Field):
    annotation = str(field.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if name in annotation:
            return kind
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycomm-train",
        description="Data- and model-parallel training on the pycomm backend (launch with torchrun, or -n N "
                    "to spawn N local ranks). Subcommand: 'pycomm-train plot RUN.jsonl ... -o out.png'.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file with settings (flags override it)")
    parser.add_argument("-n", "--nprocs", type=int, help="ranks to spawn locally when not under torchrun "
                        "(default 2)")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores / local ranks)")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _field_type(field)
        help_text = _HELP.get(field.name, "") if field.name != "strategy" else _strategy_help()
        if help_text is not argparse.SUPPRESS:
            help_text = f"{help_text} (default: {getattr(defaults, field.name)})"
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=field.name, type=kind, help=help_text)
    return parser


def parse_config(argv: Optional[Sequence[str]] = None) -> "tuple[TrainConfig, Dict[str, Any]]":
    """(config, launcher options) from flags and the YAML file they name."""
    args = vars(build_parser().parse_args(argv))
    launcher = {key: args.pop(key) for key in ("config", "nprocs", "threads") if key in args}
    values: Dict[str, Any] = {}
    if launcher.get("config"):
        values.update(load_yaml(launcher["config"]))
    values.update(args)
    source = launcher.get("config") or "flags"
    return TrainConfig.from_dict(values, source=source), launcher


def _worker(rank: int, world_size: int, init_method: str, payload) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .trainer import build_trainer

    cfg, threads = payload
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    if cfg.backend == "pycomm":
        import pycomm  # noqa: F401  (registers the backend)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun (torch 2.13) lets every restart attempt share the agent's TCPStore, so the
        # listening addresses a failed attempt published (pycomm's and gloo's alike) are still
        # there and a new rank could read a dead peer's. A key prefix per attempt keeps them apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        dist.init_process_group(cfg.backend, store=dist.PrefixStore(f"pycomm_train/attempt_{attempt}", store),
                                rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(cfg.backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
    trainer = build_trainer(cfg)
    result = trainer.fit()
    summary = {
        "world_size": world_size, "strategy": cfg.strategy, "hook": cfg.hook, "task": cfg.task,
        "steps": result["step"], "wall_s": result["wall_s"], "bytes_sent": result["bytes_sent"],
        "final": result.get("final"), "worker_distance": result.get("worker_distance"),
        "resumed_from": trainer.resumed_from, "last_loss": result["losses"][-1][1] if result["losses"] else None,
        "strategy_summary": result.get("strategy_summary"),
        "staleness": result.get("staleness"), "duality_gap": result.get("duality_gap"),
        "comm": describe_comm(cfg), "memory": result.get("memory"),
    }
    dist.destroy_process_group()
    return summary


def _strategy_help() -> str:
    """The registered strategies (pycomm.train.base), each with its few words."""
    return ", ".join(f"{name} ({strategy_spec(name).summary})" if strategy_spec(name).summary else name
                     for name in strategy_names())


def run(cfg: TrainConfig, nprocs: int = 2, threads: Optional[int] = None) -> Dict[str, Any]:
    """Train ``cfg`` on ``nprocs`` locally spawned ranks (or as this torchrun rank); rank 0's summary."""
    own_run = strategy_spec(cfg.strategy).run
    if own_run is not None:  # hogwild: worker processes sharing one model in memory, no process group
        return own_run(cfg, nprocs, threads)
    try:
        return launch_workers(_worker, nprocs, (cfg, threads), prefix=_PREFIX)
    except RuntimeError as exc:  # a plain RuntimeError: main() names the type in its message
        raise RuntimeError(str(exc)) from None


def describe_comm(cfg: TrainConfig) -> Optional[str]:
    """What moved the gradients, for the summary line: the DDP comm hook where one ran
    (sync; local_sgd's warm-up), the --parallel mode, or None (the strategy's own traffic)."""
    if cfg.parallel != "ddp":
        from .parallel import describe_parallel

        return f"parallel {describe_parallel(cfg)}"
    describe = strategy_spec(cfg.strategy).describe
    return describe(cfg) if describe is not None else None  # None: no gradient all-reduce


def _print_memory(memory) -> None:
    from .memory import format_bytes

    for rank, mine in enumerate(memory):
        print(f"pycomm-train: memory per rank: rank {rank}: model state {format_bytes(mine['state'])} "
              f"(params {format_bytes(mine['params'])}, grads {format_bytes(mine['grads'])}, "
              f"optimizer {format_bytes(mine['optimizer'])}), peak RSS growth "
              f"{format_bytes(mine['rss_peak_growth'])}", flush=True)


def _print_summary(summary: Dict[str, Any]) -> None:
    final = summary.get("final") or {}
    comm = f" ({summary['comm']})" if summary.get("comm") else ""
    print(f"pycomm-train: {summary['task']} {summary['strategy']}{comm} on "
          f"{summary['world_size']} ranks: {summary['steps']} steps in {summary['wall_s']:.2f} s, "
          f"test loss {final.get('test_loss', float('nan')):.4f}, "
          f"test accuracy {final.get('test_accuracy', float('nan')) * 100:.2f}%, "
          f"{summary['bytes_sent'] / 2 ** 20:.1f} MiB sent by rank 0", flush=True)
    if summary.get("memory"):
        _print_memory(summary["memory"])
    extra = summary.get("strategy_summary") or {}
    if extra.get("consensus_distance_mean") is not None:
        print(f"pycomm-train: consensus distance (RMS over ranks of ||x_i - mean||): mean "
              f"{extra['consensus_distance_mean']:.3g}, max {extra['consensus_distance_max']:.3g}, "
              f"last {extra['consensus_distance'][-1][1]:.3g}", flush=True)
    if summary.get("staleness"):  # async_ps
        stale = summary["staleness"]
        print(f"staleness (bound {stale['bound']}): mean {stale['mean']:.2f}, max {stale['max']}, "
              f"histogram {stale['histogram']}", flush=True)
    if summary.get("duality_gap"):  # cocoa
        gaps = summary["duality_gap"]
        print(f"duality gap: {gaps[0]['gap']:.3e} at round 0, {gaps[-1]['gap']:.3e} after round "
              f"{gaps[-1]['round']} (primal {gaps[-1]['primal']:.6f})", flush=True)


def _plot_main(argv: Sequence[str]) -> int:
    from .plot import plot_runs

    parser = argparse.ArgumentParser(prog="pycomm-train plot",
                                     description="Plot loss vs step and vs wall-clock for logged runs.")
    parser.add_argument("logs", nargs="+", help="JSON-lines logs written with --log-file")
    parser.add_argument("-o", "--output", default="runs.png", help="PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        plot_runs(args.logs, args.output, title=args.title)
    except (OSError, ValueError) as exc:
        print(f"{_PREFIX} {exc}" if not str(exc).startswith(_PREFIX) else str(exc), file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:
        return _plot_main(argv[1:])
    try:
        cfg, launcher = parse_config(argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    launched = torchrun_env()
    nprocs = launcher.get("nprocs") or 2
    if nprocs < 1:
        print(f"{_PREFIX} --nprocs must be at least 1", file=sys.stderr)
        return 2
    try:
        check_straggler_rank(cfg.straggler, launched[1] if launched else nprocs)
        check_world_size(cfg, launched[1] if launched else nprocs)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        summary = run(cfg, nprocs, launcher.get("threads"))
    except ConfigError as exc:  # a usage error found at launch (hogwild under torchrun, ...)
        print(exc, file=sys.stderr)
        return 2
    except (RuntimeError, ValueError, OSError) as exc:
        message = str(exc)
        if not message.startswith(_PREFIX):
            message = f"{_PREFIX} {type(exc).__name__}: {message}"
        rank = f" (rank {launched[0]})" if launched else ""
        print(message + rank, file=sys.stderr, flush=True)
        return 1
    if launched is None or launched[0] == 0:
        _print_summary(summary)
        if cfg.log_file:
            print(f"log: {cfg.log_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
