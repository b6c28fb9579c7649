"""Tests of the benchmark CLI (pycomm.bench) and the demo (pycomm.demo).

Pure helpers (size parsing, bandwidth formulas, the closed-form check
patterns) are tested in-process. The CLI's sweeps and the benchmark scripts run their
``main()`` in this process under a hard deadline (mp_util.run_main_here: the CLI's ranks
fork from pycomm.launch's fork server, so no interpreter imports torch again); one
sweep, a usage error of the CLI and of a script, and the demo run as subprocesses with a
hard ``timeout=``. A hang fails the test instead of stalling it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pycomm
from pycomm import bench
from pycomm.bench import cli, harness, runners, sweep

# Where the imported pycomm lives, so subprocesses import the same one.
_PACKAGE_ROOT = str(Path(pycomm.__file__).resolve().parent.parent)
_HAS_BACKEND = hasattr(pycomm, "set_algorithm")
requires_backend = pytest.mark.skipif(not _HAS_BACKEND, reason="pycomm extension not built")
_MPI_MISSING = bench.mpi_unavailable_reason()
requires_mpi = pytest.mark.skipif(
    _MPI_MISSING is not None,
    reason=f"Open MPI peer not installed: {_MPI_MISSING} (see benchmarks/README.md)")

# Wall-clock limits for the subprocess runs (generous: 2 cores, shared).
_CLI_TIMEOUT_S = 240
_DEMO_TIMEOUT_S = 300


def _run_module(module: str, args, cwd, timeout: float, extra_env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # spawn mode, never a leftover torchrun environment
    try:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"python -m {module} {' '.join(args)} hung for {timeout} s; output so far:\n"
                    f"{exc.stdout}\n{exc.stderr}", pytrace=False)


def _run_cli(args, tmp_path, monkeypatch, capfd, extra_env=None) -> subprocess.CompletedProcess:
    """``python -m pycomm.bench ARGS``'s main() in this process (mp_util.run_main_here)."""
    from mp_util import run_main_here

    return run_main_here(cli.main, args, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd,
                         timeout_s=_CLI_TIMEOUT_S, env=extra_env, name="pycomm.bench")


def _describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("8", 8), ("0", 0), ("64K", 64 * 1024), ("64k", 64 * 1024), ("16M", 16 * 2 ** 20),
    ("1G", 2 ** 30), ("1.5K", 1536), ("2MiB", 2 * 2 ** 20), ("4KB", 4096), (" 32 ", 32),
])
def test_parse_size(text, expected):
    assert bench.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "12Q", "-8", "1.3", "8 bytes", "0x10"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="^pycomm bench:"):
        bench.parse_size(text)


def test_size_sweep():
    assert bench.size_sweep(8, 32 * 1024, 8) == [8, 64, 512, 4096, 32768]
    # The end point is always measured, even when the geometric steps skip it.
    assert bench.size_sweep(8, 64 * 1024, 8) == [8, 64, 512, 4096, 32768, 65536]
    assert bench.size_sweep(8, 64 * 2 ** 20, 4)[-2:] == [32 * 2 ** 20, 64 * 2 ** 20]
    assert bench.size_sweep(100, 100, 1) == [100]
    for bad in [(0, 8, 2), (16, 8, 2), (8, 64, 1)]:
        with pytest.raises(ValueError, match="^pycomm bench:"):
            bench.size_sweep(*bad)


def test_bandwidth_formulas():
    assert bench.alg_bandwidth(10 ** 9, 1.0) == pytest.approx(1.0)
    assert bench.alg_bandwidth(2 ** 20, 1e-3) == pytest.approx(2 ** 20 / 1e-3 / 1e9)
    for n in range(1, 10):
        # nccl-tests, all-reduce: busbw = algbw * 2(n-1)/n
        assert bench.bus_bandwidth(3.0, n) == pytest.approx(3.0 * 2 * (n - 1) / n)
        assert bench.bus_bandwidth(3.0, n, "allgather") == pytest.approx(3.0 * (n - 1) / n)
        assert bench.bus_bandwidth(3.0, n, "broadcast") == pytest.approx(3.0)
    assert bench.bus_bandwidth(1.0, 2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="^pycomm bench:"):
        bench.alg_bandwidth(8, 0.0)
    with pytest.raises(ValueError, match="^pycomm bench:"):
        bench.bus_bandwidth(1.0, 0)


