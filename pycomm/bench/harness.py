"""One benchmark run: the torch.distributed ranks (spawned here, joined under torchrun, or
started in network namespaces made for the run with ``--hosts``, :mod:`.hosts`), then, with ``--mpi``, the same sweep through Open MPI under mpirun, then JSON and plot.

For every message size each pycomm all-reduce algorithm (chosen with
``pycomm.set_algorithm``) and a peer backend (gloo by default) run on the same buffer in
the same processes (:mod:`pycomm.bench.runners` through :func:`~pycomm.bench.sweep.run_sweep`).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import List, Optional

import torch
import torch.distributed as dist

from .._control import all_gather_json, broadcast_json
from ..launch import launch_workers, torchrun_env

from .report import TablePrinter, import_pyplot, join_mpi, print_peers, write_json, write_plot
from .runners import CompressedRunner, PycommRunner, TorchControl, TorchRunner, compressed_spec, import_pycomm
from .sweep import (
    DTYPES,
    OPS,
    PREFIX,
    BenchConfig,
    BenchResult,
    Runner,
    byte_sizes,
    memcpy_bandwidth,
    pattern_period,
    run_sweep,
    size_sweep,
)

__all__ = ["bench_worker", "mpi_unavailable_reason", "run_benchmark"]

# The module mpirun runs for --mpi.
MPI_MODULE = "pycomm.bench.mpi"


def bench_worker(rank: int, world_size: int, init_method: str, cfg: BenchConfig) -> BenchResult:
    """One rank of the torch.distributed sweep (a :func:`pycomm.launch.launch_workers` worker)."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    uses_pycomm = "pycomm" in (cfg.backend, cfg.peer)
    module = import_pycomm() if uses_pycomm else None
    pycomm = module if cfg.backend == "pycomm" else None
    dist.init_process_group(cfg.backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout, pg_options=cfg.settings if cfg.backend == "pycomm" else None)
    try:
        return _bench_body(rank, world_size, cfg, pycomm, timeout)
    finally:
        dist.destroy_process_group()


def _columns(cfg: BenchConfig, pycomm, timeout) -> List[Runner]:
    """The runners of the table: each pycomm algorithm (or the backend under test), then the peer."""
    op = OPS[cfg.op]
    runs: List[Runner] = []
    if cfg.backend == "pycomm":
        for algo in cfg.algos:
            spec = compressed_spec(algo)
            if spec is not None:  # a compressed DDP hook's exchange (topk1%, quant8, ...)
                runs.append(CompressedRunner(algo, spec[0], spec[1], op))
                continue
            try:
                pycomm.set_algorithm(algo)
            except Exception as exc:  # a usage error: same on every rank
                raise RuntimeError(f"{PREFIX} pycomm.set_algorithm({algo!r}) failed: {exc}") from exc
            runs.append(PycommRunner(pycomm, algo, op))
        pycomm.set_algorithm("auto")
    else:
        runs.append(TorchRunner(cfg.backend, cfg.backend, op))
    if cfg.peer:
        peer_group = dist.new_group(backend=cfg.peer, timeout=timeout,
                                    pg_options=cfg.settings if cfg.peer == "pycomm" else None)
        runs.append(TorchRunner(f"peer:{cfg.peer}" if cfg.peer == cfg.backend else cfg.peer,
                                cfg.peer, op, group=peer_group, is_peer=True))
    return runs


