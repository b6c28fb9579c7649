"""PowerSGD on digits: pycomm's powersgd_hook against torch's powerSGD_hook, both on pycomm.

    python benchmarks/powersgd_digits.py      # writes benchmarks/results/powersgd_digits.{md,json}

The training run is benchmarks/compression_digits.py's (same task, model, seed, epochs, lr,
global batch, 1 torch thread per rank; its worker does the training): an MLP
64-512-512-10 on scikit-learn's digits, plain SGD. Configs, for each rank r in --ranks:

* ``powersgd rR``: pycomm.hooks.PowerSGDState(rank=R, warmup_steps=2, min_compression_rate=2)
  with pycomm.hooks.powersgd_hook;
* ``torch powerSGD rR``: torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState(
  matrix_approximation_rank=R, start_powerSGD_iter=2, min_compression_rate=2) with torch's
  powerSGD_hook, on the same pycomm process group;
* at the largest rank also `` noEF`` (error feedback off) and `` nowarm`` (warm start off) of both.

Both hooks run 2 dense steps first (torch requires start_powerSGD_iter > 1 with error
feedback or warm start), and every PowerSGD run uses one DDP bucket (torch's hook cannot
run several buckets on a CPU backend: see compression_digits.py's _train_one). Reported per
config from rank 0: final test accuracy, bytes sent per step (all steps, and the steps after
the 2 dense ones), the median step time; against ``dense`` (DDP without a hook) of the same
run. Settings: loopback at --worlds ranks, then (as root, where network namespaces work)
each rank in its own namespace behind a tc tbf limit (--slow-rates at --slow-worlds ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import compression_digits as cd  # noqa: E402  (the worker and launcher)


def _configs(ranks):
    names = ["dense"]
    for r in ranks:
        names += [f"powersgd r{r}", f"torch powerSGD r{r}"]
    top = max(ranks)
    for suffix in ("noEF", "nowarm"):
        names += [f"powersgd r{top} {suffix}", f"torch powerSGD r{top} {suffix}"]
    return names


def _table(settings):
    lines = ["| setting | config | test acc | Δ acc vs dense (pts) | bytes/step, all steps | bytes/step after the "
             "2 dense steps | bytes ÷ dense (after) | median step (ms) | step speed-up vs dense |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in settings:
        dense = next(r for r in s["rows"] if r["config"] == "dense")
        for r in s["rows"]:
            after = r["bytes_per_step_after_2"]
            lines.append(f"| {s['label']} | {r['config']} | {r['test_accuracy'] * 100:.2f}% | "
                         f"{r['acc_delta_points']:+.2f} | {r['bytes_per_step']:,.0f} | {after:,.0f} | "
                         f"{dense['bytes_per_step_after_2'] / after:.1f}x | "
                         f"{r['median_step_s'] * 1e3:.2f}{cd._runs(r)} | {r['step_speedup']:.2f}x |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", default="1,2,4", help="PowerSGD ranks r")
    parser.add_argument("--worlds", default="2,4", help="world sizes on loopback")
    parser.add_argument("--slow-rates", default="100mbit", help="tc tbf rates ('' to skip the namespaces)")
    parser.add_argument("--slow-worlds", default="2")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per setting; step time = median over runs of each run's median")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "powersgd_digits"))
    args = parser.parse_args(argv)
    args.configs = ",".join(_configs([int(r) for r in args.ranks.split(",")]))
    command = "python benchmarks/powersgd_digits.py" + ("" if argv is None and len(sys.argv) == 1
                                                        else " " + " ".join(sys.argv[1:] if argv is None else argv))
    load_before = os.getloadavg()
    started = time.perf_counter()
    settings = cd.run_settings(args, port=29519)
    total_s = time.perf_counter() - started

    import torch

    meta = {
        "command": command, "repeat": args.repeat, "configs": args.configs.split(","),
        "task": "digits (pycomm.train digits-mlp split: 1500 train / 297 test)",
        "model": "MLP 64-512-512-10 (301,066 parameters, float32)", "epochs": args.epochs, "lr": args.lr,
        "optimizer": "SGD, no momentum, constant lr", "global_batch": args.global_batch, "seed": args.seed,
        "backend": "pycomm", "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads_per_rank": 1, "total_wall_s": total_s, "loadavg_1_5_15_before": load_before,
        "loadavg_1_5_15_after": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as handle:
        json.dump({"meta": meta, "settings": settings}, handle, indent=2)
    identical = all(r["replicas_identical"] for s in settings for r in s["rows"])
    lines = [
        "# PowerSGD on digits: pycomm's powersgd_hook and torch's powerSGD_hook, both on the pycomm backend",
        "",
        f"Command: `{command}` (total {total_s:.0f} s)  ",
        f"{meta['model']} on scikit-learn's digits ({meta['task']}); {args.epochs} epochs, global batch "
        f"{args.global_batch} (split evenly over the ranks), plain SGD lr {args.lr}, seed {args.seed}, identical "
        f"for every run; 1 torch thread per rank, {meta['machine']}, torch {meta['torch']}. Both PowerSGD hooks: "
        f"2 dense steps first, min_compression_rate 2, error feedback and warm start on unless the row says "
        f"noEF / nowarm, one DDP bucket. Bytes = pycomm.stats()['bytes_sent'] of rank 0 per step, over all "
        f"steps and over the steps after the first 2 (the compressed steady state); 'bytes ÷ dense' uses the "
        f"latter for both. Step time = median over steps (first 5 skipped) of rank 0's zero_grad + forward + "
        f"backward (+ exchange) + step"
        f"{f', then the median over {args.repeat} runs' if args.repeat > 1 else ''}. 4 ranks oversubscribe "
        f"the 2 cores. Slow link: each rank in its own network namespace behind `tc tbf rate R burst 256kb "
        f"latency 50ms` (tests/netns_util.py).",
        "",
        *_table(settings),
        "",
        f"Replicas identical on all ranks at the end of every run: {'yes' if identical else 'NO'}. "
        f"Load average (1/5/15 min) before the run {'/'.join(f'{x:.1f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_1_5_15_after'])} (the machine has {os.cpu_count()} cores "
        f"and is shared: step times are noisy, accuracy and bytes are deterministic).",
    ]
    with open(args.out + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
