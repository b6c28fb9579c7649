"""What one all-reduce call costs each rank besides time: CPU (user, system), minor
page faults, context switches, and the bytes that arrived before their receive was
posted (pycomm.stats()['bytes_buffered']: the TCP transport allocates a buffer for
such a message and copies it out later).

    python benchmarks/call_cost.py --algo sharded --mib 64 --ranks 2 --iters 10

Ranks are spawned on this host and talk over TCP (PYCOMM_TRANSPORT=tcp, loopback),
each with one torch thread; the figures are per call, averaged over --iters calls
after 3 untimed ones, per rank. Used for the sharded all-reduce's receive posting
(docs/planner.md, "Open").
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYCOMM_TRANSPORT="tcp",
                      PYCOMM_ALGO=args.algo)
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    dist.init_process_group("pycomm", rank=rank, world_size=world)
    x = torch.ones((args.mib << 20) // 4)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    b0 = pycomm.stats()["bytes_buffered"]
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    b1 = pycomm.stats()["bytes_buffered"]
    n = args.iters
    queue.put((rank, (t1 - t0) / n * 1e3, (r1.ru_utime - r0.ru_utime) / n * 1e3,
               (r1.ru_stime - r0.ru_stime) / n * 1e3, (r1.ru_minflt - r0.ru_minflt) / n,
               (r1.ru_nvcsw - r0.ru_nvcsw) / n, (r1.ru_nivcsw - r0.ru_nivcsw) / n, (b1 - b0) / n / 2**20))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="sharded", help="PYCOMM_ALGO (default sharded)")
    parser.add_argument("--mib", type=int, default=64, help="MiB per rank (float32)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.mib < 1 or args.iters < 1:
        parser.error("--ranks must be >= 2, --mib and --iters >= 1")
    sys.path.append(REPO)  # after PYTHONPATH: another build can be measured by putting it there
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        rows = sorted(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    print(f"# {args.algo}, {args.mib} MiB float32, {args.ranks} ranks over TCP loopback, per call "
          f"(mean of {args.iters})")
    for r in rows:
        print(f"rank {r[0]}: wall {r[1]:.1f} ms, user {r[2]:.1f} ms, sys {r[3]:.1f} ms, minor faults {r[4]:.0f}, "
              f"voluntary switches {r[5]:.0f}, involuntary {r[6]:.0f}, arrived before their receive {r[7]:.1f} MiB")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
