"""Multi-process harness for the backend tests (not a test module).

``spawn_run(fn, world_size, backend=...)`` starts ``world_size`` processes
with the multiprocessing *forkserver* context, whose server has imported torch once
(``PYCOMM_TEST_START_METHOD=spawn`` starts every rank from a fresh interpreter
instead). Each child gets the parent's environment as it is at the call (as a spawned
one would), then ``env``. A run with a ``pre_init``, or whose env sets a variable that
acts only when a library loads (LD_*, PYTHON*, OMP_* but OMP_NUM_THREADS, ...), is
spawned; so are runs that ask for it (``start_method="spawn"``): a forked rank leaves
through os._exit, without atexit handlers or C++ static destructors. Each child

* optionally imports ``pycomm`` (registers the "pycomm" backend),
* creates the default process group with ``backend`` over a fresh rendezvous
  (file://, tcp:// or env://),
* also creates a gloo group over the same ranks (``ctx.ref``) so one run can
  compare the backend under test with gloo,
* calls ``fn(ctx, *args)`` and sends the pickled return value back,
* destroys the process group.

Each rank talks to the parent through a pipe of its own, one length-prefixed pickle per
message, written synchronously; the parent reads all pipes without blocking and
reassembles the messages. A rank that dies (SIGKILL, crash) half-way through a message
therefore costs only its own pipe: the parent notices the death, reports the rank (and
the message it was sending) and is never stuck in a read. (A shared
``multiprocessing.Queue`` is not safe here: a writer killed while holding its lock or
mid-message leaves the parent blocked reading forever.)

The parent enforces a hard wall-clock timeout: children still alive at the
deadline are killed and the failure names the ranks that hung together with
the last progress note each of them sent (``ctx.progress(...)``). Exceptions
in children come back with their tracebacks; a child that dies without
reporting (segfault, abort) is reported with its exit code.

``fn`` must be a module-level function (it is pickled by reference), and
anything it returns must be picklable. A rank started from a fresh interpreter spends
about 2 s of CPU importing torch; forked from the server it starts at once. Tests still
group many checks into one run: each run also pays the process group set-up.

Fork-server runs go to a pool of ranks that stay (see "the pool of ranks" below): a run
like the one before it (same world size, backend, init, ref, environment) reuses its
ranks when that one ended cleanly, and gets fresh ones otherwise. The deadline, the
pipes, the diagnosis of a hang and what ``fn`` sees are those of a fresh run.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import pytest

__all__ = ["WorkerContext", "RunResult", "spawn_run", "run_multiprocess", "free_port", "communicate_all",
           "process_context", "in_environment", "call_with_deadline", "run_main_here"]

# Default wall-clock limit for one spawned run (all ranks together).
DEFAULT_RUN_TIMEOUT_S = 180.0
# After one rank failed, how long the others get to finish before being killed.
GRACE_AFTER_ERROR_S = 20.0
# How long a rank may take to exit after it returned (destroy_process_group).
EXIT_GRACE_S = 20.0
# A message on a rank's pipe: its length, then the pickle.
_HEADER = struct.Struct("!Q")
# How ranks start: "forkserver" (the server imports these once; each rank is a fork of it)
# or "spawn" (a fresh interpreter per rank).
START_METHOD = os.environ.get("PYCOMM_TEST_START_METHOD", "forkserver")
# What every rank imports anyway: the test's module imports pytest and this module, which
# cost a forked rank more than its process group's set-up if each imported them itself.
_PRELOAD = ["torch", "torch.distributed", "pycomm", "numpy", "pytest", "mp_util"]
# Variables that act only when a library loads (torch and what it links are loaded in the
# fork server already): a run that sets one starts its ranks with spawn. OMP_NUM_THREADS
# is not among them: every rank calls torch.set_num_threads(1).
_LOAD_TIME_PREFIXES = ("LD_", "PYTHON", "KMP_", "MKL_", "GOMP_", "TORCH_", "OMP_")


def _start_method(requested, env_keys, pre_init):
    """spawn where a fork of the server would differ from a fresh interpreter: a ``pre_init``
    (it runs before torch is imported), or load-time variables in the run's env. A forked
    rank also leaves through os._exit (no atexit handlers, no C++ static destructors):
    runs that must cover interpreter exit ask for spawn (test_collectives' 2-rank runs;
    the sanitizer runs set PYCOMM_TEST_START_METHOD=spawn)."""
    if requested is not None:
        return requested
    if pre_init is not None or any(k.startswith(_LOAD_TIME_PREFIXES) and k != "OMP_NUM_THREADS" for k in env_keys):
        return "spawn"
    return START_METHOD


def _context(method):
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def process_context():
    """The multiprocessing context of spawn_run's fresh ranks (the fork server, or spawn
    under PYCOMM_TEST_START_METHOD=spawn), for tests that manage their processes
    themselves: start them with ``target=in_environment, args=(dict(os.environ), fn, ...)``
    so that a forked one sees the environment of the call, not the server's."""
    return _context(START_METHOD)