def _bench_body(rank: int, world_size: int, cfg: BenchConfig, pycomm, timeout) -> BenchResult:
    # Same creation order on every rank: control group first, then the peer.
    control = TorchControl(dist.new_group(backend="gloo", timeout=timeout))
    runs = _columns(cfg, pycomm, timeout)

    memcpy_gbps = memcpy_bandwidth() if rank == 0 else 0.0
    control.barrier()
    link_gbps, link_rates, link_streams = _tcp_reference(cfg, control, rank, world_size)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "collective": "allreduce",
        "world_size": world_size,
        "launcher": ("torchrun" if torchrun_env() else
                     f"netns, {cfg.hosts} hosts x {cfg.ranks_per_host}" if cfg.hosts else "spawn"),
        "torch_version": torch.__version__,
        "pycomm_version": getattr(pycomm, "__version__", None) if pycomm else None,
        "python_version": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "memcpy_gbps": memcpy_gbps,
        "tcp_ring_gbps": link_gbps,
        "tcp_ring_rates": link_rates,
        "tcp_ring_streams": link_streams,
        "tcp_ring_send": _link_send_mode() if link_gbps is not None else None,
        "dtype": cfg.dtype,
        "op": cfg.op_name,
        "backend": cfg.backend,
        "algos": [run.name for run in runs if not run.is_peer],
        "peer": cfg.peer,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
        "timing": cfg.timing,
    }
    if cfg.backend == "pycomm":
        from ..config import bind_address, load_config, resolve_streams, with_settings

        config = load_config(with_settings(cfg.settings))
        meta["tcp_streams"] = list(resolve_streams(config, bind_address(config)))
    if cfg.hosts:
        meta.update(hosts=cfg.hosts, ranks_per_host=cfg.ranks_per_host, rate=cfg.rate,
                    host_ifname=os.environ.get("PYCOMM_SOCKET_IFNAME"))
    sizes, skipped = byte_sizes(cfg)
    hostnames = all_gather_json(socket.gethostname(), group=control.group)
    same_host = len(set(hostnames)) == 1 and not cfg.hosts
    barrier = _shm_barrier(cfg, control, rank, world_size, same_host) if cfg.timing == "shm-barrier" else None
    printer = TablePrinter(runs, world_size, enabled=(rank == 0 and not cfg.quiet))
    printer.header(meta, skipped)
    try:
        rows, ok = run_sweep(cfg, runs, control, rank, world_size, sizes,
                             on_size=lambda nbytes, count, size_rows: printer.row(nbytes, count, cfg.dtype,
                                                                                  size_rows),
                             same_clock=same_host or cfg.hosts is not None,  # namespaces: one kernel
                             barrier=barrier)
    finally:
        if barrier is not None:
            barrier.close()
    result = BenchResult(meta=meta, rows=rows, ok=ok)
    printer.footer(result)
    control.barrier()
    return result


def _shm_barrier(cfg: BenchConfig, control: TorchControl, rank: int, world_size: int, same_host: bool):
    """The benchmark's own barrier for --timing shm-barrier (every rank on this host)."""
    from .shm_barrier import ShmBarrier

    if not same_host:
        raise RuntimeError(f"{PREFIX} --timing shm-barrier needs every rank on one host")

    def broadcast(value):
        return broadcast_json(value, src=0, group=control.group)

    return ShmBarrier(rank, world_size, broadcast, control.barrier, cfg.timeout_s)


def _link_send_mode() -> str:
    from .link import _send_mode

    return _send_mode()


def _tcp_reference(cfg: BenchConfig, control: TorchControl, rank: int, world_size: int):
    """(slowest rank's GB/s, every rank's, [streams, threads]) of raw TCP in the ring's
    pattern over the streams per peer and I/O threads a pycomm group of this rank would
    use, or (None, None, None) when not asked for (pycomm.bench.link)."""
    from ..config import bind_address, load_config, resolve_streams, with_settings

    config = load_config(with_settings(cfg.settings))
    wanted = cfg.tcp_reference if cfg.tcp_reference is not None else (
        cfg.backend == "pycomm" and (config.transport == "tcp" or (bool(cfg.hosts) and cfg.ranks_per_host == 1)))
    if not wanted or world_size < 2:
        return None, None, None
    from .link import tcp_ring_bandwidth

    address = bind_address(config)
    streams, threads = resolve_streams(config, address)
    slowest, rates = tcp_ring_bandwidth(control.group, rank, world_size, address,
                                        streams=streams, threads=threads)
    return slowest, rates, [streams, threads]


