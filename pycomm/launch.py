"""Process launcher shared by ``pycomm-bench``, ``pycomm-train`` and the demo.

A *worker* is a module-level function ``worker(rank, world_size, init_method, payload)``.
:func:`launch_workers` runs it on every rank and returns rank 0's result: under
``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) the calling process is one rank and joins
through ``env://``; otherwise it starts the ranks on this host, which rendezvous through a
``file://`` store in a directory only this user can read (no port to pick, so none to race
for or to be read by other local users), and draws a job secret (``PYCOMM_SECRET``) for
them unless one is set. pycomm never brings its own cluster manager: multi-machine runs go
through torchrun.

Local ranks are forks of a multiprocessing *fork server* that has imported torch and
pycomm once (started on the first launch, kept for the next ones), not fresh interpreters
that each import torch (about 2 s of CPU a rank). A rank gets what a spawned one would:
the launching process's environment as it is at the call, its stdout and stderr, its
``sys.path`` and working directory. Variables that act only when a library loads
(``LD_*``, ``PYTHON*``, ``OMP_*``, ``KMP_*``, ``MKL_*``, ``GOMP_*``, ``TORCH_*``) are read
by the server when it starts: a later launch whose values differ from those starts its
ranks with spawn instead.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import secrets
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

__all__ = ["launch_workers", "start_ranks", "torchrun_env"]


def torchrun_env() -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` when this process was started by torchrun (``RANK`` and
    ``WORLD_SIZE`` set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def run_rank(rank: int, world_size: int, init_method: str, worker: Callable, payload: Any,
             result_path: str, expected_errors: Tuple[str, ...]) -> int:
    """One rank of a launch: ``worker`` with torch's threads shared among the ranks of this
    host, rank 0's result pickled to ``result_path``. Returns the exit code: 1 (after one
    line naming the rank) for an expected usage error, 0 otherwise; other errors raise.
    Used by spawned ranks here and by the ranks pycomm-bench --hosts starts in namespaces."""
    if world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        result = worker(rank, world_size, init_method, payload)
    except (RuntimeError, ValueError) as exc:
        if not str(exc).startswith(expected_errors):
            raise
        print(f"{exc} (rank {rank})", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        tmp = result_path + ".tmp"
        with open(tmp, "wb") as handle:
            pickle.dump(result, handle)
        os.replace(tmp, result_path)
    return 0


# What the fork server imports once, before it forks any rank.
_PRELOAD = ["torch", "torch.distributed", "pycomm"]
# Variables that act only when a library loads (the fork server's libraries loaded when it
# started): ranks of a launch whose values differ from the server's are spawned.
_LOAD_TIME_PREFIXES = ("LD_", "PYTHON", "OMP_", "KMP_", "MKL_", "GOMP_", "TORCH_")
# The load-time variables the fork server started with (None: not started by a launch yet).
_server_env: Optional[dict] = None


def _load_time_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_LOAD_TIME_PREFIXES)}


def _rank_context(env):
    """The fork server's context, or spawn's where there is none or its load-time
    variables are not those of ``env`` (the ranks' environment)."""
    global _server_env
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    load_env = _load_time_env(env)
    if _server_env is None:
        _server_env = load_env
    elif load_env != _server_env:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts
    return ctx


class _ParentStreams:
    """The launching process's stdout and stderr, for a forked rank, whose own are the fork
    server's (those of whichever process started it, when it started). Pickled while the
    rank starts: the two descriptors travel with it (multiprocessing's DupFd)."""

    def __init__(self, handles=None):
        self._handles = handles

    def __reduce__(self):
        handles = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:
                handles.append(None)  # closed here: the rank keeps the server's
            else:
                handles.append(multiprocessing.reduction.DupFd(fd))
        return (_ParentStreams, (handles,))

    def attach(self) -> None:
        """In the rank: make the parent's descriptors its stdout and stderr."""
        for target, stream, handle in zip((1, 2), (sys.stdout, sys.stderr), self._handles or ()):
            if handle is None:
                continue
            fd = handle.detach()
            if stream is not None:
                stream.flush()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _spawn_entry(rank: int, world_size: int, init_method: str, worker: Callable,
                 payload: Any, result_path: str, expected_errors: Tuple[str, ...],
                 secret: Optional[str] = None, env: Optional[dict] = None,
                 streams: Optional[_ParentStreams] = None, netns: Optional[str] = None) -> None:
    if netns is not None:
        # First, before the rank starts a thread: threads inherit the namespace of the
        # thread that starts them. A session of its own: a terminal's Ctrl-C reaches the
        # launching process, which stops the ranks and removes the namespaces.
        from .netns import enter_netns

        enter_netns(netns)
        os.setsid()
    if streams is not None:
        streams.attach()
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if secret is not None:
        os.environ["PYCOMM_SECRET"] = secret
    code = run_rank(rank, world_size, init_method, worker, payload, result_path, expected_errors)
    if code:
        sys.exit(code)


def start_ranks(worker: Callable, nprocs: int, payload: Any, init_method: str, result_path: str,
                expected_errors: Sequence[str] = (), *, secret: Optional[str] = None, env: Optional[dict] = None,
                netns: Optional[Sequence[str]] = None) -> list:
    """Start ``nprocs`` ranks of ``worker`` (:func:`run_rank`) on this host, forks of the fork
    server (the module's docstring) or spawned; returns their ``multiprocessing.Process``
    objects (daemons), for the caller to wait on. ``env``: the ranks' environment (default:
    this process's, at the call); ``secret``: their ``PYCOMM_SECRET``; ``netns[rank]``: the
    network namespace rank ``rank`` enters first thing, in a session of its own
    (``pycomm-bench --hosts``)."""
    env = dict(os.environ if env is None else env)
    if _load_time_env(env) != _load_time_env(os.environ):
        raise ValueError("start_ranks: the ranks' environment must have this process's load-time variables "
                         f"({', '.join(p + '*' for p in _LOAD_TIME_PREFIXES)}): they act when a process starts")
    ctx = _rank_context(env)
    forked = ctx.get_start_method() == "forkserver"
    procs = []
    try:
        for rank in range(nprocs):
            proc = ctx.Process(
                target=_spawn_entry,
                args=(rank, nprocs, init_method, worker, payload, result_path, tuple(expected_errors), secret,
                      env, _ParentStreams() if forked else None, netns[rank] if netns else None),
                name=f"pycomm-rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs


def launch_workers(worker: Callable[[int, int, str, Any], Any], nprocs: int, payload: Any, *,
                   prefix: str = "pycomm launch:", expected_errors: Sequence[str] = ()) -> Any:
    """Run ``worker(rank, world_size, init_method, payload)`` on every rank; return rank 0's result.

    Under torchrun (``RANK``/``WORLD_SIZE`` set), the calling process is one
    rank: ``worker`` runs here with ``init_method="env://"`` and its own
    result is returned. Otherwise ``nprocs`` processes are started on this
    host (forks of the fork server: the module's docstring), rendezvous through a
    ``file://`` store in a private temporary directory
    (with a fresh ``PYCOMM_SECRET`` unless ``PYCOMM_SECRET`` or ``PYCOMM_SECRET_FILE``
    is set), and rank 0's return value (which must pickle) comes back. If a
    worker dies, the others are terminated and ``RuntimeError`` (its message
    starting with ``prefix``) is raised. A started worker's ``RuntimeError`` or
    ``ValueError`` whose message starts with one of ``expected_errors`` is printed
    as one line naming the rank, without a traceback. ``worker`` must be a
    module-level function.
    """
    env = torchrun_env()
    if env is not None:
        rank, world_size = env
        return worker(rank, world_size, "env://", payload)

    with tempfile.TemporaryDirectory(prefix="pycomm-launch-") as tmpdir:
        # mkdtemp makes the directory 0700: only this user reads the store (and the result).
        init_method = "file://" + os.path.join(tmpdir, "store")
        result_path = os.path.join(tmpdir, "result.pkl")
        # A secret of our own unless the user chose one (both set would be an error).
        own_secret = ("PYCOMM_SECRET" not in os.environ and "PYCOMM_SECRET_FILE" not in os.environ)
        secret = secrets.token_hex(32) if own_secret else None
        procs = start_ranks(worker, nprocs, payload, init_method, result_path, expected_errors, secret=secret)
        try:
            pending = {proc.sentinel: rank for rank, proc in enumerate(procs)}
            while pending:
                for sentinel in multiprocessing.connection.wait(list(pending)):
                    rank = pending.pop(sentinel)
                    procs[rank].join()
                    code = procs[rank].exitcode
                    if code != 0:
                        raise RuntimeError(f"{prefix} rank {rank} exited with code {code}")
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if not os.path.exists(result_path):
            raise RuntimeError(f"{prefix} rank 0 finished without a result")
        with open(result_path, "rb") as handle:
            return pickle.load(handle)
