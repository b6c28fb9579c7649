"""Waiting in the shared-memory arena next to a busy neighbour (issue #42 item 4).

Two ranks and two busy processes (other jobs', as on a shared host) on one CPU: the ranks'
arena is oversubscribed (2 ranks, 1 allowed CPU). Where no other thread is runnable an
oversubscribed wait polls with sched_yield; here the busy processes are, and a yield would
hand one of them a whole time slice, so the waiting rank sleeps on the futex at once
(ShmArena::waitFor, /proc/loadavg's runnable count). Counted with the waiting rank's
involuntary context switches (a yield that let another task run is one; a futex sleep
is a voluntary one).
"""
import os
import subprocess
import time

import pytest
import torch

import mp_util
from mp_util import spawn_run


def _switches(kind):
    with open("/proc/thread-self/status") as f:
        return int(next(line for line in f if line.startswith(kind)).split()[1])


def _late_peer_next_to_a_hog(ctx, calls, late_s):
    import torch.distributed as dist

    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    group = dist.new_group(backend="pycomm")  # the arena reads the mask: 2 ranks, 1 CPU
    x = torch.ones(256)
    dist.all_reduce(x, group=group)
    hogs = []
    if ctx.rank == 0:
        hogs = [subprocess.Popen(["timeout", "60", "taskset", "-c", str(cpu), "sh", "-c", "while :; do :; done"])
                for _ in range(2)]
        time.sleep(0.1)
    try:
        dist.all_reduce(x, group=group)
        involuntary, walls = [], []
        for _ in range(calls):
            if ctx.rank == 1:
                time.sleep(late_s)  # rank 0 waits for it, sharing its CPU with the hog
            before, wall = _switches("nonvoluntary_ctxt_switches"), time.monotonic()
            x.fill_(1)
            dist.all_reduce(x, group=group)
            walls.append(time.monotonic() - wall)
            involuntary.append(_switches("nonvoluntary_ctxt_switches") - before)
        ok = bool(torch.all(x == 2))
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.wait(10)
    return {"ok": ok, "involuntary": involuntary, "walls": sorted(walls), "pid": os.getpid()}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_waiting_rank_stops_yielding_to_a_busy_neighbour():
    calls, late = 40, 0.003
    res = spawn_run(_late_peer_next_to_a_hog, 2, args=(calls, late), env={"PYCOMM_TRANSPORT": "shm"},
                    make_ref=False, timeout_s=120, pg_timeout_s=30).check()
    out = res.returns[0]
    assert out["ok"], out
    # Rank 0 waited ~3 ms at each call. Yielding at every wait would hand the hog the
    # CPU at every call (an involuntary switch each, 39 of 40 before the change); with
    # the hogs runnable it sleeps at once.
    yielded = sum(n > 0 for n in out["involuntary"])
    assert yielded <= calls // 4, f"rank 0 was switched out involuntarily in {yielded} of {calls} waits: {out}"


def _ignore_other_jobs(ctx):
    from pycomm import _C

    _C._shm_ignore_other_jobs(True)  # as tests/transport/test_shm.py's polling cases do
    return os.getpid()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or mp_util.START_METHOD != "forkserver",
                    reason="needs CPU affinity and the pool of fork-server ranks")
def test_a_pooled_rank_heeds_other_jobs_after_a_case_that_ignored_them(monkeypatch):
    """The pool gives each case pycomm's process-wide state as a fresh rank has it: a case
    that turned the other-jobs check off does not leave it off for the next case."""
    monkeypatch.setattr(mp_util, "POOL", True)
    mp_util.close_pool()
    try:
        calls, late = 40, 0.003
        first = spawn_run(_ignore_other_jobs, 2, make_ref=False, timeout_s=60).check()
        res = spawn_run(_late_peer_next_to_a_hog, 2, args=(calls, late), env={"PYCOMM_TRANSPORT": "shm"},
                        make_ref=False, timeout_s=120, pg_timeout_s=30).check()
    finally:
        mp_util.close_pool()
    out = res.returns[0]
    assert out["pid"] == first.returns[0], "the second case did not run on the first case's ranks"
    assert out["ok"], out
    yielded = sum(n > 0 for n in out["involuntary"])
    assert yielded <= calls // 4, f"rank 0 was switched out involuntarily in {yielded} of {calls} waits: {out}"
