"""Soak test: many mixed collectives through pycomm, watching for leaks.

    python benchmarks/soak.py                       # 100000 ops on 2 ranks
    python benchmarks/soak.py --ranks 4 --ops 20000

Every rank runs the same pseudo-random sequence (one shared seed) of
collectives: all_reduce (every op valid for the dtype), broadcast, reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, barrier,
and a send/recv ring, on tensors of 0 .. --max-bytes bytes and one of ten
dtypes. Inputs are rank-dependent constants, so every result is known in
closed form and is checked (first, middle and last element).

Every --report-every ops each rank samples its VmRSS and thread count
(/proc/self/status) and open file descriptors (/proc/self/fd); the parent
prints one line per sample. Fails (exit status 1) when

* any result is wrong or any rank fails, crashes or hangs (--timeout);
* after warm-up (the first sample) RSS grows by more than --rss-bound-mib
  on any rank, or the fd or thread count is ever above its warm-up value;
* after destroy_process_group() the fd count is not back to its value
  before init_process_group() (no sockets, epoll or event fds left), or the
  thread count is above it (worker and I/O threads joined);
* /dev/shm holds files with "pycomm" in their name at the end.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import queue
import random
import sys
import tempfile
import time
import traceback

OPS = ["all_reduce", "all_reduce", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
       "all_to_all", "barrier", "sendrecv"]


def proc_status():
    rss = threads = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, len(os.listdir("/proc/self/fd")), threads


def proc_details():
    """fd number -> link target, and the names of this process's threads."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return fds, sorted(names)


def shm_pycomm_files():
    try:
        return sorted(f for f in os.listdir("/dev/shm") if "pycomm" in f.lower())
    except FileNotFoundError:
        return []


