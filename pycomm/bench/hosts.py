"""``pycomm-bench --hosts N``: the benchmark across network namespaces, one per "host".

Run as root, the benchmark makes ``N`` hosts on this machine itself
(:class:`pycomm.netns.NetnsHosts`: a namespace each, a veth into a private bridge,
optionally ``tc tbf`` at ``--rate`` on each host's egress), starts ``--ranks-per-host``
ranks inside each (:func:`pycomm.launch.start_ranks`: forks of the launcher's fork server,
each entering its host's namespace with setns(2) first thing; unlike ``ip netns exec``, which
gives a process a mount namespace of its own, the ranks of one host share the mount namespace
and so count as one host for shared memory), runs the usual sweep (:func:`pycomm.bench.harness.bench_worker`: every
pycomm algorithm and gloo on the same buffers, and, with one rank per host, the raw-TCP
reference of :mod:`pycomm.bench.link` between the same addresses) and removes everything again:
on success, on error, on SIGINT and on SIGTERM (a SIGKILL leaves namespaces that the
next run removes: their names carry the creator's pid).

Ranks rendezvous through a ``tcp://`` store on host 0's address, with a job secret
(``PYCOMM_SECRET``) drawn for the run unless ``PYCOMM_SECRET`` or ``PYCOMM_SECRET_FILE``
is set, as :func:`pycomm.launch.launch_workers` does: pycomm's connections then prove
the secret, not store access (docs/failures.md); gloo and pycomm listen
on the namespace interface (``GLOO_SOCKET_IFNAME`` / ``PYCOMM_SOCKET_IFNAME``), so
every byte between hosts crosses the veths and the bridge, and ranks of one host talk
through shared memory (pycomm) or the host's own address (gloo, the TCP reference).

Open MPI is not run across the namespaces: ``mpirun`` starts its local ranks by
forking, all in its own namespace; spreading them would take a hostfile of the
namespace addresses, ``mpirun`` itself inside host 0 (the bridge has no address in
the root namespace) and an rsh agent that enters a namespace instead of ssh-ing.
``--hosts`` with ``--mpi`` is refused with that reason.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import shutil
import signal
import tempfile
import time
from typing import Callable, Optional

from .config import HOSTS_MPI_REASON, PREFIX, BenchConfig, BenchResult, size_sweep, valid_rate

__all__ = ["HOSTS_MPI_REASON", "hosts_unavailable_reason", "run_on_hosts", "valid_rate"]


# How often the parent looks at its ranks.
_POLL_S = 0.2


def hosts_unavailable_reason(rate: Optional[str] = None) -> Optional[str]:
    """Why ``--hosts`` cannot run here (not root, no ``ip``, no ``tc`` for a rate, namespaces
    refused), or None when it can."""
    from ..netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is None and rate and shutil.which("tc") is None:
        reason = "--rate needs tc (iproute2) and it is not installed"
    return reason


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM (and SIGHUP) raise SystemExit in the main thread while inside, so the
    finally blocks that remove the namespaces run; SIGINT already raises KeyboardInterrupt."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave the signals alone
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _rank_env(ifname: str) -> dict:
    """The ranks' environment: ours, the namespace interface for gloo and pycomm, never a
    torchrun rendezvous, and a fresh job secret unless the user chose one (both set would
    be an error); each call draws another."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["GLOO_SOCKET_IFNAME"] = ifname
    env["PYCOMM_SOCKET_IFNAME"] = ifname
    if "PYCOMM_SECRET" not in env and "PYCOMM_SECRET_FILE" not in env:
        env["PYCOMM_SECRET"] = secrets.token_hex(32)
    return env


def run_on_hosts(cfg: BenchConfig, worker: Callable) -> BenchResult:
    """Make ``cfg.hosts`` namespaces, run ``cfg.ranks_per_host`` ranks of ``worker`` (a
    module-level function, :func:`pycomm.launch.launch_workers`' kind: the sweep's
    ``harness.bench_worker``) in each, return rank 0's result; the namespaces and the ranks are gone when this returns or
    raises. Rank 0 prints the table to this process's stdout as it goes."""
    from ..launch import start_ranks
    from ..netns import NetnsHosts

    reason = hosts_unavailable_reason(cfg.rate)
    if reason:
        raise RuntimeError(f"{PREFIX} --hosts needs network namespaces: {reason}")
    world = cfg.hosts * cfg.ranks_per_host
    sizes = len(size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor))
    limit = cfg.timeout_s * (sizes + 2)  # each collective is bounded by timeout_s already
    hosts = NetnsHosts(cfg.hosts, rate=cfg.rate)
    procs = []
    with _sigterm_raises(), tempfile.TemporaryDirectory(prefix="pycomm-bench-hosts-") as tmpdir:
        try:
            hosts.create()
            result_path = os.path.join(tmpdir, "result.pkl")
            init_method = f"tcp://{hosts.addrs[0]}:29500"  # a fresh namespace: every port is free
            netns = [hosts.names[rank // cfg.ranks_per_host] for rank in range(world)]
            procs = start_ranks(worker, world, cfg, init_method, result_path, (PREFIX,), env=_rank_env(hosts.ifname),
                                netns=netns)
            _wait(procs, cfg, limit)
            if not os.path.exists(result_path):
                raise RuntimeError(f"{PREFIX} --hosts: rank 0 finished without a result")
            with open(result_path, "rb") as handle:
                return pickle.load(handle)
        finally:
            _stop(procs)
            hosts.close()


def _wait(procs: list, cfg: BenchConfig, limit: float) -> None:
    deadline = time.monotonic() + limit
    pending = dict(enumerate(procs))
    while pending:
        for rank, proc in list(pending.items()):
            code = proc.exitcode
            if code is None:
                continue
            del pending[rank]
            if code != 0:
                host = rank // cfg.ranks_per_host
                raise RuntimeError(f"{PREFIX} --hosts: rank {rank} (host {host}) exited with code {code}")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{PREFIX} --hosts: ranks {sorted(pending)} did not finish in {limit:.0f} s")
        time.sleep(_POLL_S)


def _stop(procs: list) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those still there 2 s later."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + 2.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()
