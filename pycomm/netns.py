"""Several "hosts" on one machine: Linux network namespaces on a private bridge.

Used by ``pycomm-bench --hosts N`` and by the multi-host tests (``tests/netns_util.py``
re-exports this module). Needs root and iproute2 (``ip``; ``tc`` for ``rate``).

    with NetnsHosts(3) as hosts:
        hosts.names      # ["pcmh<pid36>x<k>h0", ...]  namespace per host
        hosts.addrs      # ["10.231.7.1", "10.231.7.2", ...]
        hosts.ifname     # interface name inside every namespace ("pceth0")
        hosts.run(0, ["ss", "-ltn"])      # a command inside host 0

Layout: one bridge in the root namespace (no address there, so nothing in the
root namespace can reach the test subnet), one veth pair per host with the
host end moved into the host's namespace and renamed ``pceth0``, address
10.231.7.<k+1>/24, ``lo`` up. Each run uses its own bridge, so two concurrent
runs may share the subnet without seeing each other.

Names carry the creating process id (``pcmh<pid in base 36>x...``); on creation,
leftovers of a crashed earlier run (a ``pcmh`` prefix whose pid is no longer
alive) are removed, and ``close()`` (always reached through try/finally or the
context manager) kills the processes still inside our namespaces and deletes
the veths, the namespaces and the bridge.

A process enters a namespace with ``enter_netns(name)`` (setns(2) through
ctypes); it must do so before it creates sockets or the threads that will (threads
made later by the same thread inherit the namespace). Or it is started inside one:
``hosts.popen(k, argv)`` runs ``ip netns exec``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import time

__all__ = ["NetnsHosts", "netns_unavailable_reason", "enter_netns", "cleanup_leftovers", "run_bounded", "kill_tree",
           "descendants", "pid_prefix", "PREFIX", "IFNAME", "SUBNET"]

PREFIX = "pcmh"
IFNAME = "pceth0"  # the host's interface name inside every namespace
SUBNET = "10.231.7"  # /24, exists only on our private bridges
CLONE_NEWNET = 0x40000000
# tc tbf's bucket on each host's egress when a rate is set ("kb": 1024 bytes to tc);
# pycomm.plan models it (link_burst) in its validation.
TBF_BURST_BYTES = 256 * 1024
TBF_BURST = f"{TBF_BURST_BYTES // 1024}kb"
_counter = itertools.count()


def _ip(*args, check=True, timeout=20):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_unavailable_reason() -> str | None:
    """None when namespaces can be created here, else why not (for pytest.skip)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (this process is not uid 0)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        proc = _ip("netns", "add", probe, check=False)
        if proc.returncode != 0:
            return f"`ip netns add` failed: {proc.stderr.strip()}"
        proc = _ip("link", "add", probe[:15], "type", "bridge", check=False)
        if proc.returncode != 0:
            return f"cannot create a bridge: {proc.stderr.strip()}"
    finally:
        _ip("link", "del", probe[:15], check=False)
        _ip("netns", "del", probe, check=False)
    return None


def enter_netns(name: str) -> None:
    """Move the calling thread (call it first thing in a process) into netns ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> None:
    proc = _ip("netns", "pids", ns, check=False)
    for tok in proc.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


_NAME_RE = re.compile(rf"^{PREFIX}([0-9a-z]+)x")


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def pid_prefix(pid: int) -> str:
    """The prefix of every namespace and link name made by process ``pid``."""
    return f"{PREFIX}{_b36(pid)}x"


def cleanup_leftovers() -> list:
    """Remove namespaces and links of earlier runs whose creator is dead."""
    removed = []
    nss = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, re.M)
    for ns in nss:
        m = _NAME_RE.match(ns)
        if m and not _pid_alive(int(m.group(1), 36)):
            _kill_netns_pids(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for link in links:
        m = _NAME_RE.match(link)
        if m and not _pid_alive(int(m.group(1), 36)):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


class NetnsHosts:
    """``n`` hosts (namespaces) on a private bridge; see the module docstring."""

    def __init__(self, n: int, *, rate: str | None = None):
        if n < 1 or n > 200:
            raise ValueError("1 <= n <= 200")
        self.n = n
        self.ifname = IFNAME
        # pid + per-process counter: unique among live runs; <= 15 chars for links
        self.tag = f"{pid_prefix(os.getpid())}{_b36(next(_counter))}"
        if len(self.tag) + 1 + len(str(n - 1)) > 15:
            raise RuntimeError(f"tag {self.tag!r} too long for interface names")
        self.bridge = f"{self.tag}br"
        self.names = [f"{self.tag}h{k}" for k in range(n)]
        self.veths = [f"{self.tag}v{k}" for k in range(n)]
        self.addrs = [f"{SUBNET}.{k + 1}" for k in range(n)]
        self.rate = rate
        self._created = False

    def create(self) -> "NetnsHosts":
        cleanup_leftovers()
        self._created = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for ns, veth, addr in zip(self.names, self.veths, self.addrs):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", self.ifname, "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.ifname)
                _ip("-n", ns, "link", "set", self.ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate:
                    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.ifname, "root",
                                    "tbf", "rate", self.rate, "burst", TBF_BURST, "latency", "50ms"],
                                   check=True, capture_output=True, timeout=20)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if not self._created:
            return
        self._created = False
        for ns in self.names:
            _kill_netns_pids(ns)
        for veth in self.veths:
            _ip("link", "del", veth, check=False)
        for ns in self.names:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        # veth removal after a namespace deletion is asynchronous; wait a little
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.tag in _ip("-o", "link", "show", check=False).stdout:
            time.sleep(0.1)

    def leftovers(self) -> list:
        """Anything of this instance still present (empty after close())."""
        nss = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return sorted(set(re.findall(rf"{re.escape(self.tag)}\w*", nss + links)))

    def cmd(self, host: int, argv: list) -> list:
        """argv prefixed to run inside host ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def run(self, host: int, argv: list, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(host, argv), capture_output=True, text=True, timeout=timeout, **kw)

    def popen(self, host: int, argv: list, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(host, argv), **kw)

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.close()
        return False


# ---------------------------------------------------------------------------
# bounded subprocess runs (torchrun starts its workers in sessions of their own,
# so killing torchrun's process group would leave them behind)
# ---------------------------------------------------------------------------

def descendants(pid: int) -> list:
    """All live descendants of ``pid`` (children first found via /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            pass
    return out


def run_bounded(argv, timeout: float, **kw) -> tuple:
    """subprocess.run(argv) with stdout+stderr merged into one text; at the
    deadline, SIGTERM the process, then SIGKILL it and every descendant.
    Returns (returncode or None on timeout, output)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        return None, (out or "") + f"\n[run_bounded: killed after {timeout:.0f} s]"


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    tree = descendants(proc.pid)
    try:
        proc.terminate()
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid] + tree + descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
