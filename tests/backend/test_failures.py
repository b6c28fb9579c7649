"""Failure behaviour: a rank SIGKILLed mid-collective, a rank that never joins,
and ranks that disagree on a call. Survivors must raise (never hang), within the
group timeout plus a few seconds, naming the rank at fault; afterwards the group
says it is unusable and a new one works in the same process."""
import datetime
import os
import queue
import signal
import tempfile
import time

import pytest

from mp_util import in_environment, process_context, wait_for_files

WAIT_LIMIT_S = 120  # hard wall-clock bound on every spawned run


def _spawn(target, world, args, timeout_s=WAIT_LIMIT_S):
    """Runs target(rank, world, q, *args) in `world` fresh processes (forked from
    mp_util's server, or spawned under PYCOMM_TEST_START_METHOD=spawn); returns
    {rank: result} of those that reported. Kills whatever is left at the deadline.
    A process that dies on a signal other than SIGKILL (the tests' own kills), e.g.
    a crash or a sanitizer's abort even after it reported, fails the test."""
    ctx = process_context()
    q = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=in_environment, args=(env, target, r, world, q, *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, value = q.get(timeout=0.5)
            results[rank] = value
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    died = {r: -p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0
            and p.exitcode != -signal.SIGKILL}
    if died:
        pytest.fail(f"ranks died on signals {died} (rank: signal); results: {results}", pytrace=False)
    return results


def _kill_worker(rank, world, q, rdzv, rdzv_again, algo):
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=20)
    dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world, timeout=timeout)
    pycomm.set_algorithm(algo)
    t = torch.ones(4 << 20)  # 16 MiB: the kill lands mid-transfer
    failure = None
    for step in range(1000):
        if rank == world - 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001
            failure = (f"{type(e).__name__}: {e}", time.monotonic() - start)
            break
    if failure is None:
        q.put((rank, {"error": None}))
        return
    result = {"error": failure[0], "seconds": failure[1]}
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as later:  # noqa: BLE001
        result["later"] = str(later)
    # A fresh group among the survivors, in this same process.
    dist.destroy_process_group()
    dist.init_process_group("pycomm", init_method=rdzv_again, rank=rank, world_size=world - 1,
                            timeout=timeout)
    x = torch.full((10,), float(rank + 1))
    dist.all_reduce(x)
    result["reinit_sum"] = x[0].item()
    dist.destroy_process_group()
    q.put((rank, result))


@pytest.mark.parametrize("algo", ["ring", "shm"])
def test_sigkill_mid_collective_names_the_lost_rank(tmp_path, algo):
    """Over TCP (ring) the survivors see the socket close; through shared memory
    (shm) they see the process gone. Either way nothing stays in /dev/shm."""
    world = 3
    before = set(n for n in os.listdir("/dev/shm") if n.startswith("pycomm-"))
    results = _spawn(_kill_worker, world,
                     (f"file://{tmp_path}/rdzv1", f"file://{tmp_path}/rdzv2", algo))
    survivors = [r for r in range(world - 1)]
    assert sorted(results) == survivors, f"survivors reported: {results}"
    for rank in survivors:
        res = results[rank]
        assert res["error"] is not None, res
        assert "DistBackendError" in res["error"], res
        # Named directly, or through the survivor that saw it go first.
        assert "rank 2" in res["error"], res["error"]
        assert res["seconds"] < 20 + 5, res
        assert "unusable" in res["later"], res["later"]
        assert res["reinit_sum"] == 3.0, res
    after = set(n for n in os.listdir("/dev/shm") if n.startswith("pycomm-"))
    assert after <= before, f"left in /dev/shm: {sorted(after - before)}"


def _never_joins_worker(rank, world, q, rdzv, done):
    import torch.distributed as dist

    import pycomm  # noqa: F401

    if rank == 1:
        # never calls init_process_group: stays until rank 0 has given up (4 s timeout; the
        # test allows 9), at most 12 s
        q.put((rank, "waited" if wait_for_files([done], limit_s=12) else "slept"))
        return
    start = time.monotonic()
    try:
        dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=4))
        q.put((rank, {"error": None}))
    except Exception as e:  # noqa: BLE001
        q.put((rank, {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}))
    open(done, "w").close()


def test_rank_that_never_joins_times_out_naming_it(tmp_path):
    results = _spawn(_never_joins_worker, 2, (f"file://{tmp_path}/rdzv", str(tmp_path / "rank0-done")),
                     timeout_s=60)
    res = results[0]
    assert res["error"] is not None, res
    assert "rank 1" in res["error"] and "timed out" in res["error"], res["error"]
    assert 3.5 < res["seconds"] < 4 + 5, res