def test_iterations_shrink_for_large_sizes():
    assert sweep.iterations_for(2 ** 20, 20, 5) == (20, 5)
    assert sweep.iterations_for(16 * 2 ** 20, 20, 5) == (20, 5)
    assert sweep.iterations_for(32 * 2 ** 20, 20, 5) == (10, 2)
    assert sweep.iterations_for(2 ** 30, 20, 5) == (3, 1)
    assert sweep.iterations_for(2 ** 30, 2, 0) == (2, 0)


_REDUCE = {
    "sum": lambda t: t.sum(0),
    "avg": lambda t: t.mean(0),
    "min": lambda t: t.min(0).values,
    "max": lambda t: t.max(0).values,
    "product": lambda t: t.prod(0),
}


@pytest.mark.parametrize("op", sorted(_REDUCE))
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_check_pattern_closed_form(op, world_size):
    """Reducing every rank's input gives the expected block, exactly, in every dtype."""
    for name in ("float32", "float16", "bfloat16", "int8", "uint8", "int64"):
        dtype = bench.DTYPES[name]
        if op == "avg" and not dtype.is_floating_point:
            continue
        try:
            period = sweep.pattern_period(dtype, op, world_size)
        except ValueError:
            assert name in ("int8", "uint8") and world_size >= 8, (name, op, world_size)
            continue
        count = 3 * period * world_size + 7  # not a multiple of anything in particular
        inputs = torch.stack([
            sweep.tiled(sweep.pattern_blocks(op, rank, world_size, period)[0], count, dtype)
            for rank in range(world_size)
        ])
        expected = sweep.tiled(sweep.pattern_blocks(op, 0, world_size, period)[1], count, dtype)
        reduced = _REDUCE[op](inputs.to(torch.float64)).to(dtype)
        assert sweep.matches(reduced, expected), (name, op, world_size)
        assert float(inputs.to(torch.float64).abs().max()) <= sweep.EXACT_LIMIT[dtype]
        # Position-dependent: a chunk moved by one element would not match.
        assert not sweep.matches(expected.roll(1), expected), (name, op, world_size)


def test_check_detects_wrong_result(tmp_path, monkeypatch):
    """In-process, one rank over gloo: a corrupted all-reduce gives FAIL rows and ok=False."""
    cfg = bench.BenchConfig(nprocs=1, min_bytes=64, max_bytes=4096, step_factor=8, iters=2,
                            warmup=1, backend="gloo", peer=None, quiet=True, timeout_s=60)
    init = "file://" + str(tmp_path / "rendezvous_ok")
    result = harness.bench_worker(0, 1, init, cfg)
    assert result.ok and {row["check"] for row in result.rows} == {"OK"}

    real = runners.TorchRunner.call

    def corrupting(runner, buffer):
        real(runner, buffer)
        buffer[-1] += 1

    monkeypatch.setattr(runners.TorchRunner, "call", corrupting)
    init = "file://" + str(tmp_path / "rendezvous_bad")
    result = harness.bench_worker(0, 1, init, cfg)
    assert not result.ok
    assert [row["check"] for row in result.rows] == ["FAIL"] * 3
    assert not dist.is_initialized()


def test_main_exit_code_follows_checks(monkeypatch):
    def fake(ok):
        return lambda cfg: bench.BenchResult(meta={}, rows=[], ok=ok)

    monkeypatch.setattr(cli, "run_benchmark", fake(True))
    assert bench.main(["-n", "2"]) == 0
    monkeypatch.setattr(cli, "run_benchmark", fake(False))
    assert bench.main(["-n", "2"]) == 1


def test_parse_args():
    cfg = bench.parse_args(["-b", "1K", "-e", "1M", "-f", "2", "--algos", "ring, auto",
                            "--peer", "none", "--no-check", "--dtype", "bfloat16", "--op", "avg"])
    assert (cfg.min_bytes, cfg.max_bytes, cfg.step_factor) == (1024, 2 ** 20, 2)
    assert cfg.algos == ("ring", "auto") and cfg.peer is None and cfg.check is False
    default = bench.parse_args([])
    assert (default.nprocs, default.min_bytes, default.max_bytes, default.step_factor) == (2, 8, 64 * 2 ** 20, 4)
    assert (default.iters, default.warmup, default.dtype, default.op) == (20, 5, "float32", "sum")
    assert default.algos == ("auto", "ring", "tree", "sharded") and default.peer == "gloo" and default.check
    assert default.timing == "block" and bench.parse_args(["--timing", "barrier"]).timing == "barrier"
    with pytest.raises(ValueError, match="pycomm bench: unknown --timing 'blocks'"):
        sweep.BenchConfig(timing="blocks").validate()


