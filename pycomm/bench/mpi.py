"""The pycomm-bench all-reduce sweep through Open MPI (mpi4py), for comparison.

Run under mpirun, one process per rank::

    mpirun --allow-run-as-root --oversubscribe -np 2 python -m pycomm.bench.mpi \\
        -b 8 -e 64M -f 4 --json mpi.json

(``benchmarks/mpi_allreduce.py`` is the same program; ``pycomm-bench --mpi`` runs it
after its own sweep and prints one table with every peer.) MPI is one more runner of
:func:`pycomm.bench.sweep.run_sweep`, so everything is measured as pycomm's and gloo's
columns are: the same sizes and iteration rule (fewer iterations from 16 MiB up), a
correctness check on the same closed-form pattern before timing, the same samples (blocks
of back-to-back calls for small messages, each sample after one untimed call; or, with
``--timing barrier``, MPI_Barrier then one timed call; with ``--timing shm-barrier`` the
benchmark's own shared-memory barrier, the code pycomm's and gloo's columns use), time =
median over iterations of the slowest rank, algbw = S/t, busbw = algbw * 2(n-1)/n. The
all-reduce is in place (``MPI_IN_PLACE``). The JSON has pycomm.bench's shape, with
``name`` "mpi" and ``backend`` "openmpi".

mpi4py and an MPI library are optional: nothing else in pycomm needs them.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import socket
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from .report import MpiTablePrinter, write_json
from .shm_barrier import ShmBarrier
from .sweep import (
    MPI_DTYPES,
    MPI_OPS,
    TIMINGS,
    BenchConfig,
    BenchResult,
    Control,
    Runner,
    byte_sizes,
    memcpy_bandwidth,
    run_sweep,
    size_arg,
)

__all__ = ["MPI_DTYPES", "MPI_OPS", "MpiControl", "MpiRunner", "main", "run_mpi_sweep"]

_PREFIX = "pycomm bench_mpi:"


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            f"{_PREFIX} cannot import mpi4py ({exc}); install Open MPI (Debian: apt-get install "
            "openmpi-bin libopenmpi-dev) and then `pip install mpi4py`") from exc
    return MPI


class MpiRunner(Runner):
    """``MPI_Allreduce(MPI_IN_PLACE, ...)`` on ``comm``; a peer column named "mpi"."""

    def __init__(self, MPI, comm, op_name: str):
        self.name = "mpi"
        self.backend = "openmpi"
        self.algo = None
        self.is_peer = True
        self._in_place = MPI.IN_PLACE
        self._op = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op_name]
        self._comm = comm
        self._tensor: Optional[torch.Tensor] = None
        self._array = None

    def call(self, buffer: torch.Tensor) -> None:
        if buffer is not self._tensor:  # a new size: one numpy view (shares the memory) per buffer
            self._tensor, self._array = buffer, buffer.numpy()
        self._comm.Allreduce(self._in_place, self._array, op=self._op)


class MpiControl(Control):
    """Agreement over the same communicator (MPI has no second backend to use)."""

    def __init__(self, MPI, comm):
        self._MPI = MPI
        self._comm = comm

    def min_ints(self, values: List[int]) -> List[int]:
        array = np.array(values, dtype=np.int64)
        self._comm.Allreduce(self._MPI.IN_PLACE, array, op=self._MPI.MIN)
        return [int(v) for v in array]

    def max_floats(self, rows: List[List[float]]) -> List[List[float]]:
        array = np.array(rows, dtype=np.float64)
        self._comm.Allreduce(self._MPI.IN_PLACE, array, op=self._MPI.MAX)
        return array.tolist()

    def barrier(self) -> None:
        self._comm.Barrier()


def run_mpi_sweep(cfg: BenchConfig, comm=None) -> BenchResult:
    """Run the sweep on ``comm`` (COMM_WORLD by default); every rank returns the result,
    rank 0 prints the table unless ``cfg.quiet``."""
    MPI = _import_mpi()
    comm = comm if comm is not None else MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    if cfg.dtype not in MPI_DTYPES:
        raise ValueError(f"{_PREFIX} --dtype {cfg.dtype} has no MPI datatype "
                         f"(use one of {', '.join(MPI_DTYPES)})")
    if cfg.op not in MPI_OPS:
        raise ValueError(f"{_PREFIX} --op {cfg.op} is not an MPI reduction (use sum, min, max, product)")
    control = MpiControl(MPI, comm)

    memcpy_gbps = memcpy_bandwidth() if rank == 0 else 0.0
    control.barrier()
    meta: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "collective": "allreduce",
        "world_size": world_size,
        "launcher": "mpirun",
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi4py_version": sys.modules["mpi4py"].__version__,
        "python_version": platform.python_version(),
        "memcpy_gbps": memcpy_gbps,
        "dtype": cfg.dtype,
        "op": cfg.op_name,
        "backend": "openmpi",
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
        "timing": cfg.timing,
    }
    sizes, skipped = byte_sizes(cfg)
    printer = MpiTablePrinter(enabled=(rank == 0 and not cfg.quiet))
    printer.header(meta, skipped)
    # MPI's column stands beside pycomm's and gloo's, which alternate: its samples also
    # follow one untimed call each.
    same_host = len(set(comm.allgather(socket.gethostname()))) == 1
    barrier = None
    if cfg.timing == "shm-barrier":
        if not same_host:
            raise RuntimeError(f"{_PREFIX} --timing shm-barrier needs every rank on one host")
        barrier = ShmBarrier(rank, world_size, lambda value: comm.bcast(value, root=0), comm.Barrier,
                             cfg.timeout_s)
    try:
        rows, ok = run_sweep(cfg, [MpiRunner(MPI, comm, cfg.op_name)], control, rank, world_size, sizes,
                             on_size=lambda nbytes, count, size_rows: printer.row(nbytes, count, cfg.dtype,
                                                                                  size_rows),
                             realign=True, same_clock=same_host, barrier=barrier)
    finally:
        if barrier is not None:
            barrier.close()
    # MPI is the column under test here: an error is a failure, not a peer's gap.
    ok = ok and all(row["check"] != "ERR" for row in rows)
    result = BenchResult(meta=meta, rows=rows, ok=ok)
    printer.footer(result)
    return result


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycomm-bench-mpi",
        description="pycomm-bench's all-reduce sweep through MPI (run it under mpirun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-b", "--minbytes", type=size_arg, default="8")
    parser.add_argument("-e", "--maxbytes", type=size_arg, default="64M")
    parser.add_argument("-f", "--stepfactor", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=MPI_DTYPES)
    parser.add_argument("--op", default="sum", choices=MPI_OPS)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timing", default="block", choices=TIMINGS,
                        help="block: back-to-back calls per sample; barrier: MPI_Barrier, then one "
                             "timed call per sample; shm-barrier: pycomm.bench's own shared-memory "
                             "barrier (ranks on one host), then one timed call")
    parser.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                        help="rank 0 writes the result here (pycomm.bench's JSON shape)")
    parser.add_argument("--quiet", action="store_true", help="no table on stdout")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    cfg = BenchConfig(min_bytes=args.minbytes, max_bytes=args.maxbytes,
                      step_factor=args.stepfactor, iters=args.iters, warmup=args.warmup,
                      dtype=args.dtype, op=args.op, check=args.check, quiet=args.quiet,
                      peer=None, timing=args.timing)
    try:
        cfg.validate()
        MPI = _import_mpi()
        torch.set_num_threads(1)
        result = run_mpi_sweep(cfg)
    except (RuntimeError, ValueError) as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1
    if args.json_path and MPI.COMM_WORLD.Get_rank() == 0:
        write_json(result, args.json_path)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
