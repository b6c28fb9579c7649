"""Observability (issue #12): torch.profiler events, the flight recorder and the
verdict it adds to a timeout, and pycomm.comm_summary(); over shared memory and TCP."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run

TRANSPORTS = ["shm", "tcp"]


def _seq():
    return dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def _observe_worker(ctx):
    import pycomm

    out = {}
    dist.barrier()
    # torch.profiler: one blocking and one async all-reduce, a broadcast.
    t = torch.ones(1024)  # 4096 B
    out["expected_allreduce"] = pycomm.select_algorithm(t.nbytes)
    # torch writes keyword inputs into the trace with record_shapes=True (as input shapes).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.all_reduce(torch.ones(8, dtype=torch.float64), async_op=True).wait()
        dist.broadcast(torch.arange(10), src=0)
    path = os.path.join(ctx.tmpdir, f"trace{ctx.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out["trace"] = [e for e in events if str(e.get("name", "")).startswith("pycomm:")]

    # The flight recorder: the calls above, then enough to wrap the ring.
    out["recorder"] = pycomm.flight_recorder()
    first = _seq()
    for _ in range(300):
        dist.barrier()
    out["wrapped"] = (first, pycomm.flight_recorder())

    # A non-contiguous tensor goes through the strided seam: still one event per call
    # (its Work once began an "allreduce" event of c10d::Work's that nothing ended).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(8, 4).t(), async_op=True).wait()
        dist.all_reduce(torch.ones(8, 4).t())
    out["strided_events"] = sorted(e.name for e in prof.events() if e.name in ("allreduce", "pycomm:allreduce"))

    # comm_summary: known calls after a reset.
    pycomm.reset_stats()
    for _ in range(3):
        dist.all_reduce(torch.ones(1024))       # 4096 B: bucket [4K, 8K)
    for _ in range(2):
        dist.all_reduce(torch.ones(100))        # 400 B: bucket [256, 512)
    out_t = torch.empty(2 * 1000, dtype=torch.float64)
    dist.all_gather_into_tensor(out_t, torch.ones(1000, dtype=torch.float64))  # 16000 B output
    dist.barrier()
    summary = pycomm.comm_summary()
    out["summary"] = (summary.rows, str(summary))
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_profiler_recorder_and_summary(transport):
    rets = spawn_run(_observe_worker, 2, make_ref=False, timeout_s=120, pg_timeout_s=30,
                     env={"PYCOMM_TRANSPORT": transport}).check().returns
    for rank in range(2):
        out = rets[rank]
        shm = transport == "shm"
        # ---- profiler: the events carry op, bytes, dtype and the algorithm
        by_name = {}
        for e in out["trace"]:
            by_name.setdefault(e["name"], []).append(e)
        assert set(by_name) == {"pycomm:allreduce", "pycomm:broadcast"}, sorted(by_name)
        ar = sorted(by_name["pycomm:allreduce"], key=lambda e: e["args"]["seq"])
        assert len(ar) == 2, ar
        args = ar[0]["args"]
        assert (args["op"], args["bytes"], args["dtype"], args["group_size"]) == ("allreduce", 4096, "float32", 2), args
        assert args["algorithm"] == ("shm" if shm else out["expected_allreduce"]), args
        assert (ar[1]["args"]["bytes"], ar[1]["args"]["dtype"], ar[1]["args"]["async_op"]) == (64, "float64", True)
        bc = by_name["pycomm:broadcast"][0]["args"]
        assert (bc["bytes"], bc["dtype"], bc["algorithm"]) == (80, "int64", "shm" if shm else "tree"), bc

        # ---- flight recorder: the same calls, with what ran and when
        rec = out["recorder"]
        last = rec[-3:]
        assert [c["op"] for c in last] == ["allreduce", "allreduce", "broadcast"], rec
        assert [c["bytes"] for c in last] == [4096, 64, 80]
        assert [c["dtype"] for c in last] == ["float32", "float64", "int64"]
        assert all(c["state"] == "completed" for c in rec), rec
        assert [c["seq"] for c in last] == [args["seq"], args["seq"] + 1, args["seq"] + 2]
        # the algorithm the profiler announced is the one that ran
        assert last[0]["algorithm"] == args["algorithm"] and last[2]["algorithm"] == bc["algorithm"]
        for c in last:
            assert c["time_queued"] <= c["time_started"] <= c["time_ended"], c
        first, wrapped = out["wrapped"]
        assert len(wrapped) == 256  # a fixed ring
        assert [c["seq"] for c in wrapped] == list(range(first + 300 - 256, first + 300))
        assert all(c["op"] == "barrier" for c in wrapped)
        assert out["strided_events"] == ["pycomm:allreduce"] * 2, out["strided_events"]

        # ---- comm_summary: counts and bytes per op and size bucket
        rows, text = out["summary"]
        table = {(r["op"], r["bucket_lo"], r["bucket_hi"]): r for r in rows}
        assert set(table) == {("allreduce", 4096, 8192), ("allreduce", 256, 512),
                              ("allgather_into_tensor", 16384 // 2, 16384), ("barrier", 0, 1)}, sorted(table)
        big, small = table[("allreduce", 4096, 8192)], table[("allreduce", 256, 512)]
        assert (big["count"], big["bytes"], small["count"], small["bytes"]) == (3, 3 * 4096, 2, 800)
        ag = table[("allgather_into_tensor", 8192, 16384)]
        assert (ag["count"], ag["bytes"], ag["group_size"]) == (1, 16000, 2)
        assert big["mean_s"] > 0 and big["busbw_gbps"] == pytest.approx(big["algbw_gbps"] * 1.0)  # 2(n-1)/n = 1
        assert ag["busbw_gbps"] == pytest.approx(ag["algbw_gbps"] * 0.5)
        assert table[("barrier", 0, 1)]["busbw_gbps"] is None
        assert "allreduce" in text and "[4K,8K)" in text and "busbw" in text.splitlines()[0]


def _skip_worker(ctx, skipper):
    import pycomm

    dist.all_reduce(torch.ones(16))
    seq = _seq()
    error = None
    if ctx.rank == skipper:
        time.sleep(ctx.pg_timeout_s + 2.5)  # skips the call; stays alive until the others gave up
    else:
        try:
            dist.all_reduce(torch.ones(256))
        except Exception as e:  # noqa: BLE001 (the message is the result)
            error = str(e)
    return {"seq": seq, "error": error, "recorder": pycomm.flight_recorder()}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_names_the_rank_behind_and_the_call(transport):
    world, skipper = 3, 1
    res = spawn_run(_skip_worker, world, args=(skipper,), make_ref=False, timeout_s=90, pg_timeout_s=2,
                    env={"PYCOMM_TRANSPORT": transport}).check()
    rets = res.returns
    seq = rets[0]["seq"]
    assert all(rets[r]["seq"] == seq for r in range(world))
    # A rank times out itself, or hears of a peer's timeout first ("rank 0 aborted the
    # group: rank 0: Timed out ..."): only the former compares progress.
    timed_out = [r for r in range(world) if r != skipper and "Timed out" in (rets[r]["error"] or "")
                 and "aborted the group" not in rets[r]["error"]]
    assert timed_out, {r: rets[r]["error"] for r in range(world)}
    for r in range(world):
        if r == skipper:
            assert rets[r]["error"] is None
            continue
        error = rets[r]["error"]
        assert error, f"rank {r} did not fail"
        if r in timed_out:
            # the verdict: who is behind, at which call, and who got there
            assert f"flight recorder: rank {skipper} is behind: never reached call #{seq} (allreduce float32 1024 B)" \
                in error, error
            others = ", ".join(f"rank {o}" for o in range(world) if o != skipper)
            assert f"at call #{seq}: {others}" in error, error
        last = rets[r]["recorder"][-1]
        assert (last["seq"], last["op"], last["state"], last["bytes"]) == (seq, "allreduce", "failed", 1024), last
    # the skipping rank's ring ends with the call before
    assert rets[skipper]["recorder"][-1]["seq"] == seq - 1
