"""The intra-host shared-memory path (transport/shm_arena.*, algorithms/*_shm.cc).

* Every collective takes it on one host: with PYCOMM_TRANSPORT=shm the TCP
  transport carries no collective byte (the group's TCP counters stay at zero)
  while pycomm.stats() counts the shared-memory bytes; with PYCOMM_TRANSPORT=tcp
  the same calls go over TCP. Results are checked in both cases.
* Waiting survives oversubscription: ranks blocked on a late peer sleep (their
  CPU time stays far below the wall time they wait), ranks whose peer is 1 ms late
  poll instead of sleeping, and ranks crowded 3:1 on two CPUs spread 2:2 (a rank
  the user pinned is never moved).
* A rank stalled or silent is named in the timeout (tests/backend/test_failures.py kills a
  rank mid-collective on both paths), and nothing is left in /dev/shm.
"""
import os
import time

import pytest
import torch

from mp_util import spawn_run


def _collectives(ctx):
    import torch.distributed as dist

    import pycomm
    from pycomm._backend import _backend_of

    rank, n = ctx.rank, ctx.world_size
    pg = _backend_of(None)
    pycomm.reset_stats()
    tcp_before = (pg.bytes_sent(), pg.bytes_received())
    out = {}

    x = torch.full((100003,), float(rank + 1))
    dist.all_reduce(x)
    out["all_reduce"] = bool(torch.all(x == n * (n + 1) / 2))
    out["algorithm"] = pycomm.last_algorithm()

    b = torch.arange(70001, dtype=torch.float64) if rank == 1 else torch.zeros(70001, dtype=torch.float64)
    dist.broadcast(b, src=1)
    out["broadcast"] = bool(torch.equal(b, torch.arange(70001, dtype=torch.float64)))

    r = torch.full((5000,), rank + 1, dtype=torch.int32)
    dist.reduce(r, dst=0)
    out["reduce"] = rank != 0 or bool(torch.all(r == n * (n + 1) // 2))

    parts = [torch.empty(30000, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(parts, torch.arange(30000, dtype=torch.int64) + 10**6 * rank)
    out["all_gather"] = all(torch.equal(p, torch.arange(30000, dtype=torch.int64) + 10**6 * j)
                            for j, p in enumerate(parts))

    rs_in = torch.arange(n * 40000, dtype=torch.float32) * (rank + 1)
    rs_out = torch.empty(40000)
    dist.reduce_scatter_tensor(rs_out, rs_in)
    full = torch.arange(n * 40000, dtype=torch.float32) * (n * (n + 1) / 2)
    out["reduce_scatter"] = bool(torch.equal(rs_out, full[rank * 40000:(rank + 1) * 40000]))

    g = [torch.empty(20000) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((20000,), float(rank)), g, dst=0)
    out["gather"] = rank != 0 or all(bool(torch.all(t == j)) for j, t in enumerate(g))

    s_out = torch.empty(20000)
    dist.scatter(s_out, [torch.full((20000,), float(j + 7)) for j in range(n)] if rank == 2 else None, src=2)
    out["scatter"] = bool(torch.all(s_out == rank + 7))

    # Uneven all-to-all: rank r sends (r + j + 1) * 1000 elements to rank j.
    send_sizes = [(rank + j + 1) * 1000 for j in range(n)]
    recv_sizes = [(j + rank + 1) * 1000 for j in range(n)]
    send = torch.cat([torch.full((c,), float(100 * rank + j)) for j, c in enumerate(send_sizes)])
    recv = torch.empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
    expected = torch.cat([torch.full((c,), float(100 * j + rank)) for j, c in enumerate(recv_sizes)])
    out["all_to_all"] = bool(torch.equal(recv, expected))

    dist.barrier()
    stats = pycomm.stats()
    out["tcp_bytes"] = (pg.bytes_sent() - tcp_before[0], pg.bytes_received() - tcp_before[1])
    out["stats_sent"] = stats["bytes_sent"]
    return out


CHECKS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
          "all_to_all"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_collective_takes_the_shm_path(transport):
    res = spawn_run(_collectives, 3, env={"PYCOMM_TRANSPORT": transport}, make_ref=False,
                    timeout_s=120, pg_timeout_s=30).check()
    for rank, out in res.returns.items():
        wrong = [c for c in CHECKS if not out[c]]
        assert not wrong, f"rank {rank} ({transport}): wrong results from {wrong}"
        assert out["stats_sent"] > 0, out
        if transport == "shm":
            assert out["algorithm"] == "shm", out
            assert out["tcp_bytes"] == (0, 0), f"rank {rank}: collectives used TCP: {out['tcp_bytes']}"
        else:
            assert out["algorithm"] != "shm", out
            assert out["tcp_bytes"][0] > 0 and out["tcp_bytes"][1] > 0, out


def _sleeps():
    """Times this thread went to sleep (voluntary context switches; a sched_yield is not one)."""
    with open("/proc/thread-self/status") as f:
        return int(next(line for line in f if line.startswith("voluntary_ctxt_switches")).split()[1])


def _late_peer(ctx, delay_s, short_s, busy_s, shorts, busies):
    import torch.distributed as dist

    from pycomm import _C

    # The polling of a machine without other jobs (on a shared one, other jobs' runnable
    # threads make the waits sleep at once: test_shm_neighbour_load.py).
    _C._shm_ignore_other_jobs(True)
    x = torch.ones(1000)
    dist.all_reduce(x)  # warm: everyone is connected and mapped
    # Short waits (rank 0 late by short_s, as after a barrier's skew): the others poll.
    y = torch.ones(2)
    short_sleeps, short_walls = [], []
    for _ in range(shorts):
        dist.barrier()
        if ctx.rank == 0:
            time.sleep(short_s)
        wall, sleeps = time.monotonic(), _sleeps()
        dist.all_reduce(y)
        short_sleeps.append(_sleeps() - sleeps)
        short_walls.append(time.monotonic() - wall)
    # Rank 0 computes for busy_s (a spin, as a training step's compute): the rank that
    # shares its CPU gets the CPU back only after rank 0's time slice, and should sleep
    # rather than poll on.
    busy_sleeps = []
    for _ in range(busies):
        dist.barrier()
        if ctx.rank == 0:
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:
                pass
        sleeps = _sleeps()
        dist.all_reduce(y)
        busy_sleeps.append(_sleeps() - sleeps)
    dist.barrier()
    if ctx.rank == 0:
        time.sleep(delay_s)
    wall, cpu = time.monotonic(), time.process_time()
    dist.all_reduce(x)
    return {"wall": time.monotonic() - wall, "cpu": time.process_time() - cpu,
            "ok": bool(torch.all(x == ctx.world_size ** 2)), "short_sleeps": sorted(short_sleeps),
            "short_walls": sorted(short_walls), "busy_sleeps": busy_sleeps}


def test_waiting_ranks_sleep_when_oversubscribed():
    """4 ranks on this 2-core machine. Rank 0 arrives 2 s late: the others must sleep
    while they wait, not spin (CPU time well under the wall time). Rank 0 arrives 1 ms
    late (a barrier's skew on a crowded host): the others must not sleep but poll with
    sched_yield, awake for its post (with 200 us of polling they slept, and waking 3
    sleepers on 2 busy cores cost hundreds of us). Rank 0 computes for 3 ms: the rank
    that shares its CPU finds that a yield kept it off the CPU for a time slice, and
    sleeps instead of polling for the 5 ms it would poll for a rank that is only late."""
    delay, short, busy, shorts, busies = 2.0, 0.001, 0.003, 15, 60
    res = spawn_run(_late_peer, 4, args=(delay, short, busy, shorts, busies), env={"PYCOMM_TRANSPORT": "shm"},
                    make_ref=False, timeout_s=120, pg_timeout_s=30).check()
    for rank in (1, 2, 3):
        out = res.returns[rank]
        assert out["ok"], out
        assert out["wall"] > delay * 0.5, out  # it really waited
        assert out["cpu"] < 0.25 * out["wall"], f"rank {rank} burned CPU while waiting: {out}"
        # The median short wait: it really waited (for rank 0's 1 ms), and, where the 4
        # ranks outnumber the CPUs (this project's 2-core machines), did not sleep.
        assert out["short_walls"][shorts // 2] > short * 0.5, out
        if len(os.sched_getaffinity(0)) < 4:
            assert out["short_sleeps"][shorts // 2] == 0, f"rank {rank} slept in short waits: {out}"
    if len(os.sched_getaffinity(0)) < 4:
        # In some of the busy waits a rank (the one on rank 0's CPU, when the scheduler left
        # it there) went to sleep: quiet, 6, 9 and 12 of 40 busy waits; with the 5 ms poll
        # that came before, 0 and 1 of 40.
        slept = [sum(res.returns[rank]["busy_sleeps"][i] for rank in (1, 2, 3)) > 0 for i in range(busies)]
        assert sum(slept) >= 4, {rank: res.returns[rank]["busy_sleeps"] for rank in (1, 2, 3)}


def _polling_by_cpus(ctx):
    import torch.distributed as dist

    from pycomm import _C

    cpus = sorted(os.sched_getaffinity(0))
    out = {"cpus": len(cpus), "after_init": _C._polling_limited()}
    os.sched_setaffinity(0, {cpus[0]})  # 2 ranks, 1 CPU each may use
    crowded = dist.new_group(backend="pycomm")  # the bootstrap reads the mask
    x = torch.ones(4)
    dist.all_reduce(x, group=crowded)
    out["sum"] = x.tolist()
    out["after_crowded_group"] = _C._polling_limited()
    os.sched_setaffinity(0, set(cpus))
    dist.new_group(backend="pycomm")
    out["after_roomy_group"] = _C._polling_limited()
    return out


def test_tcp_waits_poll_only_for_small_messages_when_ranks_outnumber_cpus():
    """A TCP wait polls (yielding) for 300 us before it sleeps: it saves a wake-up where
    each rank has a core. Where ranks share cores a long wait that polls costs the ranks
    with work (8 ranks in namespaces on 2 cores: a 16 MiB tree all-reduce 100-113 ms
    without polling, 122-181 with), while a small message's still gains (4 ranks, 8 B:
    196-268 us polling small messages only, 308-408 polling none). A group whose ranks on
    this machine outnumber the CPUs this process may use limits polling to messages of
    1 byte to 64 KiB, for good; 2 ranks on 2 CPUs poll every wait."""
    res = spawn_run(_polling_by_cpus, 2, env={"PYCOMM_TRANSPORT": "tcp"}, make_ref=False,
                    timeout_s=120, pg_timeout_s=30).check()
    for rank, out in sorted(res.returns.items()):
        assert out["sum"] == [2.0] * 4, out
        if out["cpus"] >= 2:
            assert out["after_init"] is False, (rank, out)
        assert out["after_crowded_group"] is True, (rank, out)
        assert out["after_roomy_group"] is True, (rank, out)  # not lifted again


def _cpu_now():
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _crowded_ranks(ctx):
    """Phase 1: every rank pinned to CPU 0 by the user: the arena must not move
    anyone (or touch the mask). Phase 2: ranks allowed on CPUs {0, 1} but placed
    3:1 (pinned for a moment, then unpinned): the arena should spread them 2:2."""
    import torch.distributed as dist

    from pycomm import _C

    _C._shm_ignore_other_jobs(True)  # yielding ranks, as on a machine without other jobs
    out = {}
    both = {0, 1}
    x = torch.ones(2)
    os.sched_setaffinity(0, {0})
    pinned = dist.new_group(backend="pycomm")  # the arena reads the mask when it is made
    for _ in range(300):
        dist.all_reduce(x, group=pinned)
    out["pinned_cpu"], out["pinned_mask"] = _cpu_now(), sorted(os.sched_getaffinity(0))

    os.sched_setaffinity(0, both)
    spread = dist.new_group(backend="pycomm")  # 4 ranks on 2 allowed CPUs: oversubscribed
    dist.all_reduce(x, group=spread)
    os.sched_setaffinity(0, {1} if ctx.rank == 3 else {0})  # migrates now
    os.sched_setaffinity(0, both)  # ... and leaves it there
    out["start_cpu"] = _cpu_now()
    x.fill_(1)
    cpus = []  # where this rank ran after each call
    for _ in range(400):
        dist.all_reduce(x, group=spread)
        x.fill_(1)
        cpus.append(_cpu_now())
    dist.all_reduce(x, group=spread)
    out["ok"] = bool(torch.all(x == ctx.world_size))
    out["cpus"], out["spread_mask"] = cpus, sorted(os.sched_getaffinity(0))
    return out


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_crowded_ranks_spread_over_their_cpus():
    """Ranks that outnumber their CPUs yield to each other while waiting; three of
    four on one CPU would make every call wait for that CPU (the scheduler leaves
    such a 3:1 placement alone). The arena moves the crowded rank (once, by
    pinning and restoring the mask), never a rank the user pinned."""
    # The 3:1 start is set up by pinning, but the kernel may balance the ranks itself before
    # they look (seen once in CI: [0, 0, 1, 1]); then there is nothing to move, so set it up
    # again. The outcome is the kernel's placement too (another task on the VM, steal time):
    # a run that misses the 90% below is tried again, 3 runs in all; without the move every
    # run misses it (2:2 after 0 to 116 of 200 calls in four runs).
    balanced, crowded = None, None
    for attempt in range(3):
        res = spawn_run(_crowded_ranks, 4, env={"PYCOMM_TRANSPORT": "shm"}, make_ref=False,
                        timeout_s=120, pg_timeout_s=30).check()
        outs = [res.returns[r] for r in range(4)]
        assert all(o["pinned_cpu"] == 0 and o["pinned_mask"] == [0] for o in outs), outs
        if [o["start_cpu"] for o in outs] != [0, 0, 0, 1]:
            continue
        assert all(o["ok"] and o["spread_mask"] == [0, 1] for o in outs), outs
        # After call i every rank has finished call i - 1: compare placements call by
        # call over the last 200 calls. The kernel may undo a move for a while (its
        # load figures lag), so 90%, not all, must see 2:2.
        balanced = sum(sorted(sum(o["cpus"][i] == c for o in outs) for c in (0, 1)) == [2, 2]
                       for i in range(200, 400))
        crowded = outs
        if balanced >= 180:
            break
    assert balanced is not None, outs  # the crowding took (in 3 attempts)
    assert balanced >= 180, (f"ranks ran 2:2 over CPUs 0 and 1 after only {balanced} of the last 200 "
                             f"calls; CPUs of calls 200..210 by rank: {[o['cpus'][200:210] for o in crowded]}")


def _peer_that_stops(ctx, how):
    """Rank 1 skips rank 0's second all-reduce: it sleeps past rank 0's timeout
    ("sleeps") or destroys its group first ("destroys"), staying alive either way."""
    import torch.distributed as dist

    x = torch.ones(100)
    dist.all_reduce(x)
    if ctx.rank == 1:
        if how == "destroys":
            time.sleep(0.5)
            dist.destroy_process_group()
        time.sleep(6 if how == "sleeps" else 5)
        return {"skipped": True}
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}


def test_timeout_names_the_silent_rank():
    res = spawn_run(_peer_that_stops, 2, args=("sleeps",), env={"PYCOMM_TRANSPORT": "shm"}, make_ref=False,
                    timeout_s=90, pg_timeout_s=3).check()
    out = res.returns[0]
    assert out["error"] is not None, out
    assert "DistBackendError" in out["error"] and "Timed out" in out["error"], out
    assert "rank 1" in out["error"] and "(shm)" in out["error"], out
    assert 2.5 < out["seconds"] < 3 + 5, out


def test_destroyed_peer_is_named_at_once():
    res = spawn_run(_peer_that_stops, 2, args=("destroys",), env={"PYCOMM_TRANSPORT": "shm"}, make_ref=False,
                    timeout_s=90, pg_timeout_s=30).check()
    out = res.returns[0]
    assert out["error"] is not None, out
    assert "rank 1" in out["error"], out
    assert out["seconds"] < 5, out  # not the 30 s timeout


def _mixed_config(ctx):
    import torch.distributed as dist

    import pycomm

    x = torch.full((1000,), float(ctx.rank + 1))
    dist.all_reduce(x)
    n = ctx.world_size
    return {"ok": bool(torch.all(x == n * (n + 1) / 2)), "algorithm": pycomm.last_algorithm()}


def test_ranks_configured_tcp_and_auto_agree_on_tcp():
    """One rank with PYCOMM_TRANSPORT=tcp, one with auto: nobody waits for the
    other's host key; both run over TCP."""
    res = spawn_run(_mixed_config, 2, rank_env=[{"PYCOMM_TRANSPORT": "tcp"}, {"PYCOMM_TRANSPORT": "auto"}],
                    make_ref=False, timeout_s=90, pg_timeout_s=20).check()
    for rank, out in res.returns.items():
        assert out["ok"] and out["algorithm"] != "shm", (rank, out)


def test_forced_shm_names_the_rank_that_refuses_it():
    res = spawn_run(_mixed_config, 2, rank_env=[{"PYCOMM_TRANSPORT": "tcp"}, {"PYCOMM_TRANSPORT": "shm"}],
                    make_ref=False, timeout_s=90, pg_timeout_s=10)
    error = res.errors.get(1, "")
    assert "rank 0: PYCOMM_TRANSPORT=tcp" in error and "PYCOMM_TRANSPORT=shm" in error, res.failure_message()


def _creator_cannot_allocate(rank):
    """Rank 0 creates its host's arena; a 1 MiB file-size limit (with SIGXFSZ
    ignored) makes its ftruncate fail with EFBIG, as a full /dev/shm would."""
    import resource
    import signal

    if rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_arena_that_cannot_be_made(transport):
    """auto: every rank falls back to TCP together and the collectives still work;
    shm: every rank's init fails, naming the rank and the reason."""
    res = spawn_run(_mixed_config, 3, env={"PYCOMM_TRANSPORT": transport}, pre_init=_creator_cannot_allocate,
                    make_ref=False, timeout_s=90, pg_timeout_s=20)
    if transport == "auto":
        res.check()
        for rank, out in res.returns.items():
            assert out["ok"] and out["algorithm"] != "shm", (rank, out)
    else:
        assert sorted(res.errors) == [0, 1, 2], res.failure_message()
        for rank, error in res.errors.items():
            assert "rank 0" in error and "could not allocate" in error, (rank, error)


def test_segment_of_a_dead_creator_is_removed():
    """A creator killed between shm_open and its unlink leaves its segment; the next
    arena made on the host removes it. Only segments of this PID namespace whose
    creator is gone: a live creator's and another namespace's stay."""
    import subprocess
    import sys

    ns = os.stat("/proc/self/ns/pid").st_ino
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True).stdout.strip()
    names = {"dead": f"pycomm-{ns}-{dead}-00000000deadbeef",
             "live": f"pycomm-{ns}-{os.getpid()}-00000000000a11fe",
             "other_ns": f"pycomm-{ns + 1}-{dead}-0000000000000e15"}
    try:
        for name in names.values():
            fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.close(fd)
        spawn_run(_mixed_config, 2, env={"PYCOMM_TRANSPORT": "shm"}, make_ref=False,
                  timeout_s=90, pg_timeout_s=20).check()
        present = {key: os.path.exists(f"/dev/shm/{name}") for key, name in names.items()}
        assert present == {"dead": False, "live": True, "other_ns": True}, present
    finally:
        for name in names.values():
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_no_segment_left_in_dev_shm():
    """Covers every run above (and any earlier in the session): segments are
    unlinked as soon as every local rank mapped them. conftest.py checks again
    when the whole session ends."""
    from conftest import _dev_shm_leftovers

    assert _dev_shm_leftovers() == []


# Ranks that call a collective with different sizes (or dtypes, roots): the
# arena compares the call every step is posted with, so every rank of the call
# fails at once naming the other, instead of reading a peer's slot as if it
# matched (before: rank 0 of an all-reduce of 2088 vs 512 floats returned half
# reduced, without an error). name -> (members, per-rank call).
def _mismatch_allreduce(n, dtype=torch.float32):
    def call(group):
        import torch.distributed as dist

        t = torch.ones(n, dtype=dtype)
        dist.all_reduce(t, group=group)
        return t
    return call


def _mismatch_broadcast(n):
    def call(group):
        import torch.distributed as dist

        t = torch.ones(n)
        dist.broadcast(t, src=0, group=group)
        return t
    return call


def _mismatch_all_gather(n, members):
    def call(group):
        import torch.distributed as dist

        parts = [torch.empty(n) for _ in members]
        dist.all_gather(parts, torch.ones(n), group=group)
        return parts
    return call


SIZE_MISMATCHES = {
    # small vs small: the review's repro (whole-segment reduction, one step)
    "all_reduce 2088 vs 512": ([0, 1], {0: _mismatch_allreduce(2088), 1: _mismatch_allreduce(512)}),
    # one step against several (256 KiB slots, depth 4): the short call must not
    # finish while the long one waits
    "all_reduce 100 vs 200000": ([0, 1], {0: _mismatch_allreduce(100), 1: _mismatch_allreduce(200000)}),
    "all_reduce 300000 vs 70000": ([0, 1], {0: _mismatch_allreduce(300000), 1: _mismatch_allreduce(70000)}),
    # 3 ranks, split reduction: one rank differs
    "all_reduce 3 ranks 100000 vs 5000": ([0, 1, 2], {0: _mismatch_allreduce(100000), 1: _mismatch_allreduce(100000),
                                                      2: _mismatch_allreduce(5000)}),
    # the root reads nobody's slot; it must fail too
    "broadcast 2000 vs 500": ([0, 1], {0: _mismatch_broadcast(2000), 1: _mismatch_broadcast(500)}),
    "broadcast 3 ranks 100000 vs 70000": ([0, 1, 2], {0: _mismatch_broadcast(100000), 1: _mismatch_broadcast(70000),
                                                      2: _mismatch_broadcast(100000)}),
    "all_gather 1000 vs 3000": ([0, 1], {0: _mismatch_all_gather(1000, [0, 1]),
                                         1: _mismatch_all_gather(3000, [0, 1])}),
    # same bytes, other dtype
    "all_reduce float32 vs int32": ([0, 1], {0: _mismatch_allreduce(1000),
                                             1: _mismatch_allreduce(1000, torch.int32)}),
}


def _size_mismatches(ctx):
    import torch.distributed as dist

    out = {}
    for name, (members, calls) in SIZE_MISMATCHES.items():
        ctx.progress(name)
        group = dist.new_group(members)
        if ctx.rank not in members:
            continue
        rec = {}
        start = time.monotonic()
        try:
            calls[ctx.rank](group)
            rec["error"] = None
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["seconds"] = time.monotonic() - start
        # As after any failed collective, the group refuses later calls.
        try:
            dist.all_reduce(torch.ones(10), group=group)
            rec["after"] = None
        except Exception as e:  # noqa: BLE001
            rec["after"] = f"{type(e).__name__}: {e}"
        out[name] = rec
    ctx.progress("the default group after the failed subgroups")
    x = torch.ones(1000)
    dist.all_reduce(x)
    out["_default_ok"] = bool(torch.all(x == ctx.world_size))
    return out


def test_ranks_with_different_sizes_all_fail_at_once():
    res = spawn_run(_size_mismatches, 3, env={"PYCOMM_TRANSPORT": "shm"}, make_ref=False,
                    timeout_s=150, pg_timeout_s=30).check()
    for name, (members, calls) in SIZE_MISMATCHES.items():
        for rank in members:
            rec = res.returns[rank][name]
            err = rec["error"]
            assert err is not None, f"{name}: rank {rank} returned without an error"
            assert "(shm)" in err and ("were expected (tensor sizes differ between ranks?)" in err
                                       or "was expected (dtypes differ between ranks?)" in err), \
                f"{name}: rank {rank}: {err}"
            assert "DistBackendError" in err, f"{name}: rank {rank}: {err}"
            assert rec["seconds"] < 10, f"{name}: rank {rank} took {rec['seconds']:.1f} s (timeout 30 s)"
            assert rec["after"] is not None, f"{name}: rank {rank}: the failed group still ran a collective"
    # Each rank names a peer whose call differs from its own.
    err = res.returns[0]["all_reduce 2088 vs 512"]["error"]
    assert "rank 1 called with 2048 bytes where 8352 were expected" in err, err
    err = res.returns[1]["all_reduce 2088 vs 512"]["error"]
    assert "rank 0 called with 8352 bytes where 2048 were expected" in err, err
    # With 3 ranks a rank may hear of the mismatch from another's abort first
    # ("rank 1 aborted the group: rank 1 ... rank 2 called with 20000 bytes ...").
    err = res.returns[2]["all_reduce 3 ranks 100000 vs 5000"]["error"]
    assert "400000 bytes" in err and "20000" in err, err
    err = res.returns[1]["all_reduce float32 vs int32"]["error"]
    assert "rank 0 called with float32 where int32 was expected" in err, err
    for rank in range(3):
        assert res.returns[rank]["_default_ok"], f"rank {rank}: the default group was hurt"
