"""tests/mp_util.py's pool of ranks: a pooled run gives what a fresh one gives, runs on the
same processes as the run of its world size before it when that one ended cleanly, and on
fresh ones after a run that hung, crashed, raised, left a rank gone or a thread behind."""
from __future__ import annotations

import os
import signal
import threading
import time
import pytest
import torch
import torch.distributed as dist

import mp_util
from mp_util import spawn_run

pytestmark = pytest.mark.skipif(mp_util.START_METHOD != "forkserver",
                                reason="the pool serves fork-server runs (PYCOMM_TEST_START_METHOD=spawn)")


@pytest.fixture
def own_key(monkeypatch):
    """The pool on, and empty before and after the test."""
    monkeypatch.setattr(mp_util, "POOL", True)
    mp_util.close_pool()
    yield
    mp_util.close_pool()


def _observe(ctx, tag):
    t = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(t)
    ref = torch.full((2,), float(ctx.rank))
    dist.all_reduce(ref, group=ctx.ref)
    return {"pid": os.getpid(), "sum": t.tolist(), "ref": ref.tolist(), "tag": tag,
            "rank": dist.get_rank(), "world": dist.get_world_size(), "env": os.environ.get("PYCOMM_TEST_POOL_ENV"),
            "randn": torch.randn(3).tolist(), "dtype": str(torch.get_default_dtype()),
            "threads": torch.get_num_threads(), "cwd": os.getcwd(), "tmpdir_files": sorted(os.listdir(ctx.tmpdir)),
            "cpus": sorted(os.sched_getaffinity(0))}


def _pids(res):
    return [res.returns[r]["pid"] for r in range(res.world_size)]


def _without_pid(res):
    return [{k: v for k, v in res.returns[r].items() if k not in ("pid",)} for r in range(res.world_size)]


def _run(fn, world=2, **kwargs):
    kwargs.setdefault("timeout_s", 60)
    kwargs.setdefault("pg_timeout_s", 20)
    return spawn_run(fn, world, **kwargs)


def _litter(ctx):
    """Changes what a later case would see if the pool did not restore it."""
    os.environ["PYCOMM_TEST_POOL_ENV"] = "left by the case before"
    torch.manual_seed(1234)
    torch.randn(5)
    torch.set_default_dtype(torch.float64)
    os.chdir(ctx.tmpdir)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return os.getpid()


@pytest.mark.parametrize("world", [2, 3])
def test_pooled_runs_reuse_ranks_and_match_fresh_ones(own_key, monkeypatch, world):
    first = _run(_observe, world, args=("a",), env={"PYCOMM_TEST_POOL_ENV": "x"}).check()
    litter = _run(_litter, world, env={"PYCOMM_TEST_POOL_ENV": "x"}).check()
    second = _run(_observe, world, args=("a",), env={"PYCOMM_TEST_POOL_ENV": "x"}).check()
    assert [litter.returns[r] for r in range(world)] == _pids(first), "the ranks were not reused"
    assert _pids(second) == _pids(first), "the ranks were not reused"
    assert len(set(_pids(first))) == world
    monkeypatch.setattr(mp_util, "POOL", False)
    fresh = _run(_observe, world, args=("a",), env={"PYCOMM_TEST_POOL_ENV": "x"}).check()
    assert not set(_pids(fresh)) & set(_pids(first))
    assert _without_pid(first) == _without_pid(fresh) == _without_pid(second)
    assert first.returns[0]["sum"] == [float(sum(range(1, world + 1)))] * 4
    assert first.returns[0]["env"] == "x"


def _backend(ctx):
    return {"pid": os.getpid(), "backend": dist.get_backend(), "ref": ctx.ref is not None,
            "env": os.environ.get("PYCOMM_TEST_POOL_ENV"), "rank_env": os.environ.get("PYCOMM_TEST_POOL_RANK"),
            "init": os.environ.get("MASTER_PORT") is not None}


def test_runs_of_one_world_size_share_ranks_whatever_they_ask(own_key):
    """The backend, the rendezvous, the ref group and the environment are the run's own."""
    a = _run(_backend, env={"PYCOMM_TEST_POOL_ENV": "a"}).check()
    b = _run(_backend, backend="gloo", make_ref=False, init="env", env={"PYCOMM_TEST_POOL_ENV": "b"},
             rank_env=[{"PYCOMM_TEST_POOL_RANK": "0"}, {"PYCOMM_TEST_POOL_RANK": "1"}]).check()
    c = _run(_backend, init="tcp").check()
    assert _pids(a) == _pids(b) == _pids(c)
    assert [a.returns[r]["backend"] for r in range(2)] == ["pycomm", "pycomm"]
    assert [b.returns[r]["backend"] for r in range(2)] == ["gloo", "gloo"]
    assert [(r["ref"], r["env"], r["rank_env"], r["init"]) for r in a.returns.values()] == [(True, "a", None, False)] * 2
    assert [(b.returns[r]["ref"], b.returns[r]["env"], b.returns[r]["rank_env"], b.returns[r]["init"])
            for r in range(2)] == [(False, "b", "0", True), (False, "b", "1", True)]
    assert [(r["env"], r["rank_env"], r["init"]) for r in c.returns.values()] == [(None, None, False)] * 2


