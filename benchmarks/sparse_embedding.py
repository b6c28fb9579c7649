"""DDP on an embedding-heavy model with sparse gradients: pycomm vs gloo in one run.

    python benchmarks/sparse_embedding.py                  # 2 and 4 ranks on this host
    python benchmarks/sparse_embedding.py --world-sizes 2 --transport tcp

The model is one nn.EmbeddingBag(rows, dim, mode="mean", sparse=True) table (1M x 64
float32 by default: 256 MB) and a small dense head (Linear(dim, 256), ReLU,
Linear(256, 1)); each rank looks up `bags x bag_size` rows per step (uniform over the
table) and trains with SGD. Every rank builds both DDP models from the same seed and
feeds both the same batches, so after the run the two replicas must hold the same
parameters: checked in the same pass (max |difference| printed).

Reported per backend, median over iterations after warm-up, in alternating rounds
(pycomm, gloo, gloo, pycomm, ...) so drift on a shared machine hits both alike; within a
round the steps (or calls) run back to back, as in training, after one barrier:
* step: forward + backward (DDP's all-reduces of the sparse table gradient and the
  dense head) + optimizer step, on rank 0;
* sparse all_reduce: dist.all_reduce of one step's table gradient alone (as DDP
  hands it over: uncoalesced, one row per lookup);
* bytes/step: what rank 0 sent per step: pycomm measured (pycomm.stats()), gloo
  computed from its algorithm (ring all-gathers of 72-byte metadata, int64 indices
  and the values of the coalesced gradient; ring all-reduce of the dense head);
* local: the same step without DDP (no communication), the floor for both.
The ratio is gloo / pycomm (above 1: pycomm faster). Absolute times on a shared
2-core machine are noise; the ratios within one run are the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import pycomm  # noqa: E402
from pycomm.launch import launch_workers  # noqa: E402

__all__ = ["main"]


class Model(nn.Module):
    def __init__(self, rows, dim, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.table = nn.EmbeddingBag(rows, dim, mode="mean", sparse=True)
        self.head = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, ids, offsets):
        return self.head(self.table(ids, offsets))


def make_batch(cfg, rank, step):
    g = torch.Generator().manual_seed(step * 1009 + rank)
    ids = torch.randint(0, cfg["rows"], (cfg["bags"] * cfg["bag_size"],), generator=g)
    offsets = torch.arange(0, ids.numel(), cfg["bag_size"])
    target = torch.randn(cfg["bags"], 1, generator=g)
    return ids, offsets, target


def step_once(model, opt, batch):
    ids, offsets, target = batch
    loss = ((model(ids, offsets) - target) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def gloo_bytes_per_step(cfg, world, rank, step, head_bytes):
    """What gloo's algorithms send from `rank` in one DDP step (ring all-gathers and
    ring all-reduce: a rank forwards every chunk but its right neighbour's)."""
    chunks = []
    for q in range(world):
        nnz = torch.unique(make_batch(cfg, q, step)[0]).numel()
        chunks.append((72, nnz * 8, nnz * cfg["dim"] * 4))
    right = (rank + 1) % world
    sparse = sum(sum(c) for q, c in enumerate(chunks) if q != right)
    dense = 2 * (world - 1) / world * head_bytes
    return sparse + dense


def memcpy_gbps():
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() / min(times) / 1e9