def _mismatch_worker(rank, world, q, rdzv, check):
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401

    if check:
        os.environ["PYCOMM_CHECK"] = "1"
    dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=10))
    # Same byte count, different dtype: without a check this is a silent wrong result.
    t = torch.ones(1000, dtype=torch.float32 if rank == 0 else torch.int32)
    try:
        dist.all_reduce(t)
        outcome = {"error": None}
    except Exception as e:  # noqa: BLE001
        outcome = {"error": f"{type(e).__name__}: {e}"}
    q.put((rank, outcome))


def test_dtype_mismatch_is_caught_with_pycomm_check(tmp_path):
    results = _spawn(_mismatch_worker, 2, (f"file://{tmp_path}/rdzv", True), timeout_s=60)
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error is not None and "DistBackendError" in error, results
        assert "ranks made different calls" in error, error
        assert "float32 x1000 SUM" in error and "int32 x1000 SUM" in error, error


def _size_mismatch_worker(rank, world, q, rdzv):
    import torch
    import torch.distributed as dist

    import pycomm

    dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=10))
    pycomm.set_algorithm("tree")
    t = torch.ones(1000 if rank == 0 else 1001)
    try:
        dist.all_reduce(t)
        outcome = {"error": None}
    except Exception as e:  # noqa: BLE001
        outcome = {"error": f"{type(e).__name__}: {e}"}
    q.put((rank, outcome))


def test_size_mismatch_is_an_error_even_without_check(tmp_path):
    results = _spawn(_size_mismatch_worker, 2, (f"file://{tmp_path}/rdzv",), timeout_s=60)
    errors = [results[r]["error"] for r in (0, 1)]
    assert all(e is not None for e in errors), results
    assert any("sent 4004 bytes where 4000 were expected" in e for e in errors), errors


# Each collective with a rank that stays away (issue #13): the others time out in
# the middle of it, over TCP, and the buffers their receives were posted into are
# freed as the error unwinds. The transport must have let go of them first (a
# use-after-free otherwise; `make test-asan` runs this under AddressSanitizer).
_ABSENT_RANK_OPS = (
    "all_reduce ring", "all_reduce tree", "all_reduce sharded", "all_reduce_coalesced",
    "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "gather", "scatter", "barrier",
)


def _run_op(name, rank, world):
    import torch
    import torch.distributed as dist

    import pycomm

    n = 1 << 16
    if name.startswith("all_reduce "):
        pycomm.set_algorithm(name.split()[1])
        dist.all_reduce(torch.ones(n))
    elif name == "all_reduce_coalesced":
        dist.all_reduce_coalesced([torch.ones(n), torch.ones(n // 3)])
    elif name == "broadcast":
        dist.broadcast(torch.ones(n), src=world - 1)  # the absent rank is the root
    elif name == "reduce":
        dist.reduce(torch.ones(n), dst=0)
    elif name == "all_gather_into_tensor":
        dist.all_gather_into_tensor(torch.empty(n * world), torch.ones(n))
    elif name == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world))
    elif name == "all_to_all_single":
        dist.all_to_all_single(torch.empty(n * world), torch.ones(n * world))
    elif name == "gather":
        dist.gather(torch.ones(n), [torch.empty(n) for _ in range(world)] if rank == 0 else None, dst=0)
    elif name == "scatter":
        dist.scatter(torch.empty(n), None, src=world - 1)
    elif name == "barrier":
        dist.barrier()
    else:
        raise AssertionError(name)


def _absent_rank_worker(rank, world, q, rdzv_dir):
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401

    torch.set_num_threads(1)
    os.environ["PYCOMM_TRANSPORT"] = "tcp"
    os.environ["PYCOMM_CHECK"] = "0"  # the collective itself, not the call check, must time out
    results = {}
    for i, name in enumerate(_ABSENT_RANK_OPS):
        # The rendezvous waits up to 30 s (the ranks start, and leave the previous op's
        # group, seconds apart on a loaded machine); the collective then waits 1 s.
        dist.init_process_group("pycomm", init_method=f"file://{rdzv_dir}/op{i}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=30))
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))._set_default_timeout(
            datetime.timedelta(seconds=1))
        if rank == world - 1:
            # Stay in the group until the others are done with the op: leaving would shut
            # the group down and tell them at once ("rank 2 aborted the group"), and they
            # would never reach the timeout this test is about.
            results[name] = "absent"
            wait_for_files([os.path.join(rdzv_dir, f"op{i}-done{r}") for r in range(world - 1)], limit_s=60)
        else:
            start = time.monotonic()
            try:
                _run_op(name, rank, world)
                results[name] = {"error": None}
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
            open(os.path.join(rdzv_dir, f"op{i}-done{rank}"), "w").close()
        dist.destroy_process_group()
    q.put((rank, results))