def worker(rank, world, args, init_file, q):
    try:
        import warnings

        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor / *_tensor renames

        import pycomm  # noqa: F401

        torch.set_num_threads(1)
        D = dist.ReduceOp
        dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.uint8, torch.bool]
        float_ops = [("SUM", D.SUM), ("AVG", D.AVG), ("PRODUCT", D.PRODUCT), ("MIN", D.MIN), ("MAX", D.MAX)]
        int_ops = [("SUM", D.SUM), ("PRODUCT", D.PRODUCT), ("MIN", D.MIN), ("MAX", D.MAX), ("BAND", D.BAND),
                   ("BOR", D.BOR), ("BXOR", D.BXOR)]

        def val(r, dtype):  # rank r's input value: small, so nothing overflows (<= 4 ranks)
            return (r % 2 == 0) if dtype == torch.bool else r + 1

        def expected_reduce(name, dtype):
            vals = [val(r, dtype) for r in range(world)]
            if dtype == torch.bool:
                if name in ("SUM", "MAX", "BOR"):
                    return any(vals)
                if name in ("PRODUCT", "MIN", "BAND"):
                    return all(vals)
                return sum(vals) % 2 == 1  # BXOR
            out = {"SUM": sum(vals), "AVG": sum(vals) / world, "MIN": min(vals), "MAX": max(vals)}.get(name)
            if out is not None:
                return out
            acc = vals[0]
            for v in vals[1:]:
                acc = {"PRODUCT": acc * v, "BAND": acc & v, "BOR": acc | v, "BXOR": acc ^ v}[name]
            return acc

        def check(what, t, exp):
            if t.numel() == 0:
                return
            flat = t.reshape(-1)
            for i in {0, flat.numel() // 2, flat.numel() - 1}:
                got = flat[i].item()
                ok = abs(float(got) - float(exp)) <= 1e-2 * max(1.0, abs(float(exp))) \
                    if t.dtype.is_floating_point else got == exp
                if not ok:
                    raise AssertionError(f"rank {rank}: {what}: element {i} is {got!r}, expected {exp!r}")

        import numpy  # noqa: F401  (torch loads it lazily; its BLAS thread must predate the baseline)

        q.put(("ready", rank, None))  # starts the queue's feeder thread before the baseline too
        time.sleep(0.2)
        before = proc_status()
        details_before = proc_details()
        dist.init_process_group("pycomm", init_method="file://" + init_file, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.pg_timeout))
        rng = random.Random(args.seed)  # same sequence on every rank
        t0 = time.monotonic()
        for i in range(1, args.ops + 1):
            op = rng.choice(OPS)
            dtype = rng.choice(dtypes)
            if op == "reduce_scatter" and dtype == torch.bool:
                dtype = torch.uint8  # SUM on bool is OR: keep the closed form simple
            esize = torch.empty(0, dtype=dtype).element_size()
            n = rng.randint(0, args.max_bytes) // esize
            mine = val(rank, dtype)
            what = f"op {i}: {op} {dtype} n={n}"
            if op == "all_reduce":
                name, rop = rng.choice(float_ops if dtype.is_floating_point else int_ops)
                t = torch.full((n,), mine, dtype=dtype)
                dist.all_reduce(t, op=rop)
                check(what + " " + name, t, expected_reduce(name, dtype))
            elif op == "broadcast":
                root = rng.randrange(world)
                t = torch.full((n,), mine, dtype=dtype)
                dist.broadcast(t, src=root)
                check(what, t, val(root, dtype))
            elif op == "reduce":
                root = rng.randrange(world)
                t = torch.full((n,), mine, dtype=dtype)
                dist.reduce(t, dst=root, op=D.MAX)
                if rank == root:
                    check(what, t, expected_reduce("MAX", dtype))
            elif op == "all_gather":
                n = n // world
                out = torch.empty(n * world, dtype=dtype)
                dist.all_gather_into_tensor(out, torch.full((n,), mine, dtype=dtype))
                for r in range(world):
                    check(what + f" part {r}", out[r * n:(r + 1) * n], val(r, dtype))
            elif op == "reduce_scatter":
                n = n // world
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, torch.full((n * world,), mine, dtype=dtype), op=D.SUM)
                check(what, out, expected_reduce("SUM", dtype))
            elif op == "all_to_all":
                n = n // world
                inp = torch.full((n * world,), mine, dtype=dtype)
                out = torch.empty(n * world, dtype=dtype)
                dist.all_to_all_single(out, inp)
                for r in range(world):
                    check(what + f" part {r}", out[r * n:(r + 1) * n], val(r, dtype))
            elif op == "barrier":
                dist.barrier()
            else:  # send to the next rank, receive from the previous one
                right, left = (rank + 1) % world, (rank - 1) % world
                out = torch.empty(n, dtype=dtype)
                reqs = [dist.irecv(out, src=left), dist.isend(torch.full((n,), mine, dtype=dtype), dst=right)]
                for req in reqs:
                    req.wait()
                check(what, out, val(left, dtype))
            if i % args.report_every == 0 or i == args.ops:
                q.put(("sample", rank, (i, *proc_status(), time.monotonic() - t0, proc_details()[1])))
        dist.barrier()
        # drop our references to tensors and Work objects first: a Work that
        # outlives its group may keep the group's transport alive
        t = out = inp = reqs = req = None  # noqa: F841
        dist.destroy_process_group()
        import gc

        gc.collect()
        time.sleep(0.5)  # let exiting threads finish
        q.put(("end", rank, (before, proc_status(), shm_pycomm_files(), details_before, proc_details())))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
        q.close()
        q.join_thread()
        os._exit(1)