class _Recorder(sweep.Runner):
    """A column that logs its calls (and, through ``log``, the barriers between them)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def call(self, buffer):
        self.log.append(self.name)


def test_time_samples_disciplines():
    """block: realign call + a block of calls per sample, no barrier; barrier: the barrier,
    then exactly one call per sample, whatever block and realign say."""
    log = []
    runners = [_Recorder("a", log), _Recorder("b", log)]
    buffer = torch.zeros(2)
    times = sweep.time_samples(runners, [0, 1], buffer, iters=2, block=3, realign=True)
    assert [len(t) for t in times] == [2, 2] and "|" not in log
    assert log == ["a"] * 4 + ["b"] * 4 + ["b"] * 4 + ["a"] * 4  # the first column rotates
    log.clear()
    exits = [[], []]
    before = time.perf_counter()
    times = sweep.time_samples(runners, [0, 1], buffer, iters=3, block=16, realign=True,
                               barrier=lambda: log.append("|"), exits=exits)
    assert [len(t) for t in times] == [3, 3] and all(t >= 0 for t in times[0] + times[1])
    assert log == ["|", "a", "|", "b", "|", "b", "|", "a", "|", "a", "|", "b"]
    assert [len(e) for e in exits] == [3, 3] and before <= min(exits[0]) and max(exits[1]) <= time.perf_counter()
    assert exits[0][0] < exits[1][0] < exits[1][1] < exits[0][1]  # round 2 started with b


@pytest.mark.parametrize("args", [["-e", "12Q"], ["--op", "avg", "--dtype", "int32"], ["-f", "1"],
                                  ["-n", "0"], ["--plot", "out.jpg"],
                                  ["--mpi", "--dtype", "bfloat16"], ["--mpi", "--op", "avg"],
                                  ["--algos", "ring,topk1%", "--dtype", "float64"],
                                  ["--algos", "quant8", "--op", "max"], ["--algos", "topk0%"]])
def test_cli_usage_errors(args, tmp_path, monkeypatch, capsys):
    """The CLI's own main() in this process (a subprocess per case would mostly import torch;
    test_cli_usage_error_through_python_m covers `python -m pycomm.bench`'s exit code)."""
    from pycomm.bench import cli

    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # spawn mode, as _run_module runs it
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "pycomm bench:" in err


def test_cli_usage_error_through_python_m(tmp_path):
    proc = _run_module("pycomm.bench", ["--algos", "topk0%"], tmp_path, timeout=60)
    assert proc.returncode == 2, _describe(proc)
    assert "pycomm bench:" in proc.stderr


# ---------------------------------------------------------------------------
# End to end (subprocesses with timeouts)
# ---------------------------------------------------------------------------

def _load_rows(path: Path):
    data = json.loads(path.read_text())
    assert set(data) >= {"meta", "rows", "ok"}
    return data["meta"], data["rows"]


def _assert_sweep(rows, names, sizes, peer_name):
    assert sorted({row["size_bytes"] for row in rows}) == sizes
    for size in sizes:
        at_size = {row["name"]: row for row in rows if row["size_bytes"] == size}
        assert set(at_size) == set(names) | {peer_name}, size
        assert at_size[peer_name]["peer"] and at_size[peer_name]["backend"] == "gloo"
        for row in at_size.values():
            assert row["check"] == "OK", row
            assert row["time_us"] > 0 and row["busbw_gbps"] > 0, row
            assert row["algbw_gbps"] == pytest.approx(size / (row["time_us"] * 1e-6) / 1e9)
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (2 - 1) / 2)
            assert row["count"] * 4 == size and row["world_size"] == 2
            if not row["peer"]:
                assert row["vs_peer"] == pytest.approx(
                    row["busbw_gbps"] / at_size[peer_name]["busbw_gbps"])


