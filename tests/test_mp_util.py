"""tests/mp_util.py itself: a rank that dies while sending its result must not hang the parent.

The harness runs in a child interpreter under a hard timeout (run_bounded kills the whole
process tree), so a harness that hangs fails this test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import threading
import time

import pytest

from netns_util import run_bounded

TESTS = os.path.dirname(os.path.abspath(__file__))
BIG = 64 << 20  # bytes: a message far larger than a pipe's buffer
HARNESS_TIMEOUT_S = 40.0  # spawn_run's own limit
BOUND_S = 90.0  # the child interpreter's; reached only if spawn_run ignores its limit


_WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}.get(platform.machine())


def _writing(nbytes: int) -> bool:
    """Is a thread of this process inside a write() of at least ``nbytes``?"""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/syscall") as handle:
                fields = handle.read().split()
        except OSError:
            continue
        if len(fields) > 3 and fields[0] == str(_WRITE_SYSCALL) and int(fields[3], 16) >= nbytes:
            return True
    return False


def _kill_while_writing(nbytes: int) -> None:
    """SIGKILL this process while one of its threads is in the middle of a big write()
    (it blocks there until the reader has drained all but the pipe's last 64 KiB)."""
    while not _writing(nbytes):
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGKILL)


def _dies_mid_message(ctx):
    import torch.distributed as dist

    dist.barrier()  # rank 0 must not leave while gloo still connects rank 1
    if ctx.rank == 1:
        ctx.report("small", "sent before the big one")
        ctx.progress("sending a big report")
        threading.Thread(target=_kill_while_writing, args=(1 << 20,), daemon=True).start()
        ctx.report("big", b"x" * BIG)
        time.sleep(HARNESS_TIMEOUT_S)  # not reached when the report blocks; killed either way
    return f"rank {ctx.rank} done"


_PARENT = """
import json, sys
sys.path.insert(0, {tests!r})
import multiprocessing.forkserver
import mp_util
from mp_util import spawn_run
import test_mp_util
# the fork server (torch and pycomm imported: tens of seconds on a crowded machine) is
# started before the clock of the run under test starts
if mp_util.START_METHOD == "forkserver":
    mp_util._context("forkserver")
    multiprocessing.forkserver.ensure_running()
res = spawn_run(test_mp_util._dies_mid_message, 2, backend="gloo", make_ref=False, timeout_s={timeout!r})
print("RESULT " + json.dumps({{"returns": res.returns, "crashed": res.crashed, "hung": res.hung,
                              "reports": {{r: sorted(v) for r, v in res.reports.items()}},
                              "small": res.reports.get(1, {{}}).get("small"),
                              "message": res.failure_message(), "elapsed_s": res.elapsed_s}}))
"""


@pytest.mark.skipif(_WRITE_SYSCALL is None or not os.path.exists("/proc/self/task"),
                    reason="needs Linux /proc/<pid>/task/<tid>/syscall on x86_64 or aarch64")