def in_environment(env, fn, *args):
    """``fn(*args)`` with ``os.environ`` replaced by ``env`` (a process's target)."""
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    return fn(*args)


# The most the parent reads from one pipe before it looks at the clock again.
_READ_BURST = 64 << 20


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (tests only: another process
    may take it before the store binds it; pycomm's own launcher uses a file store)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Sender:
    """A rank's end of its pipe to the parent. ``put`` writes one whole message before it
    returns (nothing waits in a buffer when the process leaves); a lock keeps messages
    from threads of this rank whole."""

    def __init__(self, conn):
        self._conn = conn
        self._fd = conn.fileno()
        self._lock = threading.Lock()

    def put(self, msg) -> None:
        blob = pickle.dumps(msg)
        with self._lock:
            try:
                self._write(_HEADER.pack(len(blob)))
                self._write(blob)
            except BrokenPipeError:
                pass  # the parent is gone: nobody to tell

    def _write(self, data) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def close(self) -> None:
        self._conn.close()


class _Receiver:
    """The parent's end of one rank's pipe: non-blocking reads, messages reassembled."""

    def __init__(self, conn):
        self.conn = conn
        os.set_blocking(conn.fileno(), False)
        self.buffer = bytearray()
        self.eof = False

    def read(self) -> list:
        """The messages complete so far; never blocks."""
        got = 0
        while not self.eof and got < _READ_BURST:
            try:
                chunk = os.read(self.conn.fileno(), 1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                self.eof = True
                break
            self.buffer += chunk
            got += len(chunk)
        messages = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            end = _HEADER.size + size
            if len(self.buffer) < end:
                break
            messages.append(pickle.loads(memoryview(self.buffer)[_HEADER.size:end]))
            del self.buffer[:end]
        return messages

    def drain(self) -> list:
        """Everything readable now (the writer has exited or is about to be ignored)."""
        messages = []
        while True:
            batch = self.read()
            messages += batch
            if not batch:
                return messages

    def incomplete(self) -> str | None:
        """What is left of a message that was cut off, or None."""
        if not self.buffer:
            return None
        if len(self.buffer) < _HEADER.size:
            return f"{len(self.buffer)} bytes of a message header arrived"
        (size,) = _HEADER.unpack_from(self.buffer)
        return f"{len(self.buffer) - _HEADER.size} of {size} bytes arrived"


def call_with_deadline(fn: Callable, *args, timeout_s: float, **kwargs):
    """``fn(*args, **kwargs)`` in this process under a hard deadline: a CLI's ``main`` run here
    instead of in a fresh interpreter (which would import torch again). It runs on a thread;
    what it returns or raises (SystemExit included) comes back. At the deadline the processes
    it started (``multiprocessing`` children that were not alive before the call, such as the
    ranks of pycomm.launch) are killed, and the test fails with the thread's stack."""
    before = set(multiprocessing.active_children())
    outcome = {}

    def target():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: B036 - handed to the caller, SystemExit too
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"deadline:{getattr(fn, '__qualname__', fn)}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
        started = [proc for proc in multiprocessing.active_children() if proc not in before]
        for proc in started:
            proc.kill()
        thread.join(10)
        pytest.fail(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)} did not return in "
                    f"{timeout_s} s; killed {len(started)} process(es) it started; its stack:\n{stack}",
                    pytrace=False)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# What a launcher leaves in the environment that would make a command-line tool join it
# (pycomm.launch's torchrun mode) instead of starting ranks of its own.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_main_here(main: Callable, args, *, cwd, monkeypatch, capfd, timeout_s: float,
                  env=None, name: str = "main") -> subprocess.CompletedProcess:
    """A command-line tool's ``main(args)`` in this process, as ``python -m tool ARGS`` run in
    ``cwd`` would run it: never under a leftover torchrun environment, ``env`` added, under
    call_with_deadline. Its exit code (a returned int, or SystemExit's), and the stdout and
    stderr of this process and of the processes it starts (capfd), come back as a
    CompletedProcess."""
    monkeypatch.chdir(cwd)
    for var in _TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in (env or {}).items():
        monkeypatch.setenv(var, value)
    capfd.readouterr()
    try:
        code = call_with_deadline(main, list(args), timeout_s=timeout_s)
    except SystemExit as exc:
        code = exc.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([name, *args], code, out, err)


