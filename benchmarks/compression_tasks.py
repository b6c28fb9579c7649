"""Top-k against dense on a spread of tasks, optimizers, world sizes and seeds (issue #41).

    python benchmarks/compression_tasks.py                    # every task, sgd+adamw, 2 and 4 ranks, seeds 0,1,2
    python benchmarks/compression_tasks.py --tasks teacher-short --optimizers sgd --worlds 2 --seeds 0
    python benchmarks/compression_tasks.py --configs "dense;topk;topk warmup_steps=20"

Real DDP over a pycomm process group, one process per rank (1 torch thread each), the
real ``topk_hook``. Each ``--configs`` entry is ``dense`` (DDP without a hook) or ``topk``
followed by ``key=value`` words passed to ``TopKState`` (Python literals), on top of
``density=0.01``; ``topk`` alone is ``TopKState(density=0.01)`` with its defaults, the
setting the figures are about. Configs are separated by ``;``.

Tasks (``--tasks``; TASKS): each has a per-rank batch (the global batch grows with the
world size, as it does when a user adds ranks), a number of steps, and a learning rate
per optimizer; the same for every config, so every top-k run has its dense reference
with the same task, optimizer, world size and seed:

* ``digits-mlp``: scikit-learn digits, MLP 64-1024-480-10 (compression_digits.py's mlp), 200 steps;
* ``digits-cnn``: digits 8x8 images, pycomm.train's digits-cnn;
* ``tinylm``: pycomm.train's tinylm (next-character accuracy);
* ``teacher-short``: a fixed random two-layer teacher (32 Gaussian features, tanh hidden
  layer of 64, argmax over 10 classes) labels fresh Gaussian samples; the student is an
  MLP 32-512-512-512-10 (547,338 parameters), 64 samples per rank per step, 400 steps
  (issue #41's task);
* ``teacher-long``: the same teacher, a student MLP 32-256-256-256-10, 16 samples per
  rank per step, 1200 steps;
* ``regression``: a fixed random two-layer teacher (16 features, tanh hidden of 32,
  scalar output normalised to unit variance, noise 0.1), student MLP 16-256-256-1, MSE;
  the metric is the test R^2 in percent.

Optimizers (``--optimizers``): ``sgd`` (torch.optim.SGD, the task's lr, momentum 0.9) and
``adamw`` (torch.optim.AdamW, lr 1e-3, weight decay 0.01), the same for every task.

Per run: the test metric of rank 0's replica at the end (replicas are checked identical),
and the bytes every rank sent (pycomm.stats()['bytes_sent'], summed over the ranks) over
the whole run, from the first training step to the last (any warm-up included). Per
(task, optimizer, world): the mean over seeds of the metric, the mean and the worst
(lowest) per-seed gap of top-k to dense in points, and the bytes ratio dense / top-k of
the sums over the seeds.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

DEFAULT_CONFIGS = "dense;topk"
DEFAULT_TASKS = "digits-mlp,digits-cnn,tinylm,teacher-short,teacher-long,regression"
TARGET_GAP = 1.0    # points: top-k within this of dense (worst case over the table, mean over seeds)
TARGET_RATIO = 50.0  # dense bytes / top-k bytes over the whole run

# name: (per-rank batch, steps, SGD lr, description)
TASKS = {
    "digits-mlp": (32, 200, 0.05, "digits, MLP 64-1024-480-10 (563,370 parameters), 32 samples/rank, 200 steps"),
    "digits-cnn": (32, 300, 0.05, "digits 8x8, pycomm.train digits-cnn (38,282 parameters), 32 samples/rank, 300 steps"),
    "tinylm": (16, 200, 0.05, "pycomm.train tinylm (72,603 parameters, next-char accuracy), 16 windows/rank, 200 steps"),
    "teacher-short": (64, 400, 0.05, "teacher-student 10 classes, 32 Gaussian features, student MLP 3x512 "
                                     "(547,338 parameters), 64 samples/rank, 400 steps"),
    "teacher-long": (16, 1200, 0.05, "the same teacher, student MLP 3x256 (142,602 parameters), 16 samples/rank, "
                                     "1200 steps"),
    "regression": (32, 400, 0.05, "regression, 16 Gaussian features, teacher tanh 32 -> 1 (+ noise 0.1), student "
                                  "MLP 16-256-256-1 (70,401 parameters), MSE, metric test R^2 (%), 32 samples/rank, "
                                  "400 steps"),
}
OPTIMIZERS = {"sgd": "SGD momentum 0.9, the task's lr (0.05)", "adamw": "AdamW lr 1e-3, weight decay 0.01"}
_DATA_SEED = 1234  # the teachers and test sets never depend on the run's seed


# ---------------------------------------------------------------------------
# tasks
# ---------------------------------------------------------------------------

class _Teacher:
    """A fixed random two-layer network and a stream of Gaussian inputs it labels."""

    def __init__(self, features, hidden, outputs, classify, noise=0.0):
        import torch

        g = torch.Generator().manual_seed(_DATA_SEED + features * 7 + outputs)
        self.w1 = torch.randn(features, hidden, generator=g) / features ** 0.5
        self.w2 = torch.randn(hidden, outputs, generator=g) / hidden ** 0.5 * 3.0
        self.features, self.classify, self.noise = features, classify, noise
        self.scale = 1.0
        if not classify:  # unit-variance targets
            x = torch.randn(20000, features, generator=g)
            self.scale = float(self._raw(x).std())

    def _raw(self, x):
        import torch

        return torch.tanh(x @ self.w1) @ self.w2

    def label(self, x, g=None):
        import torch

        y = self._raw(x)
        if self.classify:
            return y.argmax(dim=1)
        y = y / self.scale
        if self.noise:
            y = y + self.noise * torch.randn(y.shape, generator=g)
        return y

    def batch(self, n, g):
        import torch

        x = torch.randn(n, self.features, generator=g)
        return x, self.label(x, g)


def _mlp(sizes, seed):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Task:
    """model(seed), batch(step, rank, world, seed) -> (x, y), loss(out, y), score(model) -> percent."""

    def __init__(self, name):
        import torch
        import torch.nn.functional as F

        self.name = name
        self.per_rank, self.steps, self.sgd_lr, self.description = TASKS[name]
        self.F = F
        if name in ("digits-mlp", "digits-cnn", "tinylm"):
            from pycomm.train.tasks import get_task

            self.task = get_task(name)
            self.x_train, self.y_train = self.task.x_train, self.task.y_train
            self.x_test, self.y_test = self.task.x_test, self.task.y_test
            self.teacher = None
        else:
            classify = name.startswith("teacher")
            self.teacher = (_Teacher(32, 64, 10, True) if classify else _Teacher(16, 32, 1, False, noise=0.1))
            g = torch.Generator().manual_seed(_DATA_SEED + 1)
            self.x_test, self.y_test = self.teacher.batch(4000, g)
            self.task = None

    def model(self, seed):
        if self.name == "digits-mlp":
            return _mlp([64, 1024, 480, 10], seed)
        if self.name in ("digits-cnn", "tinylm"):
            return self.task.make_model(seed)
        if self.name == "teacher-short":
            return _mlp([32, 512, 512, 512, 10], seed)
        if self.name == "teacher-long":
            return _mlp([32, 256, 256, 256, 10], seed)
        return _mlp([16, 256, 256, 1], seed)

    def batch(self, step, rank, world, seed):
        import torch

        if self.teacher is not None:  # a fresh sample per (seed, step, rank)
            g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 131 + rank) & 0x7FFFFFFFFFFF)
            return self.teacher.batch(self.per_rank, g)
        n = self.x_train.shape[0]
        per_epoch = n // (self.per_rank * world)
        epoch, s = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        start = (s * world + rank) * self.per_rank
        idx = order[start: start + self.per_rank]
        return self.x_train[idx], self.y_train[idx]

    def loss(self, out, y):
        if self.name == "regression":
            return self.F.mse_loss(out, y)
        return self.F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def score(self, model):
        """The test metric in percent: accuracy, or R^2 for the regression."""
        import torch

        model.eval()
        with torch.no_grad():
            out = model(self.x_test)
        model.train()
        if self.name == "regression":
            mse = float(((out - self.y_test) ** 2).mean())
            return 100.0 * (1.0 - mse / float(self.y_test.var()))
        pred = out.reshape(-1, out.shape[-1]).argmax(dim=1)
        return 100.0 * float((pred == self.y_test.reshape(-1)).float().mean())


# ---------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------

def parse_config(config):
    """"dense" -> None; "topk k=v ..." -> the TopKState keyword arguments (density 0.01 unless given)."""
    words = config.split()
    if words == ["dense"]:
        return None
    if not words or words[0] != "topk":
        raise ValueError(f"unknown config {config!r} (dense, or topk [key=value ...])")
    kwargs = {"density": 0.01}
    for word in words[1:]:
        key, _, value = word.partition("=")
        kwargs[key] = ast.literal_eval(value)
    return kwargs


def _optimizer(name, params, task):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=task.sgd_lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    raise ValueError(name)


def _top_share(travel, fraction):
    """The share of the total per-entry travel that the top ``fraction`` of entries made
    (0.1 for an even spread over the entries at fraction 0.1; near 1 when few entries move)."""
    import torch

    k = max(1, int(fraction * travel.numel()))
    total = float(travel.sum())
    return float(torch.topk(travel, k).values.sum()) / total if total else 0.0


def run_one(task, optimizer, config, seed, rank, world, steps=None):
    """One training run on the initialised default group; returns rank 0's record."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm
    from pycomm import hooks

    model = task.model(seed)
    ddp = DDP(model)
    kwargs = parse_config(config)
    state = None
    if kwargs is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # candidates may name deprecated options
            state = hooks.TopKState(None, **kwargs)
        ddp.register_comm_hook(state, hooks.topk_hook)
    opt = _optimizer(optimizer, ddp.parameters(), task)
    steps = steps or task.steps
    params = [p for p in model.parameters()]
    start = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    before = start.clone()
    path = 0.0  # sum over steps of ||theta_{t+1} - theta_t||: how far the optimizer moved the model
    travel = torch.zeros_like(start)  # per entry: sum over steps of |theta_{t+1} - theta_t|
    dist.barrier()
    pycomm.reset_stats()
    started = time.perf_counter()
    for step in range(steps):
        x, y = task.batch(step, rank, world, seed)
        opt.zero_grad(set_to_none=True)
        loss = task.loss(ddp(x), y)
        loss.backward()
        opt.step()
        now = torch.cat([p.detach().reshape(-1) for p in params])
        step_move = now - before
        path += float(step_move.norm())
        travel += step_move.abs()
        before = now
    wall = time.perf_counter() - started
    sent = float(pycomm.stats()["bytes_sent"])  # read before the checks below send anything
    metric = task.score(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    check = torch.tensor([flat.sum().item(), flat.abs().sum().item(), sent], dtype=torch.float64)
    gathered = [torch.zeros_like(check) for _ in range(world)]
    dist.all_gather(gathered, check)
    identical = all(torch.equal(g[:2], gathered[0][:2]) for g in gathered)
    record = {"task": task.name, "optimizer": optimizer, "config": config, "world": world, "seed": seed,
              "steps": steps, "metric": metric, "bytes_sent_all_ranks": sum(float(g[2]) for g in gathered),
              "bytes_sent_rank0": float(gathered[0][2]), "final_loss": float(loss.item()),
              "replicas_identical": identical, "wall_s": wall,
              "displacement": float((before - start).norm()), "path": path,
              "travel_share_top10": _top_share(travel, 0.10), "travel_share_top1": _top_share(travel, 0.01)}
    health = getattr(state, "health", None) if state is not None else None
    if callable(health):
        record["health"] = health()
    dist.barrier()
    return record


def worker_main(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import pycomm  # noqa: F401  (registers the backend)

    dist.init_process_group("pycomm", init_method=args.init, rank=args.rank, world_size=args.world)
    tasks = {}
    for job in json.loads(args.jobs):
        name = job["task"]
        if name not in tasks:
            tasks[name] = Task(name)
        record = run_one(tasks[name], job["optimizer"], job["config"], job["seed"], args.rank, args.world,
                         job.get("steps"))
        if args.rank == 0:
            with open(args.result, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(f"  {record['task']:>13} {record['optimizer']:>5} w{args.world} s{record['seed']} "
                  f"{record['config']:<30} {record['metric']:7.2f}  {record['bytes_sent_all_ranks']:14,.0f} B  "
                  f"{record['wall_s']:5.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, jobs, result, timeout=3600):
    """Runs ``jobs`` (dicts: task, optimizer, config, seed[, steps]) in one set of ``world``
    rank processes, appending rank 0's records to ``result`` (JSON lines)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYCOMM_SOCKET_IFNAME", None)
    procs = []
    for rank in range(world):
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank), "--world", str(world),
                "--init", f"tcp://127.0.0.1:{port}", "--result", result, "--jobs", json.dumps(jobs)]
        procs.append(subprocess.Popen(argv, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{world}-rank run failed: exit codes {codes}")


def summarise(records, configs):
    """Rows per (task, optimizer, world, config != dense): dense and top-k means over the
    seeds both have, mean and worst per-seed gap (points), bytes ratio of the sums."""
    by_key = {}
    for r in records:
        by_key[(r["task"], r["optimizer"], r["world"], r["config"], r["seed"])] = r
    rows = []
    groups = sorted({(r["task"], r["optimizer"], r["world"]) for r in records},
                    key=lambda k: (list(TASKS).index(k[0]) if k[0] in TASKS else 99, k[1] != "sgd", k[2]))
    for task, opt, world in groups:
        for config in configs:
            if config == "dense":
                continue
            seeds = sorted(s for (t, o, w, c, s) in by_key if (t, o, w, c) == (task, opt, world, config)
                           and (t, o, w, "dense", s) in by_key)
            if not seeds:
                continue
            dense = [by_key[(task, opt, world, "dense", s)] for s in seeds]
            comp = [by_key[(task, opt, world, config, s)] for s in seeds]
            gaps = [c["metric"] - d["metric"] for c, d in zip(comp, dense)]
            dense_bytes = sum(d["bytes_sent_all_ranks"] for d in dense)
            comp_bytes = sum(c["bytes_sent_all_ranks"] for c in comp)
            row = {"task": task, "optimizer": opt, "world": world, "config": config, "seeds": seeds,
                   "dense": sum(d["metric"] for d in dense) / len(seeds),
                   "compressed": sum(c["metric"] for c in comp) / len(seeds),
                   "gap_mean": sum(gaps) / len(gaps), "gap_worst": min(gaps), "gaps": gaps,
                   "bytes_ratio": dense_bytes / comp_bytes if comp_bytes else float("inf"),
                   "replicas_identical": all(r["replicas_identical"] for r in dense + comp)}
            if all("path" in r for r in dense + comp):  # records made before these were kept lack them
                row["path_ratio"] = sum(c["path"] for c in comp) / sum(d["path"] for d in dense)
                row["displacement_ratio"] = (sum(c["displacement"] for c in comp)
                                             / sum(d["displacement"] for d in dense))
            if all("travel_share_top10" in r for r in dense + comp):
                row["travel_top10_dense"] = sum(d["travel_share_top10"] for d in dense) / len(dense)
                row["travel_top10"] = sum(c["travel_share_top10"] for c in comp) / len(comp)
            healths = [c["health"] for c in comp if "health" in c]
            if healths:
                for key in ("residual_ratio", "effective_density"):
                    vals = [h[key] for h in healths if h.get(key) is not None]
                    if vals:
                        row[key] = sum(vals) / len(vals)
            row["met"] = row["gap_mean"] >= -TARGET_GAP and row["bytes_ratio"] >= TARGET_RATIO
            rows.append(row)
    return rows


def table(rows):
    """The markdown table; with the movement columns (top-k / dense, summed over the seeds:
    path = sum over steps of ||theta_t+1 - theta_t||, displacement = ||theta_end - theta_0||)
    when every row's records have them, and the share of the per-entry travel (sum over
    steps of |theta_t+1 - theta_t| per entry) made by the 10% of entries that moved most."""
    movement = bool(rows) and all("path_ratio" in r for r in rows)
    travel = bool(rows) and all("travel_top10" in r for r in rows)
    head = "| task | optimizer | ranks | config | seeds | dense | top-k | gap mean (pts) | gap worst seed | bytes ratio |"
    rule = "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if movement:
        head += " path ratio | displacement ratio |"
        rule += " ---: | ---: |"
    if travel:
        head += " top 10% travel share, dense / top-k |"
        rule += " ---: |"
    lines = [head + " met |", rule + " --- |"]
    for r in rows:
        line = (f"| {r['task']} | {r['optimizer']} | {r['world']} | {r['config']} | {len(r['seeds'])} | {r['dense']:.2f} | "
                f"{r['compressed']:.2f} | {r['gap_mean']:+.2f} | {r['gap_worst']:+.2f} | {r['bytes_ratio']:.1f}x |")
        if movement:
            line += f" {r['path_ratio']:.2f} | {r['displacement_ratio']:.2f} |"
        if travel:
            line += f" {r['travel_top10_dense']:.3f} / {r['travel_top10']:.3f} |"
        lines.append(line + f" {'yes' if r['met'] else '**no**'} |")
    return lines


def verdict(rows):
    """Per config: worst mean gap, lowest bytes ratio, the rows that miss."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        out[config] = {"worst_gap_mean": min(r["gap_mean"] for r in mine),
                       "min_bytes_ratio": min(r["bytes_ratio"] for r in mine),
                       "rows": len(mine), "missed": [f"{r['task']} {r['optimizer']} {r['world']}" for r in mine
                                                     if not r["met"]]}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated: dense, topk [key=value ...]")
    parser.add_argument("--steps", type=int, default=0, help="override every task's steps (smoke tests)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "compression_tasks41"))
    parser.add_argument("--records", default="",
                        help="JSON-lines file of earlier records to reuse (runs already there are skipped) and append to")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: the table from the runs already in --records")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--init", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)

    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS:
            raise SystemExit(f"unknown task {t!r} (choose from {', '.join(TASKS)})")
    configs = [c.strip() for c in args.configs.split(";") if c.strip()]
    if "dense" not in configs:
        configs.insert(0, "dense")
    for c in configs:
        parse_config(c)
    optimizers = [o for o in args.optimizers.split(",") if o]
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    worlds = [int(w) for w in args.worlds.split(",") if w]
    command = "python benchmarks/compression_tasks.py" + (
        " " + " ".join(repr(a) if (" " in a or ";" in a) else a for a in (sys.argv[1:] if argv is None else argv))
        if (argv or sys.argv[1:]) else "")

    records_path = args.records or args.out + ".records.jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(records_path)), exist_ok=True)
    done = set()
    if os.path.exists(records_path):
        with open(records_path) as handle:
            for line in handle:
                r = json.loads(line)
                done.add((r["task"], r["optimizer"], r["world"], r["config"], r["seed"], r["steps"]))
    load_before = os.getloadavg()
    loads = [load_before]
    started = time.perf_counter()
    for world in worlds:
        jobs = [{"task": t, "optimizer": o, "config": c, "seed": s, "steps": args.steps or TASKS[t][1]}
                for t in tasks for o in optimizers for s in seeds for c in configs
                if (t, o, world, c, s, args.steps or TASKS[t][1]) not in done]
        if jobs and not args.report_only:
            print(f"== {world} ranks: {len(jobs)} runs", flush=True)
            launch(world, jobs, records_path)
            loads.append(os.getloadavg())
    total = time.perf_counter() - started
    steps_of = {t: args.steps or TASKS[t][1] for t in tasks}
    with open(records_path) as handle:
        records = [json.loads(line) for line in handle]
    records = [r for r in records if r["task"] in tasks and r["optimizer"] in optimizers and r["world"] in worlds
               and r["seed"] in seeds and r["config"] in configs and r["steps"] == steps_of[r["task"]]]
    rows = summarise(records, configs)
    import torch

    meta = {"command": command, "tasks": {t: TASKS[t][3] for t in tasks}, "optimizers": OPTIMIZERS,
            "seeds": seeds, "worlds": worlds, "configs": configs, "steps_override": args.steps or None,
            "torch": torch.__version__, "cores": os.cpu_count(), "total_wall_s": total,
            "loadavg_1_5_15": loads + [os.getloadavg()]}
    verdicts = verdict(rows) if rows else {}
    with open(args.out + ".json", "w") as handle:
        json.dump({"meta": meta, "rows": rows, "verdict": verdicts, "records": records}, handle, indent=1)
    lines = ["# Top-k against dense on several tasks (benchmarks/compression_tasks.py)", "",
             f"Command: `{command}` ({total:.0f} s of new runs; records in `{os.path.basename(records_path)}`)", "",
             "Tasks: " + "; ".join(f"**{t}**: {TASKS[t][3]}" for t in tasks) + ". "
             f"Optimizers: " + "; ".join(f"**{o}**: {OPTIMIZERS[o]}" for o in optimizers) + ". "
             f"Seeds {', '.join(map(str, seeds))} (model initialisation and data order). Real DDP, one process per "
             f"rank, 1 torch thread each, pycomm backend, torch {torch.__version__}, {os.cpu_count()} cores. "
             "dense / top-k: the test metric (accuracy %, the regression's R^2 %) at the end, mean over seeds; gap: "
             "top-k minus dense of the same seed, mean and worst seed; bytes ratio: dense bytes / top-k bytes, "
             "pycomm.stats()['bytes_sent'] summed over all ranks and seeds over the whole run (warm-up included). "
             f"Target: mean gap >= -{TARGET_GAP} point at >= {TARGET_RATIO:.0f}x.", "",
             *table(rows), "",
             "Replicas bit-identical at the end of every run: "
             + ("yes" if all(r["replicas_identical"] for r in rows) else "NO") + ". Load average (1/5/15 min) "
             "before and after each world size: " + ", ".join("/".join(f"{x:.1f}" for x in la) for la in meta["loadavg_1_5_15"])
             + " (2 shared cores; accuracy and bytes do not depend on load).", "", "## Per config", ""]
    for config, v in verdicts.items():
        lines.append(f"- `{config}`: worst mean gap {v['worst_gap_mean']:+.2f} pts, lowest bytes ratio "
                     f"{v['min_bytes_ratio']:.1f}x; misses: {', '.join(v['missed']) or 'none'}")
    with open(args.out + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
