"""Timeouts in gloo's words, which torch's tests and users' tools match: a barrier that
times out says " Timed out " (torch's DistributedTest matches " (Timed out|closed|timeout) "),
and a monitored barrier whose rank 0 is out of time before it waits on a rank that has
not arrived says "Rank 0 timed out in monitoredBarrier after N ms." and the ranks it
processed. Each check runs on gloo too, with the same assertion."""
import datetime
import re
import time

import pytest

from mp_util import spawn_run

# torch/testing/_internal/distributed/distributed_test.py, _test_barrier_timeout
BARRIER_TIMEOUT = re.compile(" (Timed out|closed|timeout) ")


def _barrier_alone(ctx):
    import torch.distributed as dist

    if ctx.rank != 0:
        ctx.wait_done(0, limit_s=60)  # in the group, never in the barrier
        return None
    start = time.monotonic()
    try:
        dist.barrier()
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    ctx.mark_done()
    return {"error": error, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_barrier_timeout_says_timed_out(backend):
    res = spawn_run(_barrier_alone, 2, backend=backend, make_ref=False, pg_timeout_s=2, timeout_s=90).check()
    zero = res.returns[0]
    assert zero["error"] is not None and BARRIER_TIMEOUT.search(zero["error"]), zero
    assert zero["seconds"] >= 1.9, zero
    if backend == "pycomm":
        assert "pycomm barrier" in zero["error"] and "rank 0: Timed out after 2.0 s waiting for rank 1" \
            in zero["error"], zero


def _monitored_rank0_out_of_time(ctx, arrivals):
    import torch.distributed as dist

    group = dist.group.WORLD
    if ctx.rank != 0:
        # gloo's init_process_group can return on rank 0 while a peer is still connecting its
        # mesh; rank 0 out of time at once and closing its group then fails that peer's init
        ctx.mark_done("ready")
    if ctx.rank in arrivals:
        # arrives, then waits long for rank 0's verdict
        ctx.mark_done("arriving")
        try:
            group.monitored_barrier(datetime.timedelta(seconds=20))
        except Exception:  # noqa: BLE001  (rank 0 failed the barrier: expected)
            pass
        return None
    if ctx.rank != 0:
        ctx.wait_done(0, limit_s=60)
        return None
    for rank in range(1, ctx.world_size):
        ctx.wait_done(rank, limit_s=60, tag="ready")
    for rank in arrivals:
        ctx.wait_done(rank, limit_s=60, tag="arriving")
    time.sleep(1.0 if arrivals else 0)  # their messages reach rank 0 first
    try:
        group.monitored_barrier(datetime.timedelta(seconds=0))  # as torch's test: no time at all
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    ctx.mark_done()
    return error


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_monitored_barrier_rank0_out_of_time(backend):
    res = spawn_run(_monitored_rank0_out_of_time, 2, backend=backend, args=((),), make_ref=False,
                    timeout_s=90).check()
    error = res.returns[0]
    assert error is not None and (
        "Rank 0 timed out in monitoredBarrier after 0 ms.\nNo ranks successfully processed in monitoredBarrier."
        in error), error


def test_monitored_barrier_rank0_out_of_time_names_the_ranks_it_processed():
    """Rank 1 arrived before rank 0 came to it, rank 2 never does: rank 0, out of time,
    lists rank 1 as processed (gloo stops before looking at rank 1 when out of time, so
    its list would be empty here)."""
    res = spawn_run(_monitored_rank0_out_of_time, 3, args=((1,),), make_ref=False, timeout_s=90).check()
    error = res.returns[0]
    assert error is not None and (
        "Rank 0 timed out in monitoredBarrier after 0 ms.\nSuccessfully processed ranks: 1" in error), error
