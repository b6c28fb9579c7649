"""What one all-reduce call costs each rank besides time: CPU (user, system), minor
page faults, context switches, and the bytes that arrived before their receive was
posted (pycomm.stats()['bytes_buffered']: the TCP transport allocates a buffer for
such a message and copies it out later).

    python benchmarks/call_cost.py --algo sharded --mib 64 --ranks 2 --iters 10
    python benchmarks/call_cost.py --algo ring --mib 64 --ranks 4 --threads

--threads adds, per rank, each thread's time on a CPU per call and as a share of the
call's wall time, by thread name (pycomm names its own: pycomm-io<k> for the TCP
transport's I/O threads, pycomm-worker for the group's worker, pycomm-done for the
completion threads; a blocking call runs on the caller's thread, "caller"), and how
much of that time was in the kernel (socket copies are). A thread near 100% is the
one that sets the pace.

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


def _thread_cpu() -> dict:
    """Each thread of this process, keyed by (name, tid): (nanoseconds on a CPU so far,
    /proc/self/task/<tid>/schedstat's first field; clock ticks in user and in kernel
    mode, stat's utime and stime). The main thread, which makes the calls, is named
    "caller"."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "caller" if tid == str(os.getpid()) else f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from field 3 on: the name may hold spaces
            out[(name, tid)] = (ns, int(fields[11]), int(fields[12]))  # fields 14 and 15
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


def _threads_per_call(before: dict, after: dict, iters: int, wall_ms: float) -> list:
    """[(name, threads, ms per call, share of wall, share of its ticks in the kernel or
    None)] by thread name, busiest first; threads under 0.05 ms per call left out. The
    kernel share is given only from 20 clock ticks on (ticks are 10 ms: fewer say little)."""
    by_name = {}
    for key, (ns, user, kernel) in after.items():
        ns0, user0, kernel0 = before.get(key, (0, 0, 0))
        ms, ticks, kernel_ticks, count = by_name.get(key[0], (0.0, 0, 0, 0))
        by_name[key[0]] = (ms + (ns - ns0) / 1e6 / iters, ticks + (user - user0) + (kernel - kernel0),
                           kernel_ticks + (kernel - kernel0), count + 1)
    rows = [(name, count, ms, ms / wall_ms, kernel / ticks if ticks >= 20 else None)
            for name, (ms, ticks, kernel, count) in by_name.items() if ms >= 0.05]
    return sorted(rows, key=lambda row: -row[2])


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
    c0 = _thread_cpu()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    c1 = _thread_cpu()
    b1 = pycomm.stats()["bytes_buffered"]
    n = args.iters
    wall_ms = (t1 - t0) / n * 1e3
    queue.put((rank, wall_ms, (r1.ru_utime - r0.ru_utime) / n * 1e3,
               (r1.ru_stime - r0.ru_stime) / n * 1e3, (r1.ru_minflt - r0.ru_minflt) / n,
               (r1.ru_nvcsw - r0.ru_nvcsw) / n, (r1.ru_nivcsw - r0.ru_nivcsw) / n, (b1 - b0) / n / 2**20,
               _threads_per_call(c0, c1, n, wall_ms)))
    dist.destroy_process_group()


def _collect(queue, procs, deadline: float):
    """Every rank's row, sorted by rank; None as soon as a rank has exited without
    reporting (its peers would otherwise be waited for until the deadline)."""
    import queue as queues

    rows = []
    while len(rows) < len(procs):
        try:
            rows.append(queue.get(timeout=0.5))
        except queues.Empty:
            reported = {row[0] for row in rows}
            if any(p.exitcode is not None and r not in reported for r, p in enumerate(procs)):
                # It may have reported just before it exited.
                try:
                    rows.append(queue.get(timeout=1))
                    continue
                except queues.Empty:
                    return None
            if time.monotonic() > deadline:
                raise TimeoutError("call_cost: the ranks did not report in time")
    return sorted(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="sharded", help="PYCOMM_ALGO (default sharded)")
    parser.add_argument("--mib", type=int, default=64, help="MiB per rank (float32)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", action="store_true",
                        help="also each thread's CPU time per call, by thread name")
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
        rows = _collect(queue, procs, deadline=time.monotonic() + 300)
        if rows is None:
            print("call_cost: a rank exited before reporting: exit codes "
                  f"{[p.exitcode for p in procs]} (its error is above)", file=sys.stderr)
            return 1
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
        if args.threads:
            print(f"rank {r[0]} threads: " + ", ".join(
                f"{name}{f' x{count}' if count > 1 else ''} {ms:.1f} ms ({share:.0%}"
                f"{'' if kernel is None else f', {kernel:.0%} in the kernel'})"
                for name, count, ms, share, kernel in r[8]))
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
