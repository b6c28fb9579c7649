"""``pycomm-bench --hosts N``: the benchmark across network namespaces it makes itself.

* usage errors and the message where namespaces cannot be made (in process, anywhere);
* end to end on 2 hosts x 2 ranks (a small sweep): pycomm and gloo rows, the ranks of a
  host sharing memory (hierarchical), the TCP reference, nothing of the run left behind;
* SIGTERM / SIGINT in the middle of a run: the ranks and the namespaces are removed
  (slow: a run each).

The end-to-end tests skip (with the reason) where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pycomm
from pycomm.bench import cli
from pycomm.netns import netns_unavailable_reason, pid_prefix

_PACKAGE_ROOT = str(Path(pycomm.__file__).resolve().parent.parent)
_TIMEOUT_S = 180
_UNAVAILABLE = netns_unavailable_reason()
requires_netns = pytest.mark.skipif(_UNAVAILABLE is not None,
                                    reason=f"--hosts needs network namespaces: {_UNAVAILABLE}")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _left_behind(pid: int) -> list:
    """Namespaces and links named by process ``pid`` that still exist."""
    prefix = pid_prefix(pid)
    text = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    text += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=20).stdout
    return sorted(set(re.findall(rf"{re.escape(prefix)}\w*", text)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------
# in process: usage, and where namespaces cannot be made
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--rate", "1gbit"], "need --hosts"),
    (["--ranks-per-host", "2"], "need --hosts"),
    (["--hosts", "0"], "--hosts must be at least 1"),
    (["--hosts", "2", "--ranks-per-host", "0"], "--ranks-per-host must be at least 1"),
    (["--hosts", "2", "-n", "3"], "makes 2 ranks, not -n 3"),
    (["--hosts", "2", "--rate", "fast"], "is not a tc rate"),
    (["--hosts", "2", "--mpi"], "--mpi is not supported with --hosts: mpirun forks"),
])
def test_hosts_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_hosts_world_size():
    cfg = cli.parse_args(["--hosts", "3", "--ranks-per-host", "2", "--rate", "1gbit"])
    assert (cfg.nprocs, cfg.hosts, cfg.ranks_per_host, cfg.rate) == (6, 3, 2, "1gbit")


@pytest.mark.parametrize("euid, which_ip, message", [
    (1000, "/usr/sbin/ip", "--hosts needs network namespaces: network namespaces need root"),
    (0, None, "--hosts needs network namespaces: iproute2 (`ip`) is not installed"),
])
def test_hosts_unavailable_is_a_clear_error(euid, which_ip, message, monkeypatch, capsys):
    """Not root, or no `ip`: one line saying so, exit code 1, nothing started."""
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: which_ip if name == "ip" else real_which(name))
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("started"))
    assert cli.main(["--hosts", "2", "-b", "8", "-e", "8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pycomm bench: " + message), err
    assert not started


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------

@requires_netns
def test_cli_hosts_two_end_to_end(tmp_path):
    """2 hosts x 2 ranks: the ranks of a host count as one host (hierarchical fits and auto
    takes it), every column checked, the TCP reference measured, nothing left behind."""
    out = tmp_path / "hosts.json"
    argv = [sys.executable, "-m", "pycomm.bench", "--hosts", "2", "--ranks-per-host", "2", "-b", "8",
            "-e", "4K", "-f", "8", "--iters", "2", "--warmup", "1", "--algos", "auto,ring,hierarchical",
            "--tcp-reference", "--json", str(out)]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        stdout, stderr = proc.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"pycomm-bench --hosts 2 hung for {_TIMEOUT_S} s:\n{stdout}\n{stderr}", pytrace=False)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stdout}\n{stderr}"
    assert not _left_behind(proc.pid), f"left behind: {_left_behind(proc.pid)}"
    assert "# hosts: 2 network namespaces" in stdout and "# check: OK" in stdout, stdout
    assert re.search(r"# raw TCP, ring pattern .*: \d+\.\d+ GB/s", stdout), stdout
    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["rows"]
    assert data["ok"] and meta["hosts"] == 2 and meta["ranks_per_host"] == 2 and meta["world_size"] == 4
    assert meta["host_ifname"] == "pceth0" and len(meta["tcp_ring_rates"]) == 4 and meta["tcp_ring_gbps"] > 0
    sizes = [8, 64, 512, 4096]
    names = {"auto", "ring", "hierarchical", "gloo"}
    for size in sizes:
        at = {row["name"]: row for row in rows if row["size_bytes"] == size}
        assert set(at) == names, (size, sorted(at))
        assert at["gloo"]["backend"] == "gloo" and at["gloo"]["peer"]
        assert all(row["check"] == "OK" and row["time_us"] > 0 for row in at.values()), at
        assert at["auto"]["selected"] == "hierarchical", at["auto"]
        # the table has this size's row with every column's time and the verdict
        line = next(l for l in stdout.splitlines() if l.split()[:1] == [str(size)])
        assert line.split()[-1] == "OK", line


@pytest.mark.slow
@requires_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_hosts_cleans_up_on_signal(sig, tmp_path):
    """A signal while the ranks run: the CLI stops them and removes its namespaces."""
    argv = [sys.executable, "-m", "pycomm.bench", "--hosts", "2", "-b", "8", "-e", "64M", "-f", "2"]
    # SIGINT as a terminal's Ctrl-C delivers it: a suite started as a background job (`cmd &`
    # in a script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt.
    proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        seen, deadline = "", time.monotonic() + _TIMEOUT_S
        # the first table row: every rank is in its namespace and has run a collective
        while not re.search(r"^\s+8\s+2\s+float32", seen, re.M) and time.monotonic() < deadline:
            if selector.select(timeout=1.0):
                line = proc.stdout.readline()
                if not line:
                    break
                seen += line
        assert re.search(r"^\s+8\s+2\s+float32", seen, re.M), f"no first row:\n{seen}"
        names = _left_behind(proc.pid)
        assert len([n for n in names if re.search(r"h\d+$", n)]) == 2, names
        ranks = []
        for ns in names:
            if re.search(r"h\d+$", ns):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                      timeout=20).stdout.split()
                ranks += [int(p) for p in pids]
        assert len(ranks) >= 2, (names, ranks)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, f"exit code 0 after {sig!r}\n{stderr}"
    assert not _left_behind(proc.pid), f"left behind after {sig!r}: {_left_behind(proc.pid)}\n{stderr}"
    assert not [p for p in ranks if _alive(p)], f"ranks still running after {sig!r}: {ranks}"
    if sig == signal.SIGINT:
        assert "pycomm bench: interrupted" in stderr, stderr