def _png_size(path: Path):
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_shm_barrier_holds_everyone_and_leaves_nothing(tmp_path):
    """3 threads as ranks, 50 barriers: nobody leaves barrier k before everybody entered it;
    the file is gone once it is made; a missing rank is a timeout, not a hang."""
    import threading

    from pycomm.bench.shm_barrier import ShmBarrier

    n, rounds = 3, 50
    shared, made = {}, threading.Barrier(n)
    events, lock = [], threading.Lock()

    def broadcast(value):
        if value is not None:
            shared["path"] = value
        made.wait()
        return shared["path"]

    def rank(r, barriers):
        barriers[r] = ShmBarrier(r, n, broadcast, made.wait, timeout_s=30)
        for k in range(rounds):
            with lock:
                events.append((k, "in"))
            barriers[r]()
            with lock:
                events.append((k, "out"))

    barriers = [None] * n
    threads = [threading.Thread(target=rank, args=(r, barriers)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not os.path.exists(shared["path"])
    for k in range(rounds):
        last_in = max(i for i, e in enumerate(events) if e == (k, "in"))
        first_out = min(i for i, e in enumerate(events) if e == (k, "out"))
        assert last_in < first_out, k
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] did not arrive"):
        barriers[0]._timeout_s = 0.2
        barriers[0]()  # the others never come
    for b in barriers:
        b.close()


@requires_backend
def test_cli_pycomm_vs_gloo(tmp_path):
    out = tmp_path / "out.json"
    plot = tmp_path / "plots" / "out.png"
    args = ["-n", "2", "-b", "8", "-e", "64K", "-f", "8", "--iters", "3", "--warmup", "1",
            "--json", str(out), "--plot", str(plot)]
    proc = _run_module("pycomm.bench", args, tmp_path, timeout=_CLI_TIMEOUT_S)
    assert proc.returncode == 0, _describe(proc)
    meta, rows = _load_rows(out)
    assert meta["world_size"] == 2 and meta["backend"] == "pycomm" and meta["memcpy_gbps"] > 0
    _assert_sweep(rows, ["auto", "ring", "tree", "sharded"], [8, 64, 512, 4096, 32768, 65536], "gloo")
    assert "memcpy" in proc.stdout and "busbw" in proc.stdout and "# check: OK" in proc.stdout
    # --plot adds a PNG and nothing else: the JSON has exactly the rows above, no MPI.
    assert all("vs_mpi" not in row for row in rows) and "mpi" not in meta
    assert _png_size(plot) == (1430, 572) and plot.stat().st_size > 20_000
    assert f"# plot: {plot}" in proc.stdout


def test_cli_compressed_columns(tmp_path, monkeypatch, capfd):
    """--algos topk1%,quant8: a DDP hook's exchange of one bucket per call, timed beside
    the dense algorithms; lossy, so its check is SKIP while the dense columns are
    checked; the result is the average of the ranks' buffers, to the codec's error."""
    out = tmp_path / "out.json"
    args = ["-n", "2", "-b", "64K", "-e", "1M", "-f", "16", "--iters", "3", "--warmup", "1",
            "--algos", "ring,topk1%,quant8", "--peer", "none", "--json", str(out)]
    proc = _run_cli(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    meta, rows = _load_rows(out)
    assert meta["algos"] == ["ring", "topk1%", "quant8"]
    for size in (65536, 1 << 20):
        at_size = {row["name"]: row for row in rows if row["size_bytes"] == size}
        assert set(at_size) == {"ring", "topk1%", "quant8"}, at_size
        assert at_size["ring"]["check"] == "OK"
        for name in ("topk1%", "quant8"):
            assert at_size[name]["check"] == "SKIP" and at_size[name]["time_us"] > 0, at_size[name]
    assert "# check: OK" in proc.stdout


def _compressed_runner_worker(ctx):
    out = {}
    for name in ("quant8", "topk1%"):
        kind, value = runners.compressed_spec(name)
        runner = runners.CompressedRunner(name, kind, value, dist.ReduceOp.SUM)
        buffer = torch.zeros(4096)  # the column ignores what is in it: it copies its gradient in
        runner.call(buffer)
        out[name] = buffer
    return out


def test_compressed_runner_averages():
    """The column's call is the hook's average of the ranks' gradient-like buffers
    (normal values seeded by rank and size): 8-bit is their mean to within the codec's
    step; top-k sends about 1% of the entries, the same result on both ranks."""
    from mp_util import spawn_run

    results = spawn_run(_compressed_runner_worker, 2, timeout_s=120).check().returns
    grads = [torch.randn(4096, generator=torch.Generator().manual_seed(1000003 * r + 4096)) for r in range(2)]
    mean = (grads[0] + grads[1]) / 2
    scale = max(g.abs().max().item() for g in grads)
    for r in range(2):
        q = results[r]["quant8"]
        # stochastic rounding: at most a step of each rank's codes (max |x| / 127 per block)
        # and of the owner's requantized sum (up to twice that), halved by the average
        assert torch.allclose(q, mean, atol=(2 * scale / 127 + 2 * scale / 127) / 2), (q - mean).abs().max()
        t = results[r]["topk1%"]
        kept = int((t != 0).sum())
        assert 0 < kept <= 2 * 41 and torch.equal(t, results[0]["topk1%"]), kept
        assert t.abs().max() > 0.5 * mean.abs().max()  # the largest entries go first


@requires_backend
def test_cli_tcp_reference_line(tmp_path, monkeypatch, capfd):
    """--tcp-reference: raw TCP between the same ranks in the ring's pattern, measured in
    the same run, printed as the reference for busbw and kept in the JSON."""
    out = tmp_path / "out.json"
    args = ["-n", "2", "-b", "64K", "-e", "256K", "-f", "4", "--iters", "2", "--warmup", "1",
            "--algos", "ring", "--peer", "none", "--tcp-reference", "--json", str(out)]
    proc = _run_cli(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    meta, _ = _load_rows(out)
    rates = meta["tcp_ring_rates"]
    assert len(rates) == 2 and all(r > 0.01 for r in rates), rates  # > 10 MB/s: bytes really moved
    assert meta["tcp_ring_gbps"] == min(rates)
    assert "# raw TCP, ring pattern" in proc.stdout, proc.stdout
    assert "% of raw TCP" in proc.stdout, proc.stdout
    # Off by default on the default transport: no reference, nothing printed.
    out2 = tmp_path / "out2.json"
    proc = _run_cli(args[:-3] + ["--json", str(out2)], tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    assert _load_rows(out2)[0]["tcp_ring_gbps"] is None and "raw TCP" not in proc.stdout


@requires_backend
def test_cli_tcp_reference_uses_the_groups_streams(tmp_path, monkeypatch, capfd):
    """#16 item 1: the reference runs over as many streams per peer and I/O threads as
    the pycomm group (PYCOMM_SOCKETS_PER_PEER / PYCOMM_IO_THREADS), not one stream."""
    out = tmp_path / "out.json"
    args = ["-n", "2", "-b", "64K", "-e", "64K", "--iters", "2", "--warmup", "1",
            "--algos", "ring", "--peer", "none", "--tcp-reference", "--json", str(out)]
    proc = _run_cli(args, tmp_path, monkeypatch, capfd,
                    extra_env={"PYCOMM_SOCKETS_PER_PEER": "3", "PYCOMM_IO_THREADS": "2"})
    assert proc.returncode == 0, _describe(proc)
    meta, _ = _load_rows(out)
    assert meta["tcp_ring_streams"] == [3, 2] and meta["tcp_streams"] == [3, 2], meta
    assert all(r > 0.01 for r in meta["tcp_ring_rates"]), meta["tcp_ring_rates"]
    assert "each rank 3 stream(s) out + 3 in at once, 2 thread(s), sendfile" in proc.stdout, proc.stdout


@pytest.mark.parametrize("streams,threads,send", [(1, 1, "sendfile"), (3, 2, "sendfile"), (2, 4, "sendfile"),
                                                  (2, 2, "copy")])
def test_link_pump_drives_every_stream(streams, threads, send, monkeypatch):
    """Every stream is sent on, ended and read to its end, whichever thread pumps it and
    however it sends (PYCOMM_BENCH_LINK_SEND): a stream left out would leave its
    receiving end open (recv times out)."""
    import socket

    from pycomm.bench import link

    monkeypatch.setenv("PYCOMM_BENCH_LINK_SEND", send)

    server = socket.create_server(("127.0.0.1", 0), backlog=streams)
    outgoing = [socket.create_connection(server.getsockname(), timeout=10) for _ in range(streams)]
    incoming = [server.accept()[0] for _ in range(streams)]
    server.close()
    try:
        received, elapsed = link._pump_threads(outgoing, incoming, 0.2, threads)
        assert received > 0 and 0 < elapsed < 10, (received, elapsed)
        for sock in incoming:
            sock.settimeout(5)
            assert sock.recv(1) == b"", "a stream was not ended"  # its sender shut it down
    finally:
        for sock in outgoing + incoming:
            sock.close()


def test_link_send_mode_is_checked(monkeypatch):
    from pycomm.bench import link

    monkeypatch.setenv("PYCOMM_BENCH_LINK_SEND", "splice")
    with pytest.raises(ValueError, match="sendfile or copy"):
        link._send_mode()


def _synthetic_result(with_mpi=True):
    sizes = [8, 1024, 2 ** 20]
    rows = []
    for size in sizes:
        for name, backend, peer, t_us in (("ring", "pycomm", False, 100.0), ("tree", "pycomm", False, 80.0),
                                          ("gloo", "gloo", True, 300.0)):
            t = t_us * 1e-6 * (1 + size / 2 ** 16)
            algbw = bench.alg_bandwidth(size, t)
            rows.append({"size_bytes": size, "name": name, "backend": backend, "peer": peer,
                         "time_us": t * 1e6, "algbw_gbps": algbw,
                         "busbw_gbps": bench.bus_bandwidth(algbw, 2), "check": "OK"})
    meta = {"op": "sum", "dtype": "float32", "world_size": 2, "hostname": "h", "date": "d",
            "memcpy_gbps": 10.0}
    result = bench.BenchResult(meta=meta, rows=rows, ok=True)
    if not with_mpi:
        return result
    mpi_rows = [{"size_bytes": size, "name": "mpi", "backend": "openmpi", "peer": True,
                 "time_us": 20.0 * (1 + size / 2 ** 16), "check": "OK",
                 "algbw_gbps": size / (20e-6 * (1 + size / 2 ** 16)) / 1e9} for size in sizes]
    for row in mpi_rows:
        row["busbw_gbps"] = row["algbw_gbps"]
    return bench.join_mpi(result, bench.BenchResult(meta={"mpi_library": "Open MPI"},
                                                    rows=mpi_rows, ok=True))


def test_join_mpi_adds_rows_and_ratios():
    joined = _synthetic_result()
    assert joined.ok and joined.meta["mpi"] == {"mpi_library": "Open MPI"}
    assert [row["size_bytes"] for row in joined.rows] == sorted(row["size_bytes"] for row in joined.rows)
    for size in (8, 1024, 2 ** 20):
        at = {row["name"]: row for row in joined.rows if row["size_bytes"] == size}
        assert list(at) == ["ring", "tree", "gloo", "mpi"]  # column order kept within a size
        for name in ("ring", "tree"):
            assert at[name]["vs_mpi"] == pytest.approx(at[name]["busbw_gbps"] / at["mpi"]["busbw_gbps"])
        assert "vs_mpi" not in at["gloo"] and "vs_mpi" not in at["mpi"]
    failed = bench.join_mpi(_synthetic_result(False), bench.BenchResult(meta={}, rows=[], ok=False))
    assert not failed.ok


def test_write_plot_is_a_png_and_leaves_the_result_alone(tmp_path):
    result = _synthetic_result()
    before = copy.deepcopy(result.to_json())
    path = tmp_path / "sub" / "peers.png"
    bench.write_plot(result, str(path))
    assert result.to_json() == before
    assert _png_size(path) == (1430, 572) and 20_000 < path.stat().st_size < 2_000_000


def test_mpi_missing_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "mpirun (Debian: apt-get install openmpi-bin" in bench.mpi_unavailable_reason()
    assert bench.main(["-n", "2", "--mpi", "-e", "64"]) == 1
    assert "pycomm bench: --mpi: needs mpirun" in capsys.readouterr().err


@requires_mpi
@requires_backend
def test_cli_mpi_peer_in_one_table(tmp_path):
    out = tmp_path / "peers.json"
    plot = tmp_path / "peers.png"
    args = ["-n", "2", "-b", "8", "-e", "64K", "-f", "8", "--iters", "3", "--warmup", "1",
            "--algos", "ring", "--mpi", "--json", str(out), "--plot", str(plot), "--timing", "barrier"]
    proc = _run_module("pycomm.bench", args, tmp_path, timeout=_CLI_TIMEOUT_S)
    assert proc.returncode == 0, _describe(proc)
    meta, rows = _load_rows(out)
    sizes = [8, 64, 512, 4096, 32768, 65536]
    # --timing reaches both sweeps (torch ranks and mpirun), and every row says how it was timed.
    assert meta["timing"] == "barrier" and meta["mpi"]["timing"] == "barrier"
    assert {row["timing"] for row in rows} == {"barrier"}
    # Every rank spawned here or under mpirun reads one clock: each row has the barrier's
    # exit skew, a median of non-negative spreads, and the table prints it per column.
    assert all(row["barrier_skew_us"] is not None and row["barrier_skew_us"] >= 0 for row in rows)
    skew_table = proc.stdout.split("# barrier exit skew")[-1].splitlines()
    assert skew_table[1].split() == ["#", "size(B)", "ring", "gloo", "mpi"]
    assert [int(line.split()[0]) for line in skew_table[2:2 + len(sizes)]] == sizes
    assert "--timing barrier" in meta["mpi"]["command"]
    assert proc.stdout.count("a barrier on the control group, then one timed call") == 2
    assert meta["mpi"]["world_size"] == 2 and "Open MPI" in meta["mpi"]["mpi_library"]
    mpi_rows = [row for row in rows if row["name"] == "mpi"]
    assert [row["size_bytes"] for row in mpi_rows] == sizes
    for row in mpi_rows:
        assert row["check"] == "OK" and row["backend"] == "openmpi" and row["time_us"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
        ring = next(r for r in rows if r["name"] == "ring" and r["size_bytes"] == row["size_bytes"])
        assert ring["vs_mpi"] == pytest.approx(ring["busbw_gbps"] / row["busbw_gbps"])
    _assert_sweep([row for row in rows if row["name"] != "mpi"], ["ring"], sizes, "gloo")
    assert "# all peers, one run" in proc.stdout and "# check: OK (pycomm and MPI" in proc.stdout
    table = proc.stdout.split("# all peers, one run")[1].split("# barrier exit skew")[0].splitlines()
    assert table[3].split() == ["#", "size(B)"] + ["ring", "gloo", "mpi"] * 2 + ["gloo", "mpi"]
    assert len([line for line in table if line.startswith(" ")]) == len(sizes)
    assert _png_size(plot) == (1430, 572)


@requires_mpi
def test_mpi_script_under_mpirun(tmp_path):
    """benchmarks/mpi_allreduce.py as documented: mpirun -np 3, int32 max, JSON rows."""
    out = tmp_path / "mpi.json"
    script = os.path.join(_PACKAGE_ROOT, "benchmarks", "mpi_allreduce.py")
    cmd = ["mpirun", "--oversubscribe", "-np", "3", sys.executable, script, "-b", "4", "-e", "4K",
           "-f", "32", "--iters", "2", "--warmup", "0", "--dtype", "int32", "--op", "max",
           "--json", str(out), "--timing", "shm-barrier"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} hung: {exc.stdout}\n{exc.stderr}", pytrace=False)
    assert proc.returncode == 0, _describe(proc)
    data = json.loads(out.read_text())
    assert data["ok"] and data["meta"]["world_size"] == 3 and data["meta"]["op"] == "max"
    assert [row["size_bytes"] for row in data["rows"]] == [4, 128, 4096]
    for row in data["rows"]:
        assert row["check"] == "OK" and row["name"] == "mpi"
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * 2 / 3)
        assert row["timing"] == "shm-barrier" and row["barrier_skew_us"] >= 0
    assert "# check: OK" in proc.stdout


@requires_backend
def test_cli_auto_int32_max(tmp_path, monkeypatch, capfd):
    out = tmp_path / "auto.json"
    args = ["-n", "2", "-b", "1K", "-e", "1M", "-f", "32", "--iters", "2", "--warmup", "0",
            "--algos", "auto,ring", "--dtype", "int32", "--op", "max", "--json", str(out),
            "--timing", "shm-barrier"]
    proc = _run_cli(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    meta, rows = _load_rows(out)
    assert meta["timing"] == "shm-barrier" and "benchmark's own shared-memory barrier" in proc.stdout
    assert all(row["barrier_skew_us"] >= 0 for row in rows), rows
    assert sorted({row["size_bytes"] for row in rows}) == [1024, 32768, 1048576]
    auto_rows = [row for row in rows if row["name"] == "auto"]
    assert len(auto_rows) == 3
    # one host: auto takes the shared-memory path (the TCP algorithms with PYCOMM_TRANSPORT=tcp)
    assert all(row["selected"] in ("ring", "tree", "sharded", "shm") for row in auto_rows), auto_rows
    assert all(row["check"] == "OK" for row in rows), rows


def test_cli_harness_on_gloo(tmp_path, monkeypatch, capfd):
    """The harness itself, with gloo as the backend under test (independent of pycomm's core)."""
    out = tmp_path / "gloo.json"
    args = ["-n", "2", "-b", "8", "-e", "64K", "-f", "8", "--iters", "3", "--warmup", "1",
            "--backend", "gloo", "--json", str(out)]
    proc = _run_cli(args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    _, rows = _load_rows(out)
    _assert_sweep(rows, ["gloo"], [8, 64, 512, 4096, 32768, 65536], "peer:gloo")


@pytest.mark.slow
@requires_backend
def test_demo(tmp_path):
    proc = _run_module("pycomm.demo", ["--steps", "10"], tmp_path, timeout=_DEMO_TIMEOUT_S)
    assert proc.returncode == 0, _describe(proc)
    assert "parameters identical on all ranks: OK" in proc.stdout, _describe(proc)
    assert "matches the same training on gloo: OK" in proc.stdout, _describe(proc)
    assert "# check: OK" in proc.stdout, _describe(proc)


def _run_script(name, args, tmp_path, monkeypatch, capfd) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py ARGS``'s main() in this process (mp_util.run_main_here);
    the script's own ranks are spawned, as they are for a user."""
    from mp_util import run_main_here

    monkeypatch.syspath_prepend(os.path.join(_PACKAGE_ROOT, "benchmarks"))  # the ranks import it too
    return run_main_here(__import__(name).main, args, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd,
                         timeout_s=_CLI_TIMEOUT_S, name=f"benchmarks/{name}.py")


@requires_backend
def test_call_cost_script_reports_every_rank(tmp_path, monkeypatch, capfd):
    """benchmarks/call_cost.py: one line per rank with the call's CPU, faults and the
    bytes that arrived before their receive."""
    proc = _run_script("call_cost", ["--algo", "sharded", "--mib", "1", "--ranks", "2", "--iters", "2"],
                       tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], proc.stdout
    assert all("arrived before their receive" in line and "sys" in line for line in lines), proc.stdout
    # As documented, through python (a usage error: the script imports torch only after it).
    script = os.path.join(_PACKAGE_ROOT, "benchmarks", "call_cost.py")
    bad = subprocess.run([sys.executable, script, "--ranks", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ranks must be >= 2" in bad.stderr
    # Ranks that fail (here: an algorithm that does not exist) end the script at once,
    # rather than leaving it waiting 300 s for their reports.
    start = time.monotonic()
    failed = _run_script("call_cost", ["--algo", "nosuch", "--mib", "1", "--iters", "1"], tmp_path, monkeypatch, capfd)
    assert failed.returncode == 1 and "exited before reporting" in failed.stderr, _describe(failed)
    assert "PYCOMM_ALGO='nosuch'" in failed.stderr and time.monotonic() - start < 60, _describe(failed)


@requires_backend
def test_latency_floor_script_prints_each_kind(tmp_path, monkeypatch, capfd):
    """benchmarks/latency_floor.py: the torch op, pycomm's group of one, the all-reduce
    (whose result it checks) and the floor of twice the group of one, as documented."""
    proc = _run_script("latency_floor", ["--ranks", "2", "--iters", "20", "--warmup", "5", "--no-mpi"],
                       tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    figures = {}
    for line in proc.stdout.splitlines():
        label, _, value = line.rpartition(" ")
        if label.strip() and not line.startswith("#") and value.replace(".", "", 1).isdigit():
            figures[label.strip()] = float(value)
    assert set(figures) == {"torch op (x.add_(0))", "pycomm group of one", "pycomm all-reduce",
                            "floor (2 x group of one)"}, proc.stdout
    assert figures["floor (2 x group of one)"] == pytest.approx(2 * figures["pycomm group of one"], abs=0.11)
    assert all(v > 0 for v in figures.values()), proc.stdout
    assert "# Open MPI: skipped (--no-mpi)" in proc.stdout, proc.stdout
    bad = _run_script("latency_floor", ["--ranks", "1"], tmp_path, monkeypatch, capfd)
    assert bad.returncode == 2 and "--ranks must be >= 2" in bad.stderr, _describe(bad)


@requires_backend
def test_call_cost_threads_names_pycomm_threads(tmp_path, monkeypatch, capfd):
    """call_cost.py --threads: each rank's CPU per call by thread name, where the TCP
    transport's I/O thread shows under the name pycomm gives it (pycomm-io0) and the
    caller's thread, which runs a blocking all-reduce, shows too."""
    proc = _run_script("call_cost", ["--algo", "ring", "--mib", "4", "--ranks", "2", "--iters", "3", "--threads"],
                       tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    lines = [line for line in proc.stdout.splitlines() if " threads: " in line]
    assert [line.split(" threads:")[0] for line in lines] == ["rank 0", "rank 1"], proc.stdout
    for line in lines:
        entry = re.compile(r"(\S+?)(?: x\d+)? ([\d.]+) ms \(\d+%(?:, \d+% in the kernel)?\)")
        found = entry.findall(line.split(": ", 1)[1])
        assert entry.sub("", line.split(": ", 1)[1]).replace(", ", "") == "", line  # nothing else
        entries = dict(found)
        assert float(entries.get("pycomm-io0", 0)) > 0, line  # 4 MiB each way goes through it
        assert float(entries.get("caller", 0)) > 0, line  # the blocking call runs (and reduces) there