def test_rank_killed_while_sending_does_not_hang_the_parent():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = _PARENT.format(tests=TESTS, timeout=HARNESS_TIMEOUT_S)
    started = time.monotonic()
    rc, out = run_bounded([sys.executable, "-c", script], BOUND_S, env=env, cwd=TESTS)
    took = time.monotonic() - started
    assert rc is not None, f"spawn_run hung: the parent was still waiting after {took:.0f} s\n{out[-3000:]}"
    assert rc == 0, out[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["crashed"] == {"1": -signal.SIGKILL}, res
    assert res["returns"] == {"0": "rank 0 done"} and res["hung"] == [], res
    assert res["small"] == "sent before the big one", res  # what arrived before the death survives
    message = res["message"]
    assert "rank 1 died with exit code -9" in message and "sending a big report" in message, message
    assert "while sending a message" in message, message
    assert res["elapsed_s"] < HARNESS_TIMEOUT_S, res


def _environment(ctx):
    return {k: os.environ.get(k) for k in ("PYCOMM_TEST_SET_LATER", "PYCOMM_TEST_REMOVED_LATER", "PYCOMM_TEST_RUN")}


def test_ranks_see_the_parents_environment_at_the_call(monkeypatch):
    """Forked from a server started earlier, a rank would see the environment the server
    started with; spawn_run hands it the parent's as it is at the call, then the run's env."""
    from mp_util import run_multiprocess

    monkeypatch.setenv("PYCOMM_TEST_REMOVED_LATER", "1")
    # the fork server whatever PYCOMM_TEST_START_METHOD says: that is the path under test
    run_multiprocess(_environment, 1, make_ref=False, start_method="forkserver")  # starts it (if not yet)
    monkeypatch.setenv("PYCOMM_TEST_SET_LATER", "yes")
    monkeypatch.delenv("PYCOMM_TEST_REMOVED_LATER")
    monkeypatch.setenv("PYCOMM_TEST_RUN", "parent")
    returns = run_multiprocess(_environment, 2, make_ref=False, env={"PYCOMM_TEST_RUN": "run"},
                               start_method="forkserver")
    for rank in range(2):
        assert returns[rank] == {"PYCOMM_TEST_SET_LATER": "yes", "PYCOMM_TEST_REMOVED_LATER": None,
                                     "PYCOMM_TEST_RUN": "run"}, rank


def test_start_method_choice():
    """Fork-server ranks unless a fork would differ from a fresh interpreter."""
    from mp_util import START_METHOD, _start_method

    assert _start_method(None, {"PYCOMM_TRANSPORT", "OMP_NUM_THREADS"}, None) == START_METHOD
    assert _start_method(None, {"LD_PRELOAD"}, None) == "spawn"
    assert _start_method(None, {"OMP_PROC_BIND"}, None) == "spawn"
    assert _start_method(None, set(), print) == "spawn"  # pre_init runs before torch is imported
    assert _start_method("forkserver", {"LD_PRELOAD"}, None) == "forkserver"  # asked for


def _waits_on_a_child_that_sleeps():
    import multiprocessing

    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(600,))
    child.start()
    child.join()
    return child.exitcode


def test_call_with_deadline_returns_raises_and_kills_what_it_started():
    from mp_util import call_with_deadline

    assert call_with_deadline(divmod, 7, 2, timeout_s=30) == (3, 1)
    with pytest.raises(SystemExit) as exited:
        call_with_deadline(sys.exit, 3, timeout_s=30)
    assert exited.value.code == 3
    import multiprocessing

    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)did not return in 2 s; killed 1 process.*_waits_on_a_child"):
        call_with_deadline(_waits_on_a_child_that_sleeps, timeout_s=2)
    assert time.monotonic() - start < 20
    assert set(multiprocessing.active_children()) == before  # the sleeping child is gone


def _raise_in_the_function(ctx):
    raise RuntimeError(f"rank {ctx.rank} fails in the test's function")


def test_a_failure_in_the_function_is_reported_there():
    """The last note before the test's function is the call: a rank that fails (or hangs)
    there is reported there, not in the harness's set-up."""
    from mp_util import _CALLING, spawn_run

    res = spawn_run(_raise_in_the_function, 2, timeout_s=60)
    assert res.progress == {0: _CALLING, 1: _CALLING}, res.progress
    assert "rank 1 fails in the test's function" in res.errors[1]


def _rank1_slow_after_its_set_up(rank):
    """(pre_init) Rank 1 takes a second longer than rank 0 to finish the harness's set-up,
    as a rank descheduled at the end of gloo's handshake on these cores does."""
    if rank != 1:
        return
    import torch.distributed as dist

    new_group = dist.new_group

    def slow_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        time.sleep(1.0)
        return group

    dist.new_group = slow_new_group


def _entered_at(ctx):
    return time.monotonic()


def test_no_rank_enters_the_function_before_every_rank_finished_its_set_up():
    """A rank that left the function at once (returned and tore down, or exited) while a
    peer was still in gloo's handshake made that peer's set-up fail ("Connection closed by
    peer"): the ranks pass a barrier together before the function."""
    from mp_util import START_METHOD, spawn_run

    # (forks of the fork server where the suite uses it: pre_init alone would spawn)
    res = spawn_run(_entered_at, 2, pre_init=_rank1_slow_after_its_set_up, start_method=START_METHOD,
                    timeout_s=90).check()
    assert res.returns[0] >= res.returns[1] - 0.5, (
        f"rank 0 entered the function {res.returns[1] - res.returns[0]:.2f} s before rank 1 finished its set-up")
