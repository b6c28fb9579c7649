"""Error behaviour of the backend (multi-process, see mp_util.py).

* Usage errors raise ValueError (or TypeError) at the call itself (tested
  with async_op=True, so an error only reported by work.wait() is caught as
  wrong), with a message starting "pycomm <op>:", and leave the group usable.
* Runtime failures (a peer that never joins the collective, a peer that
  disappears) raise from work.wait() / the blocking call within the group
  timeout plus a few seconds, and nothing hangs (hard harness timeout).
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run

BACKEND = "pycomm"
WORLD = 2


def _a2a_bad_splits():
    # input has 4 elements but the splits add up to 5
    return dist.all_to_all_single(torch.zeros(4), torch.ones(4), [2, 2], [2, 3], async_op=True)


def _direct_allreduce_complex():
    # dist.all_reduce views complex tensors as real before the backend sees
    # them, so the backend's own dtype check is reached through the
    # ProcessGroup API directly.
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return dist.distributed_c10d._get_default_group().allreduce([torch.ones(4, dtype=torch.complex64)], opts)


# name -> (family of the op name expected after "pycomm ", the call); every
# case is symmetric (all ranks make the same bad call), so none can hang.
CASES = {
    # (non-contiguous tensors are taken, through contiguous copies: test_collectives.py;
    # an output whose elements share memory cannot take the result back)
    "all_reduce on an expand()ed tensor": (
        "allreduce", lambda: dist.all_reduce(torch.ones(1, 4).expand(4, 4), async_op=True)),
    # sparse tensors: all_reduce takes them with SUM/AVG (tests/algorithms/test_sparse_allreduce.py)
    "all_reduce sparse MAX": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4).to_sparse(), op=dist.ReduceOp.MAX, async_op=True)),
    "all_reduce BAND float32": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, async_op=True)),
    "all_reduce BOR bfloat16": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bfloat16), op=dist.ReduceOp.BOR,
                                             async_op=True)),
    "all_reduce BXOR float64": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64), op=dist.ReduceOp.BXOR,
                                             async_op=True)),
    "all_reduce AVG int32": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG,
                                             async_op=True)),
    "all_reduce AVG uint8": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint8), op=dist.ReduceOp.AVG,
                                             async_op=True)),
    "all_reduce AVG bool": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=dist.ReduceOp.AVG,
                                             async_op=True)),
    "all_reduce unsupported dtype uint16": (
        "allreduce", lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16), async_op=True)),
    "all_reduce unsupported dtype complex64 (ProcessGroup API)": ("allreduce", _direct_allreduce_complex),
    # (complex SUM / AVG are reduced as (re, im) pairs: tests/kernels/test_dtype_parity.py)
    "reduce_scatter_tensor complex64 MAX": (
        "reducescatter", lambda: dist.reduce_scatter_tensor(torch.zeros(4, dtype=torch.complex64),
                                                           torch.ones(4 * WORLD, dtype=torch.complex64),
                                                           op=dist.ReduceOp.MAX, async_op=True)),
    "broadcast into an expand()ed tensor": (
        "broadcast", lambda: dist.broadcast(torch.ones(4, 1).expand(4, 4), src=0, async_op=True)),
    "all_gather output list with a wrong-size tensor": (
        "allgather", lambda: dist.all_gather([torch.zeros(5), torch.zeros(6)], torch.ones(5), async_op=True)),
    # (a wrong output dtype is rejected by torch's Python layer before any backend sees it)
    "all_gather output list of the wrong length": (
        "allgather", lambda: dist.all_gather([torch.zeros(5) for _ in range(WORLD + 1)], torch.ones(5),
                                             async_op=True)),
    "all_gather_into_tensor wrong output size": (
        "allgather", lambda: dist.all_gather_into_tensor(torch.zeros(WORLD * 5 + 1), torch.ones(5), async_op=True)),
    "reduce_scatter_tensor wrong input size": (
        "reducescatter", lambda: dist.reduce_scatter_tensor(torch.zeros(5), torch.ones(WORLD * 5 + 1),
                                                           async_op=True)),
    # (the others' shares may differ in size, as on gloo: only a rank's own is checked)
    "reduce_scatter input list whose own share is the wrong size": (
        "reducescatter", lambda: dist.reduce_scatter(torch.zeros(5), [torch.ones(7), torch.ones(7)],
                                                     async_op=True)),
    "all_to_all_single splits do not match the tensor": ("alltoall", _a2a_bad_splits),
}


def _op_name_ok(msg: str, family: str) -> bool:
    m = re.match(r"pycomm ([A-Za-z_]+)(?: \([^)]*\))?:", msg.strip())
    return bool(m) and m.group(1).replace("_", "").lower().startswith(family)


def usage_errors_worker(ctx):
    out = {}  # per-case results go through ctx.report
    for name, (family, call) in CASES.items():
        ctx.progress(name)
        rec = {"family": family}
        try:
            work = call()
            rec["at_call"] = None
        except Exception as e:  # noqa: BLE001
            rec["at_call"] = (type(e).__name__, isinstance(e, (ValueError, TypeError)), str(e).strip())
            work = None
        if work is not None:
            try:
                work.wait()
                rec["at_wait"] = None
            except Exception as e:  # noqa: BLE001
                rec["at_wait"] = (type(e).__name__, str(e).strip()[:300])
        ctx.report(name, rec)  # survives a later crash
    # usage errors must not break the group
    ctx.progress("all_reduce after the usage errors")
    try:
        t = torch.full((1001,), float(ctx.rank + 1))
        dist.all_reduce(t)
        expected = WORLD * (WORLD + 1) / 2
        out["_usable"] = None if bool((t == expected).all()) else f"wrong result {t[:4].tolist()}, expected {expected}"
    except Exception as e:  # noqa: BLE001
        out["_usable"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    return out


@pytest.fixture(scope="module")
def usage_results():
    return spawn_run(usage_errors_worker, WORLD, backend=BACKEND, timeout_s=120, pg_timeout_s=20, make_ref=False)


@pytest.mark.parametrize("case", list(CASES))
def test_usage_error_raises_at_call(usage_results, case):
    for rank in range(WORLD):
        rec = usage_results.reports.get(rank, {}).get(case)
        if rec is None:
            pytest.fail(f"rank {rank}: case not reached:\n{usage_results.failure_message()}", pytrace=False)
        at_call = rec["at_call"]
        if at_call is None:
            later = f"; work.wait() then raised {rec['at_wait']}" if rec.get("at_wait") else \
                "; the call and work.wait() both succeeded"
            pytest.fail(f"rank {rank}: {case}: no exception at the call{later}", pytrace=False)
        tname, is_value_or_type, msg = at_call
        assert is_value_or_type, f"rank {rank}: {case}: raised {tname} (want ValueError or TypeError): {msg!r}"
        assert _op_name_ok(msg, rec["family"]), (
            f"rank {rank}: {case}: message should start with 'pycomm {rec['family']}...:', got {msg[:300]!r}")


def test_group_usable_after_usage_errors(usage_results):
    usage_results.check()
    for rank in range(WORLD):
        assert usage_results.returns[rank]["_usable"] is None, \
            f"rank {rank}: all_reduce after the usage errors: {usage_results.returns[rank]['_usable']}"


# ---------------------------------------------------------------- runtime ---

PG_TIMEOUT_S = 3.0
SLACK_S = 5.0


def _signal(ctx, name):
    open(os.path.join(ctx.tmpdir, name), "w").close()


def _wait_signal(ctx, name, limit_s):
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not os.path.exists(os.path.join(ctx.tmpdir, name)):
        time.sleep(0.05)


def _describe(e):
    return {"type": type(e).__name__, "is_dist_backend_error": isinstance(e, dist.DistBackendError),
            "is_runtime_error": isinstance(e, RuntimeError), "msg": str(e).strip()[:500]}


def timeout_worker(ctx):
    """Rank 1 stays alive but never joins the all_reduce, nor sends what rank 0 receives."""
    g2 = dist.new_group([0, 1], timeout=ctx.timeout())  # a second group, still healthy for the recv test
    if ctx.rank == 1:
        _wait_signal(ctx, "rank0_done", 60)
        return None
    out = {}
    t = torch.ones(1000)
    t0 = time.monotonic()
    out["first_where"] = "call"
    try:
        ctx.progress("all_reduce that rank 1 never joins")
        work = dist.all_reduce(t, async_op=True)
        out["first_where"] = "work.wait()"
        work.wait()
        out["first"] = None
    except Exception as e:  # noqa: BLE001
        out["first"] = _describe(e)
    out["first_s"] = time.monotonic() - t0
    # after a runtime failure the group must fail again (not hang, not succeed)
    t0 = time.monotonic()
    try:
        ctx.progress("second all_reduce after the timeout")
        work = dist.all_reduce(torch.ones(10), async_op=True)
        work.wait()
        out["second"] = None
    except Exception as e:  # noqa: BLE001
        out["second"] = _describe(e)
    out["second_s"] = time.monotonic() - t0
    # a recv whose sender never sends, on the other group
    t0 = time.monotonic()
    try:
        ctx.progress("recv from rank 1, which never sends")
        dist.recv(torch.zeros(10), src=1, group=g2)
        out["recv"] = None
    except Exception as e:  # noqa: BLE001
        out["recv"] = _describe(e)
    out["recv_s"] = time.monotonic() - t0
    _signal(ctx, "rank0_done")
    return out


@pytest.fixture(scope="module")
def timeout_run():
    return spawn_run(timeout_worker, 2, backend=BACKEND, pg_timeout_s=PG_TIMEOUT_S, make_ref=False, timeout_s=90)


def test_timeout_when_peer_never_joins(timeout_run):
    out = timeout_run.check().returns[0]
    first = out["first"]
    assert first is not None, f"all_reduce returned normally after {out['first_s']:.1f} s although rank 1 never joined"
    assert first["is_runtime_error"], f"raised {first['type']} (want DistBackendError/RuntimeError): {first['msg']!r}"
    assert out["first_where"] == "work.wait()", f"raised at the call, not from work.wait(): {first['msg']!r}"
    assert out["first_s"] <= PG_TIMEOUT_S + SLACK_S, \
        f"took {out['first_s']:.1f} s to fail; the group timeout is {PG_TIMEOUT_S} s"
    assert out["first_s"] >= PG_TIMEOUT_S * 0.8, \
        f"failed after {out['first_s']:.2f} s, before the {PG_TIMEOUT_S} s timeout: {first['msg']!r}"
    assert re.search(r"time[ds]?[ -]?out", first["msg"], re.I), f"message does not mention the timeout: {first['msg']!r}"
    assert "rank 1" in first["msg"], f"message does not name the silent peer (rank 1): {first['msg']!r}"
    second = out["second"]
    assert second is not None, "a collective on the group after its timeout succeeded (rank 1 never joined)"
    assert second["is_runtime_error"], f"second call raised {second['type']}: {second['msg']!r}"
    assert out["second_s"] <= PG_TIMEOUT_S + SLACK_S, f"second call took {out['second_s']:.1f} s to fail"


def test_recv_timeout_when_peer_never_sends(timeout_run):
    out = timeout_run.check().returns[0]
    err = out["recv"]
    assert err is not None, f"recv returned after {out['recv_s']:.1f} s although rank 1 never sent"
    assert err["is_runtime_error"], f"raised {err['type']} (want DistBackendError/RuntimeError): {err['msg']!r}"
    assert PG_TIMEOUT_S * 0.8 <= out["recv_s"] <= PG_TIMEOUT_S + SLACK_S, \
        f"recv failed after {out['recv_s']:.1f} s; the group timeout is {PG_TIMEOUT_S} s: {err['msg']!r}"
    assert re.search(r"time[ds]?[ -]?out", err["msg"], re.I), f"message does not mention the timeout: {err['msg']!r}"
    assert "rank 1" in err["msg"], f"message does not name the silent peer (rank 1): {err['msg']!r}"
    assert not re.match(r"\s*(pycomm [\w ()]+:)\s*\1", err["msg"]), f"message repeats its prefix: {err['msg']!r}"


def lost_peer_worker(ctx):
    """Rank 1 leaves abruptly (os._exit) while rank 0 runs collectives."""
    dist.barrier()
    if ctx.rank == 1:
        ctx.abrupt_exit(None)
    time.sleep(0.5)
    t0 = time.monotonic()
    out = {}
    try:
        ctx.progress("all_reduce with rank 1 gone")
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        out["where"] = "wait"
        work.wait()
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = _describe(e)
    out["seconds"] = time.monotonic() - t0
    return out


def test_lost_peer_raises():
    timeout = 10.0
    res = spawn_run(lost_peer_worker, 2, backend=BACKEND, pg_timeout_s=timeout, make_ref=False, timeout_s=90)
    res.check()
    out = res.returns[0]
    err = out["error"]
    assert err is not None, "all_reduce succeeded although rank 1 had exited"
    assert err["is_runtime_error"], f"raised {err['type']} (want DistBackendError/RuntimeError): {err['msg']!r}"
    assert out["seconds"] <= timeout + SLACK_S, f"took {out['seconds']:.1f} s to notice the lost peer"
    assert "rank 1" in err["msg"], f"message does not name the lost peer (rank 1): {err['msg']!r}"


# ------------------------------------------------- all_to_all_single splits ---
# Split sizes are rows per rank. Bad ones must raise ValueError at the call
# ("pycomm alltoall_base: ..."), on every transport, before anything is sent or
# written: sums that wrap around int64 once passed the old check and sent
# (TCP: read) or wrote (the self block) outside the tensors (issue #13).
A2A_WORLD = 3
INT64_MAX = 2**63 - 1


def _wrapping_splits(rank):
    """Three non-negative splits summing to 2**64 + 4 (4 once wrapped), whose
    block for `rank` is 1 + 2**62 rows: 4 bytes of float32 once the product
    wraps, so the old self-block check (this rank sends itself 4 bytes) passed.
    On rank 1 the old code put the self block 4 bytes before the output."""
    others = [INT64_MAX, 2**62 + 4]
    return [1 + 2**62 if i == rank else others.pop(0) for i in range(A2A_WORLD)]


def _a2a(out_rows, in_rows, out_splits, in_splits):
    return dist.all_to_all_single(torch.zeros(out_rows), torch.ones(in_rows), out_splits, in_splits,
                                  async_op=True)


# name -> rank -> the call; every rank makes a bad call, so none can hang.
A2A_CASES = {
    "negative output split": lambda r: _a2a(3, 3, [-1, 2, 2], [1, 1, 1]),
    "negative input split": lambda r: _a2a(3, 3, [1, 1, 1], [2, 2, -1]),
    "output split larger than the tensor": lambda r: _a2a(3, 3, [INT64_MAX, 0, 0], [1, 1, 1]),
    "input splits summing past int64": lambda r: _a2a(3, 3, [1, 1, 1], [INT64_MAX, INT64_MAX, INT64_MAX]),
    "output splits wrapping to the row count": lambda r: _a2a(4, 3, _wrapping_splits(r), [1, 1, 1]),
    "input splits wrapping to the row count": lambda r: _a2a(3, 4, [1, 1, 1], _wrapping_splits(r)),
    "2-D output splits wrapping to the row count": lambda r: dist.all_to_all_single(
        torch.zeros(4, 3), torch.ones(3, 3), _wrapping_splits(r), [1, 1, 1], async_op=True),
    "too few splits": lambda r: _a2a(3, 3, [1, 2], [1, 1, 1]),
}


def alltoall_splits_worker(ctx):
    for name, call in A2A_CASES.items():
        ctx.progress(name)
        rec = {}
        try:
            work = call(ctx.rank)
            rec["at_call"] = None
            try:
                work.wait()
                rec["at_wait"] = None
            except Exception as e:  # noqa: BLE001
                rec["at_wait"] = _describe(e)
        except Exception as e:  # noqa: BLE001
            rec["at_call"] = _describe(e)
        ctx.report(name, rec)
    ctx.progress("all_to_all_single after the usage errors")
    out = torch.zeros(3)
    dist.all_to_all_single(out, torch.full((3,), float(ctx.rank)))
    ctx.report("_usable", out.tolist())
    # Locally valid splits that disagree between ranks: rank 0 sends rank 1 two
    # rows where it expects one, and rank 2 none. A runtime failure naming rank 0
    # on the receivers, never a write past what this rank said it receives.
    # Rank r's rows hold 100 + 10 r + row.
    ctx.progress("splits that disagree between ranks")
    out = torch.full((3,), -1.0)
    try:
        dist.all_to_all_single(out, 100 + 10 * ctx.rank + torch.arange(3.0), [1, 1, 1],
                               [1, 2, 0] if ctx.rank == 0 else [1, 1, 1])
        ctx.report("_disagree", None)
    except Exception as e:  # noqa: BLE001
        ctx.report("_disagree", _describe(e))
    ctx.report("_disagree_out", out.tolist())
    return None


@pytest.fixture(scope="module", params=["tcp", "shm"])
def alltoall_splits_run(request):
    return spawn_run(alltoall_splits_worker, A2A_WORLD, backend=BACKEND, timeout_s=120, pg_timeout_s=10,
                     make_ref=False, env={"PYCOMM_TRANSPORT": request.param})


@pytest.mark.parametrize("case", list(A2A_CASES))
def test_alltoall_bad_splits_raise_at_call(alltoall_splits_run, case):
    res = alltoall_splits_run
    for rank in range(A2A_WORLD):
        rec = res.reports.get(rank, {}).get(case)
        if rec is None:
            pytest.fail(f"rank {rank}: case not reached:\n{res.failure_message()}", pytrace=False)
        err = rec["at_call"]
        if err is None:
            later = f"; work.wait() then raised {rec['at_wait']}" if rec["at_wait"] else \
                "; the call and work.wait() both succeeded"
            pytest.fail(f"rank {rank}: {case}: no exception at the call{later}", pytrace=False)
        assert err["type"] == "ValueError", f"rank {rank}: {case}: raised {err['type']}: {err['msg']!r}"
        assert err["msg"].startswith("pycomm alltoall_base:") and "split" in err["msg"], \
            f"rank {rank}: {case}: {err['msg']!r}"


def test_alltoall_splits_that_disagree_between_ranks(alltoall_splits_run):
    res = alltoall_splits_run
    for rank in range(A2A_WORLD):
        assert res.reports.get(rank, {}).get("_usable") == [0.0, 1.0, 2.0], \
            f"rank {rank}: all_to_all_single after the usage errors:\n{res.failure_message()}"
    for rank in (1, 2):
        err = res.reports[rank].get("_disagree")
        assert err is not None, f"rank {rank} received a block of the wrong size without an error"
        assert err["is_runtime_error"] and "rank 0" in err["msg"], f"rank {rank}: {err}"
        # nothing of rank 0's wrong-size block lands anywhere in the output
        out = res.reports[rank]["_disagree_out"]
        assert not any(100 <= v < 110 for v in out), f"rank {rank}: output {out} holds rows of rank 0"
    res.check()  # no crash, no hang


def _rs_disagree_worker(ctx):
    # Locally valid calls that disagree on rank 1's share: rank 0 says 2 elements,
    # rank 1 says 3 (both agree on rank 0's, 1 element). Rank k contributes k + 1.
    # A rank fails with a runtime error naming the size mismatch, or returns the
    # right sum for its share; never a wrong result, never a hang.
    out = torch.full((1,) if ctx.rank == 0 else (3,), -1.0)
    shares = [torch.full((1,), ctx.rank + 1.0), torch.full((2,) if ctx.rank == 0 else (3,), ctx.rank + 1.0)]
    start = time.monotonic()
    try:
        dist.reduce_scatter(out, shares)
        error = None
    except Exception as e:  # noqa: BLE001
        error = _describe(e)
    return {"error": error, "out": out.tolist(), "seconds": time.monotonic() - start}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_reduce_scatter_shares_that_disagree_between_ranks(transport):
    res = spawn_run(_rs_disagree_worker, 2, backend=BACKEND, timeout_s=120, pg_timeout_s=10, make_ref=False,
                    env={"PYCOMM_TRANSPORT": transport}).check()
    failed = [r for r in (0, 1) if res.returns[r]["error"] is not None]
    assert 1 in failed, res.returns  # rank 1's share is the one in dispute
    for rank in (0, 1):
        got = res.returns[rank]
        if got["error"] is None:
            assert got["out"] == [3.0], (rank, got)  # both ranks agreed on rank 0's share
        else:
            assert got["error"]["is_runtime_error"], (rank, got)
            assert "tensor sizes differ between ranks" in got["error"]["msg"], (rank, got)
        assert got["seconds"] < 5, (rank, got)  # found at once, not at the 10 s timeout
