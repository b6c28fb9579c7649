"""Every training strategy of pycomm.train, 4 ranks, under three conditions: time to accuracy.

    python benchmarks/strategies.py            # writes benchmarks/results/strategies.{md,json}
                                               # and strategies_<condition>.png

Conditions:

* ``plain``: this machine, ranks on loopback (shared memory within the host);
* ``1gbit``: every rank in its own network namespace on a private bridge with a
  ``tc tbf`` limit of 1 Gbit/s on each namespace's egress (pycomm/netns.py), ranks
  started by torchrun in their namespaces (needs root and ``ip``; skipped otherwise);
* ``straggler``: the plain machine with ``--straggler 3:3`` (rank 3's steps take 3x its
  compute time).

Tasks and strategies: the digits MLP and the tiny transformer LM with ``sync`` (DDP,
dense all-reduce), ``local_sgd``, ``easgd``, ``gossip`` (ring), ``fedavg``, ``async_ps``
(1 server, 3 workers) and ``hogwild`` (4 worker processes on one host: it has no network
traffic, so it is not run in the namespaces); and the convex digits-logreg task with
``sync`` and ``cocoa``. Every run of a task has the same epochs (passes over the training
data), per-rank batch, optimiser and learning-rate schedule, and evaluates the model it
would return every ~1/20 of its run (``--eval-every``, off the training clock).

Reported per run: final test accuracy and loss; the training wall-clock at which the
evaluated model first reached the task's target accuracy (rank 0's clock: for async_ps,
server 0's; for hogwild, worker 0's); the total training wall-clock; MiB rank 0 sent
(for async_ps rank 0 is the server, which sends every lease). Process start-up is not in
any of these figures. On a 2-core machine 4 ranks oversubscribe the CPU: compare
strategies within one condition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 4
CONDITIONS = ("plain", "1gbit", "straggler")
STRAGGLER = "3:3"

# task -> (epochs, target accuracy, settings shared by every strategy)
TASKS = {
    "digits-mlp": (20, 0.95, dict(batch_size=32, lr=0.05, momentum=0.9, schedule="cosine")),
    "tinylm": (6, 0.45, dict(batch_size=32, lr=0.003, optimizer="adamw", momentum=0.9, schedule="cosine")),
    "digits-logreg": (20, 0.85, dict(batch_size=32, lr=0.05, momentum=0.9, schedule="cosine")),
}
# strategy label -> flags; the convex task runs sync and cocoa only
STRATEGIES = {
    "sync": dict(strategy="sync"),
    "local_sgd H=4": dict(strategy="local_sgd", local_sgd_period=4),
    "easgd tau=4": dict(strategy="easgd", easgd_period=4),
    "gossip ring": dict(strategy="gossip", topology="ring"),
    "fedavg 1 local epoch": dict(strategy="fedavg", local_epochs=1),
    "async_ps S=2": dict(strategy="async_ps", servers=1, max_staleness=2),
    "hogwild": dict(strategy="hogwild"),
    "cocoa": dict(strategy="cocoa", cocoa_gamma=1.0, cocoa_lambda=1e-3),
}
CONVEX = ("sync", "cocoa")


def plan(task: str) -> List[str]:
    if task == "digits-logreg":
        return list(CONVEX)
    return [name for name in STRATEGIES if name != "cocoa"]


def _train_samples(task: str) -> int:
    from pycomm.train.tasks import get_task

    return int(get_task(task).x_train.shape[0])


def flags_for(task: str, label: str, condition: str) -> List[str]:
    """pycomm-train flags of one run."""
    epochs, _, shared = TASKS[task]
    spec = dict(shared, **STRATEGIES[label])
    strategy = spec["strategy"]
    batch = spec["batch_size"]
    samples = _train_samples(task)
    if strategy == "cocoa":  # rounds, each one local pass: as many passes over the data as the others
        spec.pop("momentum"), spec.pop("schedule"), spec.pop("lr"), spec.pop("batch_size")
        spec["steps"] = epochs
        total = epochs
    else:
        spec["epochs"] = epochs
        workers = RANKS - 1 if strategy == "async_ps" else RANKS
        per_worker = samples // workers // batch
        total = epochs * per_worker * (workers if strategy == "async_ps" else 1)
    spec["eval_every"] = max(1, total // 20)
    if condition == "straggler":
        spec["straggler"] = STRAGGLER
    argv = ["--task", task, "--no-progress", "--seed", "0"]
    for key, value in spec.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def _read_log(path: str) -> Dict[str, Any]:
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    evals = [r for r in records if r["event"] == "eval"]
    end = next(r for r in reversed(records) if r["event"] == "end")
    return {"evals": [{"step": e["step"], "elapsed_s": e["elapsed_s"], "test_accuracy": e["test_accuracy"],
                       "test_loss": e["test_loss"]} for e in evals], "end": end}


def _env(netns: bool) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    if netns:
        from pycomm.netns import IFNAME

        env["PYCOMM_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = IFNAME
    else:
        env.pop("PYCOMM_SOCKET_IFNAME", None)
    return env


def run_local(argv: List[str], log: str, timeout_s: float) -> None:
    """pycomm-train -n 4 on this host."""
    cmd = [sys.executable, "-m", "pycomm.train", "-n", str(RANKS), "--threads", "1", "--log-file", log, *argv]
    proc = subprocess.run(cmd, env=_env(False), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def run_netns(hosts, argv: List[str], log: str, timeout_s: float, port: int) -> None:
    """One torchrun per namespace (1 rank each), c10d rendezvous on host 0."""
    from pycomm.netns import kill_tree

    procs = []
    try:
        for k in range(RANKS):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(RANKS), "--nproc_per_node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}", "--rdzv-id", "strategies",
                   "--rdzv-conf", f"is_host={1 if k == 0 else 0},join_timeout=120", "--local-addr", hosts.addrs[k],
                   "--max-restarts", "0", "-m", "pycomm.train", "--threads", "1", "--log-file", log, *argv]
            procs.append(hosts.popen(k, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=_env(True), cwd=REPO))
        deadline = time.monotonic() + timeout_s
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_tree(q)
                raise RuntimeError(f"torchrun across namespaces timed out after {timeout_s} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    if any(p.returncode for p in procs):
        report = "\n".join(f"--- host {k} (exit {p.returncode}):\n{o[-2000:]}" for k, (p, o) in enumerate(zip(procs, outs)))
        raise RuntimeError(f"torchrun across namespaces failed:\n{report}")


def time_to_target(evals: List[Dict[str, Any]], target: float) -> Optional[float]:
    for record in evals:
        if record["test_accuracy"] >= target:
            return record["elapsed_s"]
    return None


def _row(task: str, label: str, condition: str, parsed: Dict[str, Any]) -> Dict[str, Any]:
    end = parsed["end"]
    target = TASKS[task][1]
    return {
        "condition": condition, "task": task, "strategy": label, "steps": end["step"],
        "test_accuracy": end["test_accuracy"], "test_loss": end["test_loss"], "target": target,
        "time_to_target_s": time_to_target(parsed["evals"], target), "train_wall_s": end["wall_s"],
        "mib_sent_rank0": end.get("bytes_sent_rank0", 0) / 2 ** 20, "evals": parsed["evals"],
    }


def _fmt_time(value: Optional[float]) -> str:
    return "not reached" if value is None else f"{value:.2f}"


def write_markdown(path: str, meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    lines = ["# pycomm.train strategies: time to accuracy, 4 ranks, three conditions", "",
             f"Command: `{meta['command']}`  ", meta["setup"], ""]
    for condition in meta["conditions"]:
        lines += [f"## {meta['condition_text'][condition]}", ""]
        for task in meta["tasks"]:
            chosen = [r for r in rows if r["condition"] == condition and r["task"] == task]
            if not chosen:
                continue
            sync = next((r for r in chosen if r["strategy"] == "sync"), None)
            lines += [f"**{task}** (target {TASKS[task][1] * 100:.0f}% test accuracy)", "",
                      "| strategy | final accuracy | final loss | time to target (s) | vs sync | train wall (s) "
                      "| KiB sent (rank 0) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for r in chosen:
                ratio = ""
                if sync and r["time_to_target_s"] and sync["time_to_target_s"]:
                    ratio = f"{sync['time_to_target_s'] / r['time_to_target_s']:.2f}x"
                lines.append(f"| {r['strategy']} | {r['test_accuracy'] * 100:.2f}% | {r['test_loss']:.3f} | "
                             f"{_fmt_time(r['time_to_target_s'])} | {ratio} | {r['train_wall_s']:.2f} | "
                             f"{r['mib_sent_rank0'] * 1024:,.1f} |")
            lines.append("")
        lines += [f"Plot: `strategies_{condition}.png`", ""]
    lines += ["'vs sync': sync's time to target divided by the strategy's (above 1: faster than sync).", ""]
    with open(path, "w") as handle:
        handle.write("\n".join(lines))


def plot(path: str, condition: str, title: str, rows: List[Dict[str, Any]], tasks: List[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen_tasks = [t for t in tasks if any(r["task"] == t and r["condition"] == condition for r in rows)]
    fig, axes = plt.subplots(1, len(chosen_tasks), figsize=(5.2 * len(chosen_tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], chosen_tasks):
        for r in rows:
            if r["task"] != task or r["condition"] != condition or not r["evals"]:
                continue
            ax.plot([e["elapsed_s"] for e in r["evals"]], [100 * e["test_accuracy"] for e in r["evals"]],
                    marker=".", label=r["strategy"])
        ax.axhline(100 * TASKS[task][1], color="grey", linestyle=":", linewidth=1)
        ax.set_title(task)
        ax.set_xlabel("training wall-clock (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(path: str, out: str) -> int:
    with open(path) as handle:
        data = json.load(handle)
    meta, rows = data["meta"], data["rows"]
    for row in rows:
        row["target"] = TASKS[row["task"]][1]
        row["time_to_target_s"] = time_to_target(row["evals"], row["target"])
    meta["tasks_settings"] = {t: {**meta["tasks_settings"].get(t, {}), "target": TASKS[t][1]} for t in meta["tasks"]}
    _write(out, meta, rows)
    return 0


def _write(out: str, meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    write_markdown(out + ".md", meta, rows)
    for condition in meta["conditions"]:
        if any(r["condition"] == condition for r in rows):
            plot(f"{out}_{condition}.png", condition, meta["condition_text"][condition], rows, meta["tasks"])
    print(f"wrote {out}.md, .json and the plots", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help=f"comma list of {', '.join(CONDITIONS)}")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    parser.add_argument("--strategies", default=None, help="comma list of strategy labels (default: all)")
    parser.add_argument("--epochs-scale", type=float, default=1.0, help="multiply every task's epochs (smoke runs)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the namespaced condition")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "strategies"),
                        help="output path without extension")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the table and plots from a run's JSON, "
                        "with the targets above (time to target recomputed from the kept evaluations)")
    args = parser.parse_args(argv)
    if args.render:
        return render(args.render, args.out)
    command = "python benchmarks/strategies.py" + ("" if not (argv or sys.argv[1:]) else " " +
                                                  " ".join(argv if argv is not None else sys.argv[1:]))
    conditions = [c for c in args.conditions.split(",") if c]
    tasks = [t for t in args.tasks.split(",") if t]
    for c in conditions:
        if c not in CONDITIONS:
            parser.error(f"unknown condition {c!r}")
    for t in tasks:
        if t not in TASKS:
            parser.error(f"unknown task {t!r}")
    if args.epochs_scale != 1.0:
        for t in TASKS:
            epochs, target, shared = TASKS[t]
            TASKS[t] = (max(1, round(epochs * args.epochs_scale)), target, shared)
    only = None if args.strategies is None else set(args.strategies.split(","))
    condition_text = {"plain": "Plain machine (loopback, 4 ranks on 2 cores)",
                      "1gbit": f"{args.rate} link: one rank per network namespace, tc tbf {args.rate} egress",
                      "straggler": f"Straggler: --straggler {STRAGGLER} (rank 3 three times slower)"}
    rows: List[Dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="strategies_") as tmp:
        for condition in conditions:
            hosts = None
            if condition == "1gbit":
                from pycomm.netns import NetnsHosts, netns_unavailable_reason

                reason = netns_unavailable_reason()
                if reason:
                    print(f"skipping condition 1gbit: {reason}", flush=True)
                    continue
                hosts = NetnsHosts(RANKS, rate=args.rate)
                hosts.create()
            try:
                for task in tasks:
                    for label in plan(task):
                        if only is not None and label not in only:
                            continue
                        if label == "hogwild" and hosts is not None:
                            continue  # one host, no traffic: the plain run is its figure
                        log = os.path.join(tmp, f"{condition}_{task}_{label.replace(' ', '_').replace('=', '')}.jsonl")
                        argv_run = flags_for(task, label, condition)
                        t0 = time.perf_counter()
                        if hosts is not None:
                            from pycomm.launch import free_port

                            run_netns(hosts, argv_run, log, args.timeout_s, free_port())
                        else:
                            run_local(argv_run, log, args.timeout_s)
                        row = _row(task, label, condition, _read_log(log))
                        row["flags"] = " ".join(argv_run)
                        row["launch_s"] = time.perf_counter() - t0
                        rows.append(row)
                        print(f"[{condition}] {task:>13} {label:>22}: acc {row['test_accuracy'] * 100:6.2f}%  "
                              f"to {row['target'] * 100:.0f}%: {_fmt_time(row['time_to_target_s']):>11} s  "
                              f"train {row['train_wall_s']:6.2f} s  {row['mib_sent_rank0']:7.1f} MiB "
                              f"(launch {row['launch_s']:.0f} s)", flush=True)
            finally:
                if hosts is not None:
                    hosts.close()
                    left = hosts.leftovers()
                    if left:
                        print(f"WARNING: left behind: {left}", flush=True)
    import torch

    load = os.getloadavg()
    meta = {
        "command": command, "conditions": conditions, "tasks": tasks, "condition_text": condition_text,
        "ranks": RANKS, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_after": load, "total_s": time.time() - started,
        "tasks_settings": {t: {"epochs": TASKS[t][0], "target": TASKS[t][1], **TASKS[t][2]} for t in tasks},
        "setup": (f"{RANKS} ranks (1 thread each), {platform.machine()} {os.cpu_count()} cores, torch "
                  f"{torch.__version__}, pycomm backend. Epochs: "
                  + ", ".join(f"{t} {TASKS[t][0]}" for t in tasks)
                  + ". Times are rank 0's training clock (no start-up, no evaluation); KiB = bytes rank 0 "
                  f"sent. Load average after the run: {load[0]:.2f}. Whole run: {(time.time() - started) / 60:.0f} min."),
    }
    _write(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
