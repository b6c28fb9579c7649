"""Memory per rank of each ``pycomm-train --parallel`` mode against plain DDP.

    python benchmarks/parallel_memory.py          # writes benchmarks/results/parallel_memory.txt

Every run trains the same model (task tinylm-mp, ``--lm-dim 512 --lm-layers 4`` by default,
big enough that model state dominates what a rank holds; the output header gives its size) for a few
steps with SGD + momentum on the CPU, through ``pycomm.train.cli.run`` (what
``pycomm-train -n N`` runs), and reads the summary's memory report
(pycomm/train/memory.py) of every rank:

* model state: bytes of parameters + gradients + optimizer state held by the rank after
  an optimizer step, DTensors counted by their local shard. Exact; no activations, no
  communication buffers (DDP's gradient buckets are another copy of the gradients and
  are not in it), no allocator slack.
* peak RSS growth: the rank's peak resident set during training (VmHWM, reset just
  before the model is built) minus its resident set at that moment. Measured, noisy:
  activations, buffers, allocator caching and thread stacks are in it too.

Also the bytes rank 0 sends per step (communication is what sharding costs).

Modes: ddp, fsdp, tp, pp on 2 ranks and on 4; dp_tp, dp_pp on 4 (a 2 x 2 mesh). The
global batch is --batch-size x data-parallel replicas (ddp/fsdp: all ranks; tp/pp: 1;
hybrids: 2), so activation memory differs between modes: compare the model-state
column first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pycomm.train import TrainConfig  # noqa: E402
from pycomm.train import cli  # noqa: E402

RUNS = [(2, "ddp"), (2, "fsdp"), (2, "tp"), (2, "pp"),
        (4, "ddp"), (4, "fsdp"), (4, "tp"), (4, "pp"), (4, "dp_tp"), (4, "dp_pp")]


def _mib(count) -> str:
    return "n/a" if count is None else f"{count / 2 ** 20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-dim", type=int, default=512)
    parser.add_argument("--lm-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--runs", default=",".join(f"{w}:{m}" for w, m in RUNS),
                        help="RANKS:MODE,... (default: all of them; ddp first for each rank count)")
    parser.add_argument("-o", "--output", default=os.path.join("benchmarks", "results", "parallel_memory.txt"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    runs = [(int(w), m) for w, m in (item.split(":") for item in args.runs.split(","))]
    for world, mode in runs:
        cfg = TrainConfig.from_dict(dict(task="tinylm-mp", lm_dim=args.lm_dim, lm_layers=args.lm_layers,
                                         dropout=0.0, steps=args.steps, batch_size=args.batch_size,
                                         parallel=mode, progress=False, seed=0))
        print(f"{mode} on {world} ranks ...", flush=True)
        summary = cli.run(cfg, world, threads=1)
        rows.append((world, mode, summary["memory"], summary["bytes_sent"] / summary["steps"]))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    lines = [
        f"# {env + ' ' if env else ''}python benchmarks/parallel_memory.py --lm-dim {args.lm_dim} "
        f"--lm-layers {args.lm_layers} --steps {args.steps} --batch-size {args.batch_size}"
        + (f" --runs {args.runs}" if args.runs != parser.get_default("runs") else ""),
        f"# task tinylm-mp: {rows[0][2][0]['params'] // 4:,} parameters ({_mib(rows[0][2][0]['params'])} MiB fp32); "
        "SGD + momentum, fp32, CPU, pycomm backend, 1 torch thread per rank",
        f"# machine load at the end (uptime): {load}",
        "# MiB per rank. state = params + grads + optimizer state held by the rank (local shards; exact);",
        "# rss = peak RSS growth during training (measured; includes activations, buffers, noise).",
        "# 'x ddp' = mean state per rank / ddp's state per rank on the same number of ranks.",
        "# sent/step = MiB rank 0 sent through pycomm per training step (pycomm.stats()).",
        "# Per-rank figures are listed rank 0, 1, ...",
        "",
        f"{'ranks':>5} {'mode':<6} {'params':>18} {'state':>22} {'x ddp':>6} {'peak rss growth':>26} "
        f"{'sent/step':>9}",
    ]
    ddp_state = {}
    for world, mode, memory, sent in rows:
        mean_state = sum(m["state"] for m in memory) / len(memory)
        if mode == "ddp":
            ddp_state[world] = mean_state
        ratio = mean_state / ddp_state[world] if world in ddp_state else float("nan")
        params = "/".join(_mib(m["params"]) for m in memory)
        state = "/".join(_mib(m["state"]) for m in memory)
        rss = "/".join(_mib(m["rss_peak_growth"]) for m in memory)
        lines.append(f"{world:>5} {mode:<6} {params:>18} {state:>22} {ratio:>6.2f} {rss:>26} {_mib(sent):>9}")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    main()