def worker(rank, world, init_method, cfg):
    torch.set_num_threads(1)
    dist.init_process_group("pycomm", init_method=init_method, rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    models = {name: Model(cfg["rows"], cfg["dim"], seed=0) for name in ("pycomm", "gloo", "local")}
    ddps = {"pycomm": DDP(models["pycomm"]), "gloo": DDP(models["gloo"], process_group=gloo),
            "local": models["local"]}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.02) for name, m in ddps.items()}
    head_bytes = sum(p.numel() * 4 for p in models["pycomm"].head.parameters())
    groups = {"pycomm": None, "gloo": gloo}
    steps = {name: 0 for name in ddps}
    times = {name: [] for name in ddps}
    ar_times = {"pycomm": [], "gloo": []}
    bytes_pycomm = []
    bytes_gloo = []

    def run(name, iters, record):
        dist.barrier(group=gloo)  # the block starts together; then steps run back to back
        for _ in range(iters):
            batch = make_batch(cfg, rank, steps[name])
            sent0 = pycomm.stats()["bytes_sent"]
            t0 = time.perf_counter()
            step_once(ddps[name], opts[name], batch)
            dt = time.perf_counter() - t0
            if record:
                times[name].append(dt)
                if name == "pycomm":
                    bytes_pycomm.append(pycomm.stats()["bytes_sent"] - sent0)
                elif name == "gloo":
                    bytes_gloo.append(gloo_bytes_per_step(cfg, world, rank, steps[name], head_bytes))
            steps[name] += 1

    # one step's table gradient, as DDP hands it over (uncoalesced, one row per lookup)
    local = models["local"]
    ids, offsets, target = make_batch(cfg, rank, 10_000)
    ((local(ids, offsets) - target) ** 2).mean().backward()
    table_grad = local.table.weight.grad.clone()
    local.zero_grad(set_to_none=True)

    def run_allreduce(name, iters):
        copies = [table_grad.clone() for _ in range(iters)]
        dist.barrier(group=gloo)
        for t in copies:  # back to back, as in training
            t0 = time.perf_counter()
            dist.all_reduce(t, group=groups[name])
            ar_times[name].append(time.perf_counter() - t0)

    for name in ("pycomm", "gloo", "local"):
        run(name, cfg["warmup"], record=False)
    order = ["pycomm", "gloo"]
    for rnd in range(cfg["rounds"]):
        for name in (order if rnd % 2 == 0 else order[::-1]):
            run(name, cfg["iters"], record=True)
            run_allreduce(name, cfg["iters"])
        run("local", cfg["iters"], record=True)
    # correctness in the same pass: both replicas saw the same batches from the same init
    diff = max((a - b).abs().max().item()
               for a, b in zip(models["pycomm"].parameters(), models["gloo"].parameters()))
    assert steps["pycomm"] == steps["gloo"]
    dist.barrier(group=gloo)
    result = {
        "world": world,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "allreduce_s": {k: statistics.median(v) for k, v in ar_times.items()},
        "bytes_per_step": {"pycomm": statistics.median(bytes_pycomm), "gloo": statistics.median(bytes_gloo)},
        "max_param_diff": diff,
        "steps": steps["pycomm"],
        "memcpy_gbps": memcpy_gbps() if rank == 0 else None,
        "algorithm": pycomm.last_algorithm() if hasattr(pycomm, "last_algorithm") else "",
    }
    dist.destroy_process_group()
    return result


def format_table(results, cfg, command):
    lines = [f"$ {command}",
             f"# {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"PYCOMM_TRANSPORT={os.environ.get('PYCOMM_TRANSPORT', '(default: shm on one host)')}",
             f"# EmbeddingBag {cfg['rows']} x {cfg['dim']} float32 sparse + head; "
             f"{cfg['bags']} bags x {cfg['bag_size']} lookups per rank per step; "
             f"median of {cfg['rounds']} x {cfg['iters']} steps after {cfg['warmup']} warm-up; rank 0",
             "",
             "| ranks | local step (no comm) | pycomm step | gloo step | step ratio gloo/pycomm "
             "| pycomm sparse all_reduce | gloo sparse all_reduce | all_reduce ratio "
             "| pycomm bytes/step | gloo bytes/step | max param diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s, a, b = r["step_s"], r["allreduce_s"], r["bytes_per_step"]
        lines.append(
            f"| {r['world']} | {s['local'] * 1e3:.2f} ms | {s['pycomm'] * 1e3:.2f} ms | {s['gloo'] * 1e3:.2f} ms "
            f"| {s['gloo'] / s['pycomm']:.2f}x | {a['pycomm'] * 1e6:.0f} us | {a['gloo'] * 1e6:.0f} us "
            f"| {a['gloo'] / a['pycomm']:.2f}x | {b['pycomm'] / 1e3:.1f} kB | {b['gloo'] / 1e3:.1f} kB (computed) "
            f"| {r['max_param_diff']:.2g} |")
    mem = next((r["memcpy_gbps"] for r in results if r["memcpy_gbps"]), None)
    if mem:
        lines.append(f"\nmemcpy on this machine: {mem:.1f} GB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bags", type=int, default=64)
    parser.add_argument("--bag-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--transport", choices=["default", "shm", "tcp"], default="default")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results", "sparse_embedding"))
    args = parser.parse_args(argv)
    if args.transport != "default":
        os.environ["PYCOMM_TRANSPORT"] = args.transport
    cfg = dict(rows=args.rows, dim=args.dim, bags=args.bags, bag_size=args.bag_size, warmup=args.warmup,
               iters=args.iters, rounds=args.rounds)
    command = "python benchmarks/sparse_embedding.py" + ("" if argv is None else " " + " ".join(argv)) \
        if argv is not None else "python " + " ".join(sys.argv)
    results = []
    for world in [int(w) for w in args.world_sizes.split(",")]:
        results.append(launch_workers(worker, world, cfg, prefix="sparse_embedding:"))
        print(f"{world} ranks: " + format_table(results[-1:], cfg, command).splitlines()[6], flush=True)
    table = format_table(results, cfg, command)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".txt", "w") as f:
            f.write(table + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"command": command, "config": cfg, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
