"""How low can an 8-byte all-reduce through torch.distributed go when ranks outnumber
the cores? The scale issue's item 3 (4 ranks on 2 cores, barrier then one call, at most
2x Open MPI) against what any backend behind torch's frontend pays.

    python benchmarks/latency_floor.py --ranks 4 --iters 2000

Every sample is the benchmark's own shared-memory barrier (pycomm.bench.shm_barrier, the
code behind ``pycomm-bench --timing shm-barrier``), then one timed call. The kinds take
turns sample by sample (the first kind rotates), so load that drifts meets them alike:

* ``torch op``: ``x.add_(0)`` on 2 floats, a torch op that talks to nobody;
* ``group of one``: ``dist.all_reduce`` of 8 bytes on a pycomm group of this rank alone:
  torch's frontend (Python, pybind11, the dispatcher) and pycomm's call path, no peer;
* ``all-reduce``: ``dist.all_reduce`` of 8 bytes on the pycomm group of every rank.

Each figure is the median over samples of the slowest rank (pycomm-bench's rule). With
more ranks than cores, a rank's all-reduce ends only after the rank sharing its core has
also gone through its own call up to its post, so the all-reduce cannot take less than
about twice the group of one: that is printed as the floor. With Open MPI installed
(``mpirun`` and mpi4py; ``--no-mpi`` skips it), the same barrier-then-call sweep runs
through ``pycomm.bench.mpi`` right after, and the all-reduce and the floor are printed as
multiples of its time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("torch op", "group of one", "all-reduce")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, iters: int, warmup: int, queue) -> None:
    try:
        import pycomm  # noqa: F401  registers the backend
        from pycomm.bench.shm_barrier import ShmBarrier

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("pycomm", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        control = dist.new_group(backend="gloo")

        def broadcast(value):
            box = [value]
            dist.broadcast_object_list(box, src=0, group=control)
            return box[0]

        barrier = ShmBarrier(rank, world, broadcast, lambda: dist.barrier(group=control), timeout_s=60)
        alone = None
        for r in range(world):  # every rank takes part in making every group
            group = dist.new_group([r], backend="pycomm")
            if r == rank:
                alone = group
        x = torch.ones(2)
        calls = {
            "torch op": lambda: x.add_(0),
            "group of one": lambda: dist.all_reduce(x, group=alone),
            "all-reduce": lambda: dist.all_reduce(x),
        }
        times = {name: [] for name in KINDS}
        for sample in range(warmup + iters):
            shift = sample % len(KINDS)
            for name in KINDS[shift:] + KINDS[:shift]:
                call = calls[name]
                barrier()
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                if sample >= warmup:
                    times[name].append(elapsed)
        x.fill_(1.0)
        dist.all_reduce(x)  # the all-reduce still sums: every rank's 1
        if not torch.equal(x, torch.full((2,), float(world))):
            raise RuntimeError(f"rank {rank}: all-reduce gave {x.tolist()}, expected {float(world)}")
        queue.put((rank, {name: statistics.median(t) for name, t in times.items()}))
        barrier()
        barrier.close()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported by the parent, which stops waiting)
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _mpi_time_us(ranks: int, iters: int, warmup: int) -> float:
    """Open MPI's 8-byte all-reduce, barrier then one call (pycomm.bench.mpi)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mpi.json")
        cmd = ["mpirun"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) + [
            "--oversubscribe", "-np", str(ranks), sys.executable, "-m", "pycomm.bench.mpi", "-b", "8", "-e", "8",
            "--iters", str(iters), "--warmup", str(warmup), "--timing", "shm-barrier", "--quiet", "--json", out]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the Open MPI sweep failed ({proc.returncode}): {proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["rows"][0]["time_us"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2000, help="samples of each kind")
    parser.add_argument("--warmup", type=int, default=200, help="untimed samples of each kind first")
    parser.add_argument("--no-mpi", action="store_true", help="skip the Open MPI sweep")
    args = parser.parse_args(argv)
    sys.path.append(REPO)  # after PYTHONPATH: another build can be measured by putting it there
    if args.ranks < 2:
        parser.error("--ranks must be >= 2")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    from pycomm.bench import mpi_unavailable_reason

    mpi_missing = "skipped (--no-mpi)" if args.no_mpi else mpi_unavailable_reason()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.iters, args.warmup, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 600
    while len(results) < args.ranks:
        try:
            rank, value = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: is anyone gone?
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                print(f"latency_floor: a rank exited before reporting (exit codes "
                      f"{[p.exitcode for p in procs]})", file=sys.stderr)
                return 1
            continue
        if isinstance(value, str):
            for p in procs:
                p.kill()
            print(f"latency_floor: rank {rank} failed: {value}", file=sys.stderr)
            return 1
        results[rank] = value
    for p in procs:
        p.join(timeout=60)
    slowest = {name: max(results[r][name] for r in results) * 1e6 for name in KINDS}
    floor = 2 * slowest["group of one"]
    cpus = len(os.sched_getaffinity(0))
    print(f"# {args.ranks} ranks on {cpus} CPUs, torch {torch.__version__}; shared-memory barrier, then one "
          f"timed call; {args.iters} samples of each kind after {args.warmup}; slowest rank's median")
    print(f"{'kind':<34}{'us':>9}")
    for name in KINDS:
        print(f"{'pycomm ' + name if name != 'torch op' else 'torch op (x.add_(0))':<34}{slowest[name]:>9.1f}")
    print(f"{'floor (2 x group of one)':<34}{floor:>9.1f}")
    if mpi_missing is None:
        mpi = _mpi_time_us(args.ranks, args.iters, min(args.warmup, 50))
        print(f"{'Open MPI all-reduce (right after)':<34}{mpi:>9.1f}")
        print(f"# pycomm all-reduce / Open MPI: {slowest['all-reduce'] / mpi:.2f}x; "
              f"floor / Open MPI: {floor / mpi:.2f}x")
    else:
        print(f"# Open MPI: {mpi_missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