def communicate_all(procs, timeout_s: float) -> list:
    """``(returncode, stdout, stderr)`` of each ``subprocess.Popen`` of ``procs`` (text pipes),
    all within one deadline of ``timeout_s``; at the deadline every one is killed and the
    test fails with the tail of each one's stderr."""
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [p.communicate()[1] or "" for p in procs]
        pytest.fail(f"processes still running after {timeout_s} s: " + "\n".join(t[-2000:] for t in tails))
    return results


def wait_for_files(paths, limit_s: float) -> bool:
    """Wait until every file of ``paths`` exists (another process's "done"), or ``limit_s``
    seconds pass; for ranks that must not wait in a collective (the group may be broken).
    True if they all appeared."""
    deadline = time.monotonic() + limit_s
    while not all(os.path.exists(path) for path in paths):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class WorkerContext:
    """What a worker function gets as its first argument (inside the child)."""

    def __init__(self, rank, world_size, backend, ref, tmpdir, pg_timeout_s, q):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend  # backend of the default group
        self.ref = ref  # gloo group over all ranks, or None
        self.tmpdir = tmpdir  # private to this run, shared by its ranks
        self.pg_timeout_s = pg_timeout_s
        self._q = q

    # -- messages to the parent ------------------------------------------
    def progress(self, note: str) -> None:
        """Record what this rank is doing; named in the report if it hangs."""
        self._q.put(("progress", self.rank, note))

    def report(self, key: str, value: Any) -> None:
        """Send a keyed partial result now (survives a later hang or crash)."""
        self._q.put(("report", self.rank, (key, pickle.dumps(value))))

    # -- rendezvous ---------------------------------------------------------
    def init_method(self, tag: str) -> str:
        """A fresh file:// rendezvous shared by all ranks of this run."""
        return "file://" + os.path.join(self.tmpdir, "rdzv_" + tag)

    def timeout(self, seconds: float | None = None) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.pg_timeout_s if seconds is None else seconds)

    # -- waiting without the group (it may be broken) ----------------------
    def mark_done(self, tag: str = "done") -> None:
        """Tell the other ranks (through a file in this run's tmpdir) that this rank is done."""
        open(os.path.join(self.tmpdir, f"rank{self.rank}-{tag}"), "w").close()

    def wait_done(self, rank: int, limit_s: float, tag: str = "done") -> bool:
        """Stay until ``rank`` has called mark_done(tag), or ``limit_s`` seconds pass; a rank
        that left instead would shut its groups down and so tell the others. True if done."""
        return wait_for_files([os.path.join(self.tmpdir, f"rank{rank}-{tag}")], limit_s)

    def abrupt_exit(self, value: Any = None) -> None:
        """Report ``value`` as this rank's result and leave at once with
        os._exit(0), without destroying the process group (simulates a peer
        that disappears)."""
        self._q.put(("return", self.rank, pickle.dumps(value)))
        self._q.put(("exit", self.rank, None))
        os._exit(0)


def _netns_child(netns, blob, rank, world_size, backend, conn, *rest):
    """Entry point of a rank that runs in network namespace ``netns``: enter it
    before ``fn``'s module is imported (``fn`` and ``args`` arrive pickled and are
    loaded after setns). torch and pycomm are loaded before (netns_util imports
    pycomm.netns; a forked rank has them from the server); neither opens a socket at
    import."""
    try:
        from netns_util import enter_netns

        enter_netns(netns)
    except BaseException:
        _Sender(conn).put(("error", rank,
                           f"entering network namespace {netns!r} failed:\n" + traceback.format_exc()))
        os._exit(1)
    fn, args = pickle.loads(blob)
    _child(rank, world_size, backend, fn, args, conn, *rest)


def _child(rank, world_size, backend, fn, args, conn, tmpdir, init, port, pg_timeout_s, make_ref, env,
           master_addr="127.0.0.1", pre_init=None):
    q = _Sender(conn)
    # A rank that dies on a signal (SIGSEGV, SIGABRT, ...) prints every thread's Python
    # stack to stderr (the test's captured output) before it goes: which call crashed.
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(env)  # the parent's environment at the call, with the run's on top
    _run_case(q, rank, world_size, backend, fn, args, tmpdir, init, port, pg_timeout_s, make_ref, master_addr,
              pre_init)
    q.put(("exit", rank, None))
    q.close()


