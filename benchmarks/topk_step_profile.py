"""Where one training step goes with topk_hook: forward, backward (each bucket's hook call and
when its collective completes), optimizer, and the CPU time of the rank's process per step.

    python benchmarks/topk_step_profile.py                      # 4 ranks, 1 Gbit/s tbf, dense + top-k
    python benchmarks/topk_step_profile.py --configs "dense,topk,topk step" --rate ""   # no namespaces

The model, data and optimizer are compression_digits.py's (MLP 64-512-512-10, digits, SGD,
global batch 64, 1 torch thread per rank); with ``--rate`` every rank runs in its own network
namespace behind a tc tbf limit (pycomm.netns), which needs root. Rank 0's per-step records,
after ``--skip`` warm-up steps, are summarised as medians: ``start`` = when DDP handed the
bucket to the hook, ``hook`` = how long the hook call took (the encode, on DDP's thread),
``done`` = when the bucket's future completed, all from the start of backward; ``cpu`` =
process CPU time (every thread) per step. Configs: ``dense`` (no hook), ``topk`` (TopKState(
density=0.01)), ``topk step`` (schedule="step"), ``topk small-dense`` (min_compression_rate=45),
combinable; name a config more than once to interleave repeats (the load of a shared machine
drifts between configs run one after the other). On an oversubscribed machine (4 ranks on 2 cores) the step is bounded by the
ranks' CPU: world x cpu / cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _state(name):
    from pycomm import hooks

    words = name.split()[1:]
    return hooks.TopKState(density=0.01, error_feedback=True, schedule="step" if "step" in words else "bucket",
                           min_compression_rate=45.0 if "small-dense" in words else 0.0)


def worker(a) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    import pycomm  # noqa: F401  (registers the backend)
    from pycomm import hooks
    from pycomm.train.tasks import get_task

    sys.path.insert(0, HERE)
    import compression_digits

    dist.init_process_group("pycomm", init_method=a.init, rank=a.rank, world_size=a.world)
    task = get_task("digits-mlp")
    out = []  # (config, steps) in run order; a config may be named more than once (interleaved repeats)
    for name in a.configs.split(","):
        ddp = DDP(compression_digits._make_model(0), **({} if a.bucket_cap_mb is None else
                                                        {"bucket_cap_mb": a.bucket_cap_mb}))
        records = []
        if name != "dense":
            def timed(state, bucket):
                t0 = time.perf_counter()
                fut = hooks.topk_hook(state, bucket)
                entry = {"bucket": bucket.index(), "numel": bucket.buffer().numel(), "t0": t0,
                         "hook": time.perf_counter() - t0}
                records.append(entry)

                def done(f):
                    entry["done"] = time.perf_counter()
                    return f.value()
                return fut.then(done)
            ddp.register_comm_hook(_state(name), timed)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        per_rank = 64 // a.world
        steps = []
        for s in range(a.steps):
            idx = torch.arange(s * 64 + a.rank * per_rank, s * 64 + (a.rank + 1) * per_rank) % task.x_train.shape[0]
            records.clear()
            c0, t0 = time.process_time(), time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(task.x_train[idx]), task.y_train[idx])
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3, c3 = time.perf_counter(), time.process_time()
            steps.append({"total": t3 - t0, "cpu": c3 - c0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2,
                          "buckets": [{"bucket": r["bucket"], "numel": r["numel"], "start": r["t0"] - t1,
                                       "hook": r["hook"], "done": r.get("done", t2) - t1} for r in records]})
        out.append((name, steps[a.skip:]))
        dist.barrier()
    dist.destroy_process_group()
    if a.rank == 0:
        with open(a.result, "w") as handle:
            json.dump(out, handle)
    return 0


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] * 1e3


def summary(out) -> list:
    lines = []
    for name, steps in out:
        lines.append(f"{name:>22}: step {_median([s['total'] for s in steps]):6.2f} ms  cpu {_median([s['cpu'] for s in steps]):5.2f}"
                     f"  fwd {_median([s['fwd'] for s in steps]):5.2f}  bwd {_median([s['bwd'] for s in steps]):6.2f}"
                     f"  opt {_median([s['opt'] for s in steps]):5.2f}")
        for i in range(max(len(s["buckets"]) for s in steps)):
            rows = [s["buckets"][i] for s in steps if len(s["buckets"]) > i]
            lines.append(f"{'':>24}bucket {rows[0]['bucket']} ({rows[0]['numel']} elements): start "
                         f"{_median([r['start'] for r in rows]):5.2f}  hook {_median([r['hook'] for r in rows]):5.2f}"
                         f"  done {_median([r['done'] for r in rows]):6.2f} ms after backward began")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate per host ('' : all ranks on loopback)")
    parser.add_argument("--configs", default="dense,topk")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the medians")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: DDP's)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker:
        return worker(a)

    sys.path.insert(0, REPO)
    from pycomm.netns import NetnsHosts, kill_tree

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    hosts = NetnsHosts(a.world, rate=a.rate) if a.rate else None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    with tempfile.TemporaryDirectory(prefix="topk_step_profile_") as tmp:
        result = os.path.join(tmp, "rank0.json")
        try:
            if hosts is not None:
                hosts.create()
                env["PYCOMM_SOCKET_IFNAME"] = hosts.ifname
            addr = hosts.addrs[0] if hosts is not None else "127.0.0.1"
            for rank in range(a.world):
                argv = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank), "--world",
                        str(a.world), "--init", f"tcp://{addr}:29541", "--result", result, "--configs", a.configs,
                        "--steps", str(a.steps), "--skip", str(a.skip)]
                if a.bucket_cap_mb is not None:
                    argv += ["--bucket-cap-mb", str(a.bucket_cap_mb)]
                if hosts is not None:
                    argv = ["ip", "netns", "exec", hosts.names[rank], *argv]
                procs.append(subprocess.Popen(argv, env=env, stderr=None if rank == 0 else subprocess.DEVNULL))
            deadline = time.monotonic() + a.timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_tree(p)
            if hosts is not None:
                hosts.close()
        if any(p.returncode for p in procs):
            print(f"failed: exit codes {[p.returncode for p in procs]}", file=sys.stderr)
            return 1
        with open(result) as handle:
            out = json.load(handle)
    print("\n".join(summary(out)))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