def main(argv=None):
    p = argparse.ArgumentParser(description="pycomm soak test (see the module docstring)")
    p.add_argument("--ops", type=int, default=100000)
    p.add_argument("--ranks", type=int, default=2, choices=[2, 3, 4])
    p.add_argument("--max-bytes", type=int, default=1 << 20)
    p.add_argument("--report-every", type=int, default=10000)
    p.add_argument("--rss-bound-mib", type=float, default=32.0,
                   help="allowed RSS growth per rank after warm-up (the first sample)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="wall-clock limit for the whole run")
    args = p.parse_args(argv)
    if args.report_every > args.ops:
        args.report_every = args.ops

    world = args.ranks
    print(f"soak: {args.ops} ops on {world} ranks, sizes 0..{args.max_bytes} B, seed {args.seed}, "
          f"report every {args.report_every}, RSS bound {args.rss_bound_mib} MiB after warm-up", flush=True)
    shm_before = shm_pycomm_files()
    mp = multiprocessing.get_context("spawn")
    q = mp.Queue()
    tmp = tempfile.mkdtemp(prefix="pycomm_soak_")
    procs = [mp.Process(target=worker, args=(r, world, args, os.path.join(tmp, "rdzv"), q), daemon=True)
             for r in range(world)]
    for pr in procs:
        pr.start()
    samples, ends, errors = {}, {}, {}
    deadline = time.monotonic() + args.timeout
    failed = []
    print(f"{'ops':>8} {'seconds':>8}  " + "  ".join(f"r{r}:RSS MiB/fds/thr" for r in range(world)), flush=True)
    while len(ends) + len(errors) < world:
        try:
            kind, rank, payload = q.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, pr in enumerate(procs) if not pr.is_alive() and r not in ends and r not in errors]
            if dead:
                time.sleep(1)
                try:
                    while True:
                        kind, rank, payload = q.get_nowait()
                        (ends if kind == "end" else errors if kind == "error" else {})[rank] = payload
                except queue.Empty:
                    pass
                for r in dead:
                    if r not in ends and r not in errors:
                        errors[r] = f"died with exit code {procs[r].exitcode} without reporting"
            if time.monotonic() > deadline:
                failed.append(f"timed out after {args.timeout:.0f} s")
                break
            continue
        if kind == "sample":
            i = payload[0]
            samples.setdefault(i, {})[rank] = payload[1:]
            if len(samples[i]) == world:
                cols = "  ".join(f"{s[0] / 2**20:8.1f}/{s[1]:3d}/{s[2]:2d}" for _, s in sorted(samples[i].items()))
                secs = max(s[3] for s in samples[i].values())
                print(f"{i:8d} {secs:8.1f}  {cols}", flush=True)
        elif kind == "end":
            ends[rank] = payload
        elif kind == "error":
            errors[rank] = payload
            if len(errors) == 1:
                deadline = min(deadline, time.monotonic() + 30)
    for pr in procs:
        pr.join(timeout=10)
        if pr.is_alive():
            pr.kill()
            failed.append(f"rank {procs.index(pr)} did not exit")
    for r, e in sorted(errors.items()):
        failed.append(f"rank {r} failed:\n{e.rstrip()}")

    # leak checks
    counts = sorted(samples)
    if counts and len(samples[counts[0]]) == world:
        warm = samples[counts[0]]
        for c in counts[1:]:
            for r, (rss, fds, thr, _, names) in samples[c].items():
                grow = (rss - warm[r][0]) / 2**20
                if grow > args.rss_bound_mib:
                    failed.append(f"rank {r}: RSS grew by {grow:.1f} MiB between op {counts[0]} and op {c} "
                                  f"(bound {args.rss_bound_mib} MiB)")
                if fds > warm[r][1]:
                    failed.append(f"rank {r}: open fds grew from {warm[r][1]} to {fds} at op {c}")
                if thr > warm[r][2]:
                    failed.append(f"rank {r}: threads grew from {warm[r][2]} to {thr} at op {c} "
                                  f"({warm[r][4]} -> {names})")
        last = samples[counts[-1]]
        print("RSS growth after warm-up (op %d -> op %d): %s" % (
            counts[0], counts[-1], ", ".join(f"rank {r} {(last[r][0] - warm[r][0]) / 2**20:+.1f} MiB"
                                             for r in sorted(last))), flush=True)
    for r, (before, after, shm, dbefore, dafter) in sorted(ends.items()):
        print(f"rank {r}: before init: {before[1]} fds, {before[2]} threads; after destroy_process_group: "
              f"{after[1]} fds, {after[2]} threads; RSS {after[0] / 2**20:.1f} MiB", flush=True)
        if after[1] != before[1]:
            extra = {k: v for k, v in dafter[0].items() if dbefore[0].get(k) != v}
            failed.append(f"rank {r}: {after[1]} fds after destroy_process_group, {before[1]} before init "
                          f"(new: {extra})")
        if after[2] > before[2]:
            failed.append(f"rank {r}: {after[2]} threads after destroy_process_group, {before[2]} before init "
                          f"(threads before {dbefore[1]}, after {dafter[1]})")
    shm_after = sorted(set(shm_pycomm_files()) - set(shm_before))
    print(f"/dev/shm pycomm files at exit: {shm_after or 'none'}", flush=True)
    if shm_after:
        failed.append(f"/dev/shm still holds {shm_after}")
    if len(ends) < world and not failed:
        failed.append("not every rank finished")
    if failed:
        print("SOAK FAILED:\n  " + "\n  ".join(failed), flush=True)
        return 1
    print("SOAK OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