def _run_case(q, rank, world_size, backend, fn, args, tmpdir, init, port, pg_timeout_s, make_ref, master_addr,
              pre_init=None) -> None:
    """One run's work in a rank: the default group (and the gloo ``ref``), ``fn``, its result
    sent, the group destroyed. A rank whose ``fn`` (or set-up) raised reports it and leaves
    at once with os._exit(1), without tearing down: its peers see it as gone."""
    dist = None
    try:
        if pre_init is not None:
            pre_init(rank)
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        if backend == "pycomm":
            import pycomm  # noqa: F401  (registers the backend)

        kwargs = dict(rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
        if init == "file":
            kwargs["init_method"] = "file://" + os.path.join(tmpdir, "rdzv_main")
        elif init == "tcp":
            kwargs["init_method"] = f"tcp://{master_addr}:{port}"
        elif init == "env":
            os.environ["MASTER_ADDR"] = master_addr
            os.environ["MASTER_PORT"] = str(port)
            kwargs["init_method"] = "env://"
        else:
            raise ValueError(f"unknown init {init!r}")
        q.put(("progress", rank, f"init_process_group({backend!r}, {init})"))
        dist.init_process_group(backend, **kwargs)
        ref = None
        if make_ref:
            q.put(("progress", rank, "new_group(backend='gloo')"))
            ref = dist.new_group(backend="gloo")
        q.put(("progress", rank, _SETUP_BARRIER))
        _set_up_barrier(dist, rank, world_size, pg_timeout_s)
        ctx = WorkerContext(rank, world_size, backend, ref, tmpdir, pg_timeout_s, q)
        q.put(("progress", rank, _CALLING))
        result = fn(ctx, *args)
        q.put(("return", rank, pickle.dumps(result)))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
        # Leave without tearing down: peers see this rank as gone.
        os._exit(1)
    try:
        q.put(("progress", rank, "destroy_process_group() after return"))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        q.put(("error", rank, "destroy_process_group() failed:\n" + traceback.format_exc()))


def _set_up_barrier(dist, rank, world_size, timeout_s) -> None:
    """Every rank waits here, on the run's store, until all have finished the set-up. A
    group's constructor returning on one rank does not mean it returned on the others:
    without this, a rank whose function returns (and tears down) or exits at once closes
    its connections while a slower peer is still in gloo's handshake, and that peer's
    set-up fails with "Connection closed by peer"."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"mp_util/set-up done/{rank}", b"1")
    store.wait([f"mp_util/set-up done/{r}" for r in range(world_size)], datetime.timedelta(seconds=timeout_s))


@dataclasses.dataclass
class RunResult:
    world_size: int
    backend: str
    returns: dict  # rank -> return value
    errors: dict  # rank -> traceback text
    reports: dict  # rank -> {key: value}
    progress: dict  # rank -> last progress note
    hung: list  # ranks killed at the deadline
    crashed: dict  # rank -> exit code (died without reporting)
    elapsed_s: float
    timeout_s: float
    cut_off: dict = dataclasses.field(default_factory=dict)  # rank -> the message it died (or hung) sending

    @property
    def ok(self) -> bool:
        return not (self.errors or self.hung or self.crashed) and len(self.returns) == self.world_size

    def failure_message(self) -> str | None:
        if self.ok:
            return None
        lines = [f"multi-process run failed (backend={self.backend!r}, world_size={self.world_size}, "
                 f"{self.elapsed_s:.1f} s of {self.timeout_s:.0f} s):"]
        for rank in sorted(self.errors):
            lines.append(f"--- rank {rank} raised (last progress: {self.progress.get(rank)!r}):")
            lines.append(self.errors[rank].rstrip())
        for rank in sorted(self.crashed):
            sending = f" while sending a message ({self.cut_off[rank]})" if rank in self.cut_off else ""
            lines.append(f"--- rank {rank} died with exit code {self.crashed[rank]} without reporting{sending} "
                         f"(last progress: {self.progress.get(rank)!r})")
        if self.hung:
            lines.append(f"--- ranks {sorted(self.hung)} hung and were killed; last progress:")
            for rank in sorted(self.hung):
                sending = f" (killed while sending a message: {self.cut_off[rank]})" if rank in self.cut_off else ""
                lines.append(f"    rank {rank}: {self.progress.get(rank)!r}{sending}")
        missing = set(range(self.world_size)) - set(self.returns) - set(self.errors) - set(self.crashed) - set(self.hung)
        if missing:
            lines.append(f"--- ranks {sorted(missing)} returned nothing")
        return "\n".join(lines)

    def check(self) -> "RunResult":
        msg = self.failure_message()
        if msg:
            pytest.fail(msg, pytrace=False)
        return self


# The progress note of _run_case's barrier after its set-up, and the one right before fn.
_SETUP_BARRIER = "waiting for every rank's set-up"
_CALLING = "calling the test's function"


def spawn_run(
    fn: Callable,
    world_size: int,
    *,
    backend: str = "pycomm",
    args: tuple = (),
    timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
    pg_timeout_s: float = 60.0,
    init: str = "file",
    make_ref: bool = True,
    env: dict | None = None,
    netns: list | None = None,
    master_addr: str = "127.0.0.1",
    rank_env: list | None = None,
    pre_init: Callable | None = None,
    exit_timeout_s: float = 10.0,
    start_method: str | None = None,
) -> RunResult:
    """Run ``fn(ctx, *args)`` on ``world_size`` spawned ranks; never hangs
    longer than ``timeout_s`` (+ a few seconds to kill). Returns a RunResult
    (partial on failure); use ``.check()`` or ``run_multiprocess`` to fail
    the test on any error, crash or hang.

    Multi-host runs (see netns_util.py): ``netns[rank]`` names the network
    namespace rank ``rank`` enters first thing (None: stay); ``master_addr``
    is the rendezvous host for init="tcp"/"env" (rank 0 must be able to
    listen there); ``rank_env[rank]`` adds per-rank environment variables.
    ``pre_init(rank)`` (a module-level function) runs in each rank before
    init_process_group, e.g. to set a resource limit on one rank. ``exit_timeout_s``:
    how long the ranks that finished get, together, to leave the interpreter (many
    ranks on few cores need more than the default). ``start_method``: "spawn" or
    "forkserver" (default: see _start_method)."""
    keys = set(env or {}) | {k for extra in (rank_env or []) for k in extra}
    method = _start_method(start_method, keys, pre_init)
    tmpdir = tempfile.mkdtemp(prefix="pycomm_mp_")
    port = free_port() if init in ("tcp", "env") else 0
    # the parent's environment now, then the run's: a forked rank would otherwise see the
    # environment the fork server started with
    env = dict(os.environ, **{k: str(v) for k, v in (env or {}).items()})
    rank_envs = [dict(env, **{k: str(v) for k, v in (rank_env[rank] if rank_env else {}).items()})
                 for rank in range(world_size)]
    start = time.monotonic()
    ranks = case = None
    if POOL and method == "forkserver" and not any(netns or ()) and pre_init is None:
        try:
            case = pickle.dumps((fn, args))
        except Exception:  # noqa: BLE001  (what only multiprocessing's pickler takes: fresh ranks)
            case = None
    if case is not None:
        ranks = _lease(world_size)
        try:
            ranks.start_case(case, rank_envs, (backend, tmpdir, init, port, pg_timeout_s, make_ref, master_addr))
        except BaseException:
            ranks.close()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        procs, receivers = ranks.procs, ranks.receivers
    else:
        mp = _context(method)
        procs, receivers = [], []
        for rank in range(world_size):
            reader, writer = mp.Pipe(duplex=False)
            rest = (tmpdir, init, port, pg_timeout_s, make_ref, rank_envs[rank], master_addr, pre_init)
            ns = netns[rank] if netns else None
            if ns is None:
                target, pargs = _child, (rank, world_size, backend, fn, args, writer, *rest)
            else:
                target, pargs = _netns_child, (ns, pickle.dumps((fn, args)), rank, world_size, backend, writer,
                                               *rest)
            p = mp.Process(
                target=target,
                args=pargs,
                name=f"{getattr(fn, '__name__', 'worker')}-rank{rank}",
                daemon=True,
            )
            p.start()
            writer.close()  # the rank holds the only write end: its pipe ends when it does
            procs.append(p)
            receivers.append(_Receiver(reader))
    result = None
    try:
        result = _supervise(procs, receivers, world_size, backend, start, timeout_s, exit_timeout_s,
                            pooled=ranks is not None)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        if ranks is not None:
            ranks.finish_case(result is not None and result.ok and not result.cut_off)
    return result


def _supervise(procs, receivers, world_size, backend, start, timeout_s, exit_timeout_s, pooled) -> "RunResult":
    """Read the ranks' pipes until every rank finished its run (``exit``), died, or the
    deadline passed; kill what hangs. A fresh rank (not ``pooled``) then leaves the
    interpreter within ``exit_timeout_s``; a pooled one that finished stays for its next run."""
    returns, errors, reports, progress, crashed, cut_off = {}, {}, {}, {}, {}, {}
    exited = set()
    hung = []
    deadline = start + timeout_s
    first_error_at = None
    all_returned_at = None

    def handle(msg):
        nonlocal first_error_at
        kind, rank, payload = msg
        if kind == "progress":
            progress[rank] = payload
        elif kind == "report":
            key, blob = payload
            reports.setdefault(rank, {})[key] = pickle.loads(blob)
        elif kind == "return":
            returns[rank] = pickle.loads(payload)
        elif kind == "error":
            errors[rank] = errors.get(rank, "") + payload
            exited.add(rank)  # the child leaves right after reporting an error
            if first_error_at is None:
                first_error_at = time.monotonic()
        elif kind == "exit":
            exited.add(rank)
            if pooled:
                procs[rank].reusable = payload  # None, or why the rank must not run another case

    try:
        while True:
            open_pipes = [r.conn for r in receivers if not r.eof]
            if open_pipes:
                multiprocessing.connection.wait(open_pipes, timeout=0.1)
            else:
                time.sleep(0.1)
            for receiver in receivers:
                for msg in receiver.read():
                    handle(msg)
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if not p.is_alive() and rank not in exited and rank not in crashed:
                    # Everything it wrote is in its pipe by now: read it before deciding.
                    for msg in receivers[rank].drain():
                        handle(msg)
                    if rank not in exited:
                        crashed[rank] = p.exitcode
                        if first_error_at is None:
                            first_error_at = now
            done = all((r in exited or r in crashed) for r in range(world_size))
            if done:
                break
            limit = deadline
            if first_error_at is not None:
                limit = min(limit, first_error_at + GRACE_AFTER_ERROR_S)
            if len(returns) == world_size:
                # everyone returned; give them a bounded time to tear down
                if all_returned_at is None:
                    all_returned_at = now
                limit = min(limit, all_returned_at + EXIT_GRACE_S)
            if now > limit:
                break
    finally:
        exit_deadline = time.monotonic() + exit_timeout_s
        for rank, p in enumerate(procs):
            if rank in exited and not pooled:
                # it sent its last message; it should now terminate by itself
                p.join(timeout=max(0.0, exit_deadline - time.monotonic()))
                if p.is_alive():
                    hung.append(rank)
                    progress[rank] = f"process did not terminate within {exit_timeout_s:g} s after its worker " \
                                     "finished (stuck at interpreter exit?)"
        killed = []
        for rank, p in enumerate(procs):
            if pooled and rank in exited and rank not in errors:
                continue  # finished its run: waits for the next one (an abrupt_exit's is gone)
            if p.is_alive():
                if rank not in exited and rank not in crashed:
                    hung.append(rank)
                p.kill()
                killed.append(p)
        for p in (killed if pooled else procs):
            p.join(timeout=10)
        # A rank that finished its work but then died on a signal (a sanitizer's
        # abort at teardown, a crash in a destructor) is a failure too.
        for rank, p in enumerate(procs):
            if rank in exited and rank not in errors and rank not in hung and p.exitcode is not None \
                    and p.exitcode < 0:
                crashed[rank] = p.exitcode
                progress[rank] = f"died on signal {-p.exitcode} after it finished: {progress.get(rank)!r}"
        for rank, receiver in enumerate(receivers):
            for kind, sender, payload in receiver.drain():
                if kind in ("return", "error", "report", "progress"):
                    handle((kind, sender, payload))
            if receiver.incomplete() is not None:
                cut_off[rank] = receiver.incomplete()
            if not pooled:
                receiver.conn.close()

    for rank in hung:
        if rank in returns and rank not in exited:
            progress[rank] = f"returned, then hung in teardown: {progress.get(rank)!r}"
    return RunResult(world_size, backend, returns, errors, reports, progress, sorted(hung), crashed,
                     time.monotonic() - start, timeout_s, cut_off)


# -- the pool of ranks -----------------------------------------------------------------
#
# Forking a rank, importing the test's module in it and leaving costs every run about as
# much as a small test's own work. A pooled run goes instead to ranks that stay: one set
# per world size, each rank a fork of the server as a fresh one is, looping over cases (a
# case: the default group with the run's backend and init, the gloo ref if asked, fn, the
# group destroyed, as _child does). Each case
# starts as a fresh rank would: the call's environment, the server's working directory,
# CPU affinity, torch and numpy random state, default dtype and threads, pycomm's counters
# at zero, its CPU kernels' default and its shared-memory waits heeding other jobs. A set
# runs another case only after one that ended cleanly on every rank: every rank returned,
# destroyed its group and left no thread, signal handler or resource limit of the case behind. After
# anything else (an error, a crash, a hang, a rank gone by abrupt_exit, a deadline) its
# ranks are killed and the next case gets fresh ones. Runs that must start fresh (spawn,
# pre_init, load-time variables, network namespaces) never come here.
# PYCOMM_TEST_POOL=0 turns the pool off.
POOL = os.environ.get("PYCOMM_TEST_POOL", "1") != "0"
# Idle ranks kept over all sets (the least recently used sets go first).
POOL_MAX_IDLE_RANKS = int(os.environ.get("PYCOMM_TEST_POOL_RANKS", "12"))
# How long a finished case's threads get to end before its rank is judged not reusable.
_THREAD_SETTLE_S = 2.0
_idle: "dict[int, _RankSet]" = {}  # world size -> idle set, least recently used first
# Runs on pooled ranks, how many of them on ranks that had run a case before, and why sets
# were ended after a run (reported at the end of the session, tests/conftest.py).
POOL_STATS = {"runs": 0, "reused": 0, "retired": {}}


def _lease(key) -> "_RankSet":
    ranks = _idle.pop(key, None)
    if ranks is not None and not ranks.idle_and_clean():
        ranks.close()
        ranks = None
    return ranks or _RankSet(key)


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


_SIGNALS = [s for s in range(1, 65) if s not in (9, 19)]


def _signal_handlers() -> dict:
    import signal

    handlers = {}
    for signum in _SIGNALS:
        try:
            handlers[signum] = signal.getsignal(signum)
        except (ValueError, OSError):
            pass
    return handlers


def _pool_child(rank, world_size, commands, conn):
    """A pooled rank: runs the cases that arrive on ``commands`` one after another;
    leaves when the parent closes it (or dies)."""
    q = _Sender(conn)
    faulthandler.enable(all_threads=True)
    import random

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    import pycomm  # noqa: F401  (the server loaded it: the "pycomm" backend is registered)
    import gc

    gc.freeze()  # what the server imported is never garbage: collections skip it
    # What a fresh fork of the server starts every case with.
    cwd = os.getcwd()
    torch_rng = torch.get_rng_state()
    numpy_rng = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None
    default_dtype = torch.get_default_dtype()
    handlers = _signal_handlers()
    limits = _limits()
    affinity = os.sched_getaffinity(0)
    isa = _cpu_isa()
    while True:
        try:
            blob = commands.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        case, env, (backend, tmpdir, init, port, pg_timeout_s, make_ref, master_addr) = pickle.loads(blob)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        os.sched_setaffinity(0, affinity)
        torch.set_rng_state(torch_rng)
        random.seed()
        if numpy_rng is not None:
            sys.modules["numpy"].random.set_state(numpy_rng)
        elif "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # as its import in a fresh rank would
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        _reset_pycomm(isa)
        threads_before = set(threading.enumerate())
        os_threads_before = _os_threads()
        try:
            fn, args = pickle.loads(case)  # imports fn's module (once per rank)
        except BaseException:
            q.put(("error", rank, traceback.format_exc()))
            os._exit(1)
        _run_case(q, rank, world_size, backend, fn, args, tmpdir, init, port, pg_timeout_s, make_ref, master_addr)
        del fn, args
        q.put(("progress", rank, "finished; checking what the case left behind"))
        why = _leftovers(dist, threads_before, os_threads_before, handlers, limits)
        q.put(("exit", rank, why))


def _cpu_isa():
    try:
        from pycomm import _C

        return _C.kernels.cpu_isa()
    except Exception:
        return None


def _reset_pycomm(isa) -> None:
    """pycomm's process-wide state as a fresh rank has it: counters at zero, the CPU
    kernels' instruction set the default, shared-memory waits that heed other jobs (a case
    of tests/transport/test_shm.py turns that off for its process)."""
    if "pycomm" not in sys.modules:
        return
    from pycomm import _C

    _C._reset_stats()
    _C._shm_ignore_other_jobs(False)
    if isa is not None and _C.kernels.cpu_isa() != isa:
        _C.kernels.set_cpu_isa(isa)


def _limits() -> dict:
    import resource

    return {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}


def _leftovers(dist, threads_before, os_threads_before, handlers, limits):
    """Why this rank must not run another case (None when it may)."""
    import gc

    if dist.is_initialized():
        return "a process group is still initialized"
    deadline = time.monotonic() + _THREAD_SETTLE_S
    collected = False
    while True:
        extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        os_threads = _os_threads()
        if not extra and os_threads <= os_threads_before:
            break
        if not collected:
            # a group kept alive by a reference cycle keeps its threads until collected
            # (a full collection is cheap here: gc.freeze() at the start left only the cases' objects)
            gc.collect()
            collected = True
        if time.monotonic() > deadline:
            if extra:
                return f"threads still running: {[t.name for t in extra]}"
            return f"{os_threads - os_threads_before} more OS thread(s) than before the case"
        time.sleep(0.01)
    if _signal_handlers() != handlers:
        return "signal handlers changed"
    if _limits() != limits:
        return "resource limits changed"
    return None


class _RankSet:
    """The ranks of one pool key: each a process forked from the server, with a pipe for
    its cases (parent -> rank) and one for its messages (rank -> parent)."""

    def __init__(self, world_size):
        self.key = world_size
        self.cases = 0
        mp = _context("forkserver")
        self.procs, self.receivers, self.commands = [], [], []
        for rank in range(world_size):
            reader, writer = mp.Pipe(duplex=False)
            cmd_reader, cmd_writer = mp.Pipe(duplex=False)
            p = mp.Process(target=_pool_child,
                           args=(rank, world_size, cmd_reader, writer),
                           name=f"pool{world_size}-rank{rank}", daemon=True)
            p.start()
            writer.close()
            cmd_reader.close()
            p.reusable = None
            self.procs.append(p)
            self.receivers.append(_Receiver(reader))
            self.commands.append(cmd_writer)

    def start_case(self, case, rank_envs, settings) -> None:
        self.cases += 1
        for rank, p in enumerate(self.procs):
            p.reusable = "did not finish the case"
            blob = pickle.dumps((case, rank_envs[rank], settings))
            # in a thread: a rank that does not read (stuck, dead) must not block the
            # parent; the run's deadline deals with it
            threading.Thread(target=self._send, args=(self.commands[rank], blob), daemon=True).start()

    @staticmethod
    def _send(conn, blob) -> None:
        try:
            conn.send_bytes(blob)
        except OSError:
            pass  # the rank is gone: the run reports it

    def finish_case(self, ok: bool) -> None:
        """Back to the pool if the run succeeded and every rank finished cleanly and stays;
        else killed."""
        why = None
        if not ok:
            why = "the run failed"
        elif not all(p.is_alive() for p in self.procs):
            why = "a rank is gone"
        elif any(p.reusable is not None for p in self.procs):
            why = next(p.reusable for p in self.procs if p.reusable is not None)
        elif any(r.incomplete() is not None or r.eof for r in self.receivers):
            why = "a pipe is broken"
        POOL_STATS["runs"] += 1
        POOL_STATS["reused"] += self.cases > 1
        if why is None:
            _idle[self.key] = self
            _trim()
        else:
            POOL_STATS["retired"][why.split(":")[0]] = POOL_STATS["retired"].get(why.split(":")[0], 0) + 1
            self.close()

    def idle_and_clean(self) -> bool:
        """Alive, and nothing arrived since the last case ended."""
        for p, r in zip(self.procs, self.receivers):
            if not p.is_alive() or r.read() or r.eof or r.incomplete() is not None:
                return False
        return True

    def close(self) -> None:
        for conn in self.commands:
            conn.close()
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for r in self.receivers:
            r.conn.close()


def _trim() -> None:
    while sum(len(s.procs) for s in _idle.values()) > POOL_MAX_IDLE_RANKS and _idle:
        _idle.pop(next(iter(_idle))).close()


def close_pool() -> None:
    """Ends every idle pooled rank."""
    while _idle:
        _idle.popitem()[1].close()


def run_multiprocess(fn: Callable, world_size: int, **kwargs) -> list:
    """spawn_run + fail the test on any error/crash/hang; returns the
    per-rank return values as a list indexed by rank."""
    res = spawn_run(fn, world_size, **kwargs).check()
    return [res.returns[r] for r in range(world_size)]


def format_failures(failures: list, limit: int = 40) -> str:
    """Readable, bounded listing of failure strings (deduplicated, in order)."""
    seen, uniq = set(), []
    for f in failures:
        if f not in seen:
            seen.add(f)
            uniq.append(f)
    out = [f"{len(uniq)} failure(s):"] + ["  - " + f for f in uniq[:limit]]
    if len(uniq) > limit:
        out.append(f"  ... and {len(uniq) - limit} more")
    return "\n".join(out)