def _hang_on_rank1(ctx):
    if ctx.rank == 1:
        ctx.progress("sleeping forever on rank 1")
        time.sleep(3600)
    return os.getpid()


def test_a_hung_case_is_reported_and_the_next_gets_fresh_ranks(own_key):
    before = _run(_observe, args=("a",)).check()
    started = time.monotonic()
    hung = _run(_hang_on_rank1, timeout_s=8)
    took = time.monotonic() - started
    assert hung.hung == [1] and hung.returns.get(0) == _pids(before)[0], hung.failure_message()
    message = hung.failure_message()
    assert "ranks [1] hung" in message and "sleeping forever on rank 1" in message, message
    assert took < 8 + 15, took
    after = _run(_observe, args=("a",)).check()
    assert not set(_pids(after)) & set(_pids(before)), "a set with a hung rank was used again"
    assert _without_pid(after) == _without_pid(before)


def _crash_rank0(ctx):
    if ctx.rank == 0:
        ctx.progress("about to crash")
        os.kill(os.getpid(), signal.SIGSEGV)
    return os.getpid()


def test_a_crashed_rank_is_reported_and_the_next_case_gets_fresh_ranks(own_key):
    before = _run(_observe, args=("a",)).check()
    crashed = _run(_crash_rank0, timeout_s=40)
    assert crashed.crashed == {0: -signal.SIGSEGV}, crashed.failure_message()
    assert "rank 0 died with exit code -11" in crashed.failure_message()
    assert "about to crash" in crashed.failure_message()
    after = _run(_observe, args=("a",)).check()
    assert not set(_pids(after)) & set(_pids(before))
    assert _without_pid(after) == _without_pid(before)


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return os.getpid()


def test_a_raising_case_is_reported_and_the_next_gets_fresh_ranks(own_key):
    before = _run(_observe, args=("a",)).check()
    failed = _run(_raise_on_rank1, timeout_s=40)
    assert 1 in failed.errors and "rank 1 fails on purpose" in failed.errors[1], failed.failure_message()
    after = _run(_observe, args=("a",)).check()
    assert not set(_pids(after)) & set(_pids(before))


def _leave(ctx):
    if ctx.rank == 1:
        ctx.abrupt_exit(os.getpid())
    ctx.wait_done(1, 0.5)
    return os.getpid()


def test_a_rank_gone_by_abrupt_exit_is_replaced(own_key):
    before = _run(_observe, args=("a",)).check()
    gone = _run(_leave).check()
    assert gone.returns[1] == _pids(before)[1]
    after = _run(_observe, args=("a",)).check()
    assert not set(_pids(after)) & set(_pids(before))


def _leave_a_thread(ctx):
    threading.Thread(target=time.sleep, args=(30,), name="left-behind", daemon=True).start()
    return os.getpid()


def test_a_case_that_leaves_a_thread_running_is_not_followed_on_its_ranks(own_key):
    before = _run(_leave_a_thread).check()
    after = _run(_observe, args=("a",)).check()
    assert not set(_pids(after)) & {before.returns[0], before.returns[1]}


def test_a_function_that_does_not_pickle_fails_in_the_test(own_key):
    """(on fresh ranks, as without the pool: multiprocessing's pickler refuses it too)"""
    with pytest.raises((AttributeError, TypeError, __import__("pickle").PicklingError)):
        _run(lambda ctx: 1)


def _mark_pre_init(rank):
    os.environ["PYCOMM_TEST_POOL_PRE_INIT"] = f"ran on rank {rank}"


def _pre_init_seen(ctx):
    return os.environ.get("PYCOMM_TEST_POOL_PRE_INIT")


def test_a_run_with_a_pre_init_on_forked_ranks_runs_it(own_key):
    """A pre_init on the fork server's ranks (asked for explicitly: by default it spawns)
    runs on fresh forks; the pool's ranks have no place for it."""
    res = _run(_pre_init_seen, pre_init=_mark_pre_init, start_method="forkserver").check()
    assert [res.returns[r] for r in range(2)] == ["ran on rank 0", "ran on rank 1"], res.returns