def test_rank_absent_from_each_collective_over_tcp(tmp_path):
    world = 3
    results = _spawn(_absent_rank_worker, world, (str(tmp_path),))
    assert sorted(results) == list(range(world)), f"ranks reported: {sorted(results)}"
    for rank in range(world - 1):
        for name in _ABSENT_RANK_OPS:
            res = results[rank][name]
            if res["error"] is None:
                # Only a rank with nothing to receive may finish (a sender of a
                # gather, a reduce leaf whose parent buffered its message).
                assert name in ("gather", "reduce") and rank != 0, (rank, name, res)
                continue
            assert "DistBackendError" in res["error"], (rank, name, res)
            assert "Timed out" in res["error"], (rank, name, res)
            assert "rank 2" in res["error"] or "rank 0" in res["error"] or "rank 1" in res["error"], res
            assert 0.9 <= res["seconds"] < 1 + 5, (rank, name, res)


def _kill_in_op_worker(rank, world, q, rdzv, name):
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401

    torch.set_num_threads(1)
    os.environ["PYCOMM_TRANSPORT"] = "tcp"
    dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    failure = None
    for step in range(1000):
        if rank == world - 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            _run_op(name, rank, world)
        except Exception as e:  # noqa: BLE001
            failure = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
            break
    dist.destroy_process_group()
    q.put((rank, failure))


@pytest.mark.parametrize("name", ["all_reduce_coalesced", "reduce_scatter_tensor", "all_to_all_single"])
def test_sigkill_in_collective_over_tcp(tmp_path, name):
    world = 3
    results = _spawn(_kill_in_op_worker, world, (f"file://{tmp_path}/rdzv", name))
    assert sorted(results) == [0, 1], f"survivors reported: {results}"
    for rank in (0, 1):
        res = results[rank]
        assert res is not None and "DistBackendError" in res["error"], res
        assert "rank 2" in res["error"], res
        assert res["seconds"] < 20 + 5, res


def _monitored_worker(rank, world, q, rdzv, case):
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    os.environ["PYCOMM_CHECK"] = "1"  # the call check must not run before a monitored barrier
    dist.init_process_group("pycomm", init_method=f"file://{rdzv}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    absent = {"all": (), "late1": (1,), "all_late": tuple(range(1, world))}[case]
    result = {}
    if rank in absent:
        # Stay in the group until the others are done: leaving would tell them at once.
        wait_for_files([os.path.join(rdzv, f"done{r}") for r in range(world) if r not in absent], limit_s=60)
    else:
        start = time.monotonic()
        try:
            pycomm.monitored_barrier(timeout=datetime.timedelta(seconds=1.5), wait_all_ranks=case == "all_late")
            result["error"] = None
            x = torch.ones(3)
            dist.all_reduce(x)  # the group still works after a barrier everyone passed
            result["sum"] = x.tolist()
            gloo = dist.new_group(backend="gloo")
            pycomm.monitored_barrier(gloo, timeout=5)  # another backend: torch's own
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}"
        result["seconds"] = time.monotonic() - start
        open(os.path.join(rdzv, f"done{rank}"), "w").close()
    dist.destroy_process_group()
    q.put((rank, result))


@pytest.mark.parametrize("case", ["all", "late1", "all_late"])
def test_monitored_barrier_names_the_ranks_that_did_not_arrive(tmp_path, case):
    """pycomm.monitored_barrier: torch's monitored_barrier contract (gloo's words) on a
    pycomm group, which dist.monitored_barrier refuses for any backend but gloo. Rank 0
    names the first rank that did not arrive within the timeout, or every one with
    wait_all_ranks; a rank that arrived learns from rank 0's abort which one it was."""
    world = 3
    results = _spawn(_monitored_worker, world, (str(tmp_path), case))
    assert sorted(results) == list(range(world)), f"ranks reported: {sorted(results)}"
    if case == "all":
        for rank in range(world):
            assert results[rank]["error"] is None and results[rank]["sum"] == [3.0] * 3, results[rank]
        return
    zero = results[0]
    assert zero["error"] is not None and "DistBackendError" in zero["error"], zero
    if case == "late1":
        assert "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1500 ms" in zero["error"], zero
        two = results[2]
        assert "Rank 2 successfully reached monitoredBarrier" in two["error"], two
        assert "Rank 1 failed to pass monitoredBarrier" in two["error"], two  # rank 0's verdict, passed on
        assert two["seconds"] < 1.5 + 5, two
    else:
        assert "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 1500 ms" in zero["error"], zero
    assert 1.4 <= zero["seconds"] < 1.5 + 5, zero