def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run the sweep (spawning ``cfg.nprocs`` ranks, or as one rank of a torchrun job).

    Rank 0 prints the table unless ``cfg.quiet``; rank 0 writes ``cfg.json_path``
    if set. Returns the result (the same on every rank under torchrun).
    """
    cfg.validate()
    if cfg.hosts and torchrun_env() is not None:
        raise RuntimeError(f"{PREFIX} --hosts makes its own ranks in network namespaces; "
                           "run pycomm-bench --hosts N outside torchrun")
    if cfg.mpi:
        if torchrun_env() is not None:
            raise RuntimeError(f"{PREFIX} --mpi starts its own mpirun on this host; "
                               "run pycomm-bench -n N --mpi outside torchrun")
        reason = mpi_unavailable_reason()
        if reason:
            raise RuntimeError(f"{PREFIX} --mpi: {reason}")
    if cfg.plot_path:
        import_pyplot()  # fail before the sweep, not after it
    if "pycomm" in (cfg.backend, cfg.peer) and torchrun_env() is None:
        import_pycomm()  # fail here, once, rather than in every spawned rank
    if cfg.check:
        # Fail fast (before spawning) if the pattern cannot be exact.
        world = torchrun_env()[1] if torchrun_env() else cfg.nprocs
        pattern_period(DTYPES[cfg.dtype], cfg.op_name, world)
    if cfg.hosts:
        from .hosts import run_on_hosts

        result = run_on_hosts(cfg, bench_worker)
    else:
        result = launch_workers(bench_worker, cfg.nprocs, cfg, prefix=PREFIX, expected_errors=(PREFIX,))
    if cfg.mpi:
        result = join_mpi(result, _run_mpi_sweep(cfg, result.meta["world_size"]))
        if not cfg.quiet:
            print_peers(result)
    env = torchrun_env()
    if env is None or env[0] == 0:
        if cfg.json_path:
            write_json(result, cfg.json_path)
        if cfg.plot_path:
            write_plot(result, cfg.plot_path)
            if not cfg.quiet:
                print(f"# plot: {cfg.plot_path}", flush=True)
    return result


# ---------------------------------------------------------------------------
# Open MPI as a third peer (--mpi): pycomm.bench.mpi under mpirun
# ---------------------------------------------------------------------------

def mpi_unavailable_reason() -> Optional[str]:
    """Why ``--mpi`` cannot run here (no mpirun, no mpi4py), or None when it can."""
    missing = []
    if shutil.which("mpirun") is None:
        missing.append("mpirun (Debian: apt-get install openmpi-bin libopenmpi-dev)")
    if importlib.util.find_spec("mpi4py") is None:
        missing.append("mpi4py (pip install mpi4py, after the MPI library)")
    return ("needs " + " and ".join(missing)) if missing else None


def _mpi_command(cfg: BenchConfig, world_size: int, json_path: str) -> List[str]:
    cmd = [shutil.which("mpirun") or "mpirun"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "-np", str(world_size), sys.executable, "-m", MPI_MODULE,
            "-b", str(cfg.min_bytes), "-e", str(cfg.max_bytes), "-f", str(cfg.step_factor),
            "--iters", str(cfg.iters), "--warmup", str(cfg.warmup), "--dtype", cfg.dtype,
            "--op", cfg.op, "--check" if cfg.check else "--no-check", "--timing", cfg.timing, "--quiet",
            "--json", json_path]
    return cmd


def _run_mpi_sweep(cfg: BenchConfig, world_size: int) -> BenchResult:
    """The same sweep through Open MPI (pycomm.bench.mpi under mpirun), right after ours."""
    import pycomm

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(pycomm.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="pycomm-bench-mpi-") as tmpdir:
        json_path = os.path.join(tmpdir, "mpi.json")
        cmd = _mpi_command(cfg, world_size, json_path)
        # Every size is bounded by cfg.timeout_s in our sweep; give MPI's the same per size.
        limit = cfg.timeout_s * (len(size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor)) + 1)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{PREFIX} --mpi: the MPI sweep did not finish in {limit:.0f} s: "
                               f"{' '.join(cmd)}") from None
        if proc.returncode != 0 or not os.path.exists(json_path):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
            raise RuntimeError(f"{PREFIX} --mpi: {' '.join(cmd)} exited with code "
                               f"{proc.returncode}:\n" + "\n".join(tail))
        with open(json_path) as handle:
            data = json.load(handle)
    data["meta"]["command"] = " ".join(cmd[:cmd.index(sys.executable)] + ["python"]
                                       + cmd[cmd.index(sys.executable) + 1:-2])
    return BenchResult(meta=data["meta"], rows=data["rows"], ok=data["ok"])
