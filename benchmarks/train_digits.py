"""Digits (MLP) across communication strategies and world sizes, through pycomm.train.

    python benchmarks/train_digits.py            # writes benchmarks/results/train_digits.{md,json,png}

Every run trains the same model for the same number of epochs with the same per-rank
batch, on locally spawned ranks over the pycomm backend, and reports the final test
accuracy (of the consensus model: the replicas for sync, their average for local SGD,
the centre for EASGD), the training wall-clock (rank 0, excluding process start-up),
and the bytes rank 0 sent (pycomm.stats()). On a 2-core machine 4 ranks oversubscribe
the CPU: compare strategies within one world size, not absolute times across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

from pycomm.train import TrainConfig
from pycomm.train.cli import run
from pycomm.train.plot import plot_runs

__all__ = ["STRATEGIES", "main"]

STRATEGIES = {
    "sync dense": dict(strategy="sync", hook="allreduce"),
    "sync fp16 hook": dict(strategy="sync", hook="fp16"),
    "local SGD H=4": dict(strategy="local_sgd", local_sgd_period=4),
    "EASGD tau=4": dict(strategy="easgd", easgd_period=4),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results", "train_digits"),
                        help="output path without extension (.md, .json, .png are written)")
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    command = "python benchmarks/train_digits.py" + ("" if argv is None else " " + " ".join(argv))
    if argv is None and len(sys.argv) > 1:
        command = "python benchmarks/train_digits.py " + " ".join(sys.argv[1:])

    rows, logs, labels = [], [], []
    with tempfile.TemporaryDirectory(prefix="train_digits_") as tmp:
        for world in world_sizes:
            for name, changes in STRATEGIES.items():
                log = os.path.join(tmp, f"{name.replace(' ', '_').replace('=', '')}_n{world}.jsonl")
                cfg = TrainConfig(task="digits-mlp", epochs=args.epochs, batch_size=args.batch_size,
                                  lr=args.lr, momentum=0.9, schedule="cosine", seed=0, progress=False,
                                  log_file=log, run_name=f"{name}, {world} ranks", **changes)
                start = time.perf_counter()
                summary = run(cfg, nprocs=world, threads=1)
                launch_s = time.perf_counter() - start
                row = {
                    "strategy": name, "world_size": world, "steps": summary["steps"],
                    "test_accuracy": summary["final"]["test_accuracy"],
                    "test_loss": summary["final"]["test_loss"],
                    "train_wall_s": summary["wall_s"], "launch_wall_s": launch_s,
                    "mib_sent_rank0": summary["bytes_sent"] / 2 ** 20,
                }
                rows.append(row)
                logs.append(log)
                labels.append(f"{name}, n={world} ({row['test_accuracy'] * 100:.1f}%)")
                print(f"{name:>16} n={world}: acc {row['test_accuracy'] * 100:6.2f}%  "
                      f"train {row['train_wall_s']:6.2f} s  ({row['steps']} steps, "
                      f"{row['mib_sent_rank0']:.1f} MiB sent)", flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        plot_runs(logs, args.out + ".png", labels=labels,
                  title=f"digits MLP, {args.epochs} epochs, batch {args.batch_size}/rank, pycomm backend")

    meta = {
        "command": command, "epochs": args.epochs, "batch_size_per_rank": args.batch_size, "lr": args.lr,
        "task": "digits-mlp", "backend": "pycomm", "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads_per_rank": 1,
    }
    with open(args.out + ".json", "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=2)
    lines = [
        f"# digits MLP: strategies x world sizes (pycomm backend)",
        "",
        f"Command: `{command}`  ",
        f"{args.epochs} epochs, batch {args.batch_size} per rank, SGD momentum 0.9, lr {args.lr} "
        f"(cosine), 1 thread per rank, {meta['machine']}, torch {meta['torch']}. Accuracy on the "
        f"297 held-out digits of the consensus model; wall-clock = rank 0's training time "
        f"(no process start-up); MiB = bytes rank 0 sent through pycomm. Accuracy and bytes are "
        f"deterministic; the runs last about a second, so their wall-clock varies up to 2-3x between "
        f"repetitions on a shared 2-core machine (4 ranks oversubscribe it): read it as a rough "
        f"figure, and the bytes column as the communication each strategy needs.",
        "",
        "| strategy | ranks | steps | test accuracy | train wall-clock (s) | MiB sent (rank 0) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(f"| {row['strategy']} | {row['world_size']} | {row['steps']} | "
                     f"{row['test_accuracy'] * 100:.2f}% | {row['train_wall_s']:.2f} | "
                     f"{row['mib_sent_rank0']:.1f} |")
    lines += ["", f"Plot: `{os.path.basename(args.out)}.png` (training loss vs step and vs wall-clock)."]
    with open(args.out + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
