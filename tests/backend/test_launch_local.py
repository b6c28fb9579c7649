"""pycomm.launch's local ranks: forks of a fork server that has imported torch, which see
what a spawned rank would see (the environment and working directory of the call, the
caller's stdout and stderr), and are spawned when a load-time variable changed."""
from __future__ import annotations

import os
import sys

import pytest

from pycomm import launch
from pycomm.launch import launch_workers


def report_worker(rank, world_size, init_method, payload):
    """What a rank sees, and one line on each of its streams (no process group)."""
    print(f"rank {rank} of {world_size} says {payload}", flush=True)
    print(f"rank {rank} writes to stderr", file=sys.stderr, flush=True)
    return {"ppid": os.getppid(), "cwd": os.getcwd(), "var": os.environ.get("PYCOMM_TEST_LAUNCH_VAR"),
            "gone": os.environ.get("PYCOMM_TEST_LAUNCH_GONE"), "torch_loaded": "torch" in sys.modules}


@pytest.fixture
def local(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYCOMM_TEST_LAUNCH_VAR"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(),
                    reason="no fork server on this platform: ranks are spawned")
def test_ranks_fork_from_one_server_and_see_the_call(local, tmp_path, monkeypatch, capfd):
    # The server may start here or may have started earlier in this process, under other
    # streams, environment and working directory than the second launch's.
    monkeypatch.setenv("PYCOMM_TEST_LAUNCH_GONE", "set when the server may start")
    elsewhere = tmp_path / "first.txt"
    saved = os.dup(1), os.dup(2)
    try:
        with open(elsewhere, "w") as handle:
            os.dup2(handle.fileno(), 1)
            os.dup2(handle.fileno(), 2)
            first = launch_workers(report_worker, 2, "first")
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    assert "rank 1 of 2 says first" in elsewhere.read_text()
    monkeypatch.delenv("PYCOMM_TEST_LAUNCH_GONE")
    monkeypatch.setenv("PYCOMM_TEST_LAUNCH_VAR", "set after the server started")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    second = launch_workers(report_worker, 2, "second")
    out, err = capfd.readouterr()
    assert first["ppid"] != os.getpid(), "rank 0 was not forked from a server"
    assert second["ppid"] == first["ppid"], "the second launch started another server"
    assert second["var"] == "set after the server started" and second["gone"] is None, second
    assert second["cwd"] == str(tmp_path), second
    assert "rank 0 of 2 says second" in out and "rank 1 of 2 says second" in out, (out, err)
    assert "rank 1 writes to stderr" in err and "says" not in err, (out, err)


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(),
                    reason="no fork server on this platform: ranks are spawned")
def test_a_changed_load_time_variable_spawns_the_ranks(local, monkeypatch):
    forked = launch_workers(report_worker, 1, None)
    assert forked["ppid"] != os.getpid()
    # torch reads TORCH_* when it loads: the server's torch would not have seen it.
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "0" if os.environ.get("TORCH_SHOW_CPP_STACKTRACES") == "1" else "1")
    spawned = launch_workers(report_worker, 1, None)
    assert spawned["ppid"] == os.getpid(), "a rank with another load-time environment came from the server"
    monkeypatch.undo()
    assert launch_workers(report_worker, 1, None)["ppid"] == forked["ppid"]


def test_without_a_fork_server_ranks_are_spawned(local, monkeypatch):
    monkeypatch.setattr(launch.multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    result = launch_workers(report_worker, 1, None)
    assert result["ppid"] == os.getpid() and result["torch_loaded"], result


def netns_worker(rank, world_size, init_method, payload):
    """Where a rank runs: its network namespace, session, interfaces and parent."""
    return {"netns": os.readlink("/proc/self/ns/net"), "sid": os.getsid(0), "pid": os.getpid(),
            "ppid": os.getppid(), "ifnames": sorted(name for _, name in __import__("socket").if_nameindex()),
            "secret": os.environ.get("PYCOMM_SECRET"), "var": os.environ.get("PYCOMM_TEST_LAUNCH_VAR")}


def netns_report_worker(rank, world_size, init_method, payload):
    import pickle

    with open(os.path.join(payload, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(netns_worker(rank, world_size, init_method, payload), handle)


@pytest.mark.skipif(__import__("pycomm.netns").netns.netns_unavailable_reason() is not None,
                    reason="needs network namespaces (root, iproute2)")
def test_ranks_start_in_their_network_namespaces(local, tmp_path, monkeypatch):
    """pycomm-bench --hosts's ranks: each enters its host's namespace first thing, in a
    session of its own (a terminal's Ctrl-C reaches only the launching process), with the
    environment given, forked from the same server as local ranks."""
    import pickle

    from pycomm.launch import start_ranks
    from pycomm.netns import IFNAME, NetnsHosts

    monkeypatch.setenv("PYCOMM_TEST_LAUNCH_VAR", "the caller's")
    local_rank = launch_workers(report_worker, 1, None)
    with NetnsHosts(2) as hosts:
        netns = [hosts.names[0], hosts.names[0], hosts.names[1]]
        procs = start_ranks(netns_report_worker, 3, str(tmp_path), "file:///nonexistent", str(tmp_path / "r.pkl"),
                            env=dict(os.environ, PYCOMM_SECRET="s3"), netns=netns)
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [0, 0, 0]
        seen = [pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()) for rank in range(3)]
    mine = os.readlink("/proc/self/ns/net")
    assert seen[0]["netns"] == seen[1]["netns"] != seen[2]["netns"], seen
    assert mine not in {s["netns"] for s in seen}, seen
    assert all(IFNAME in s["ifnames"] for s in seen), seen
    assert all(s["sid"] == s["pid"] for s in seen), "a rank shares the caller's session"
    assert all(s["secret"] == "s3" and s["var"] == "the caller's" for s in seen), seen
    if "forkserver" in __import__("multiprocessing").get_all_start_methods():
        assert {s["ppid"] for s in seen} == {local_rank["ppid"]} != {os.getpid()}, "not forked from the server"


def test_ranks_environment_must_keep_the_load_time_variables(local):
    from pycomm.launch import start_ranks

    env = dict(os.environ, LD_PRELOAD="/nonexistent.so")
    with pytest.raises(ValueError, match="load-time variables"):
        start_ranks(report_worker, 1, None, "file:///nonexistent", "/nonexistent/r.pkl", env=env)
