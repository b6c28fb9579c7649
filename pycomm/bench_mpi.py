"""The pycomm-bench all-reduce sweep through Open MPI (mpi4py), for comparison.

Run under mpirun, one process per rank::

    mpirun --allow-run-as-root --oversubscribe -np 2 python -m pycomm.bench_mpi \\
        -b 8 -e 64M -f 4 --json mpi.json

(``benchmarks/mpi_allreduce.py`` is the same program; ``pycomm-bench --mpi`` runs it
after its own sweep and prints one table with every peer.) Everything follows
``pycomm.bench``: the same sizes and iteration rule (fewer iterations from 16 MiB
up), in-place all-reduce (``MPI_IN_PLACE``), a correctness check on the same
closed-form pattern before timing, each timed iteration alone (no barriers), time
= median over iterations of the slowest rank, algbw = S/t, busbw = algbw * 2(n-1)/n.
The JSON has pycomm.bench's shape, with ``name`` "mpi" and ``backend`` "openmpi".

mpi4py and an MPI library are optional: nothing else in pycomm needs them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from pycomm import bench

__all__ = ["MPI_DTYPES", "MPI_OPS", "main", "run_mpi_sweep"]

_PREFIX = "pycomm bench_mpi:"

#: dtypes with an MPI datatype (MPI has no float16 / bfloat16).
MPI_DTYPES = ("float32", "float", "float64", "double", "int8", "uint8", "int16", "int32", "int",
              "int64", "long")
#: ops MPI has (no AVG).
MPI_OPS = ("sum", "min", "max", "product", "prod")


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            f"{_PREFIX} cannot import mpi4py ({exc}); install Open MPI (Debian: apt-get install "
            "openmpi-bin libopenmpi-dev) and then `pip install mpi4py`") from exc
    return MPI


def run_mpi_sweep(cfg: bench.BenchConfig, comm=None) -> bench.BenchResult:
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
    op_name = "product" if cfg.op == "prod" else cfg.op
    mpi_op = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op_name]
    dtype = bench.DTYPES[cfg.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()

    memcpy_gbps = bench.memcpy_bandwidth() if rank == 0 else 0.0
    comm.Barrier()
    library = MPI.Get_library_version().strip().splitlines()[0]
    meta: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "collective": "allreduce",
        "world_size": world_size,
        "launcher": "mpirun",
        "mpi_library": library,
        "mpi4py_version": sys.modules["mpi4py"].__version__,
        "python_version": platform.python_version(),
        "memcpy_gbps": memcpy_gbps,
        "dtype": cfg.dtype,
        "op": op_name,
        "backend": "openmpi",
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
    }

    sizes: List[int] = []
    for size in bench.size_sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor):
        count = size // element_size
        if count > 0 and count * element_size not in sizes:
            sizes.append(count * element_size)

    period = bench._pattern_period(dtype, op_name, world_size) if cfg.check else 1
    if cfg.check:
        in_block, expected_block = bench._pattern_blocks(op_name, rank, world_size, period)

    show = rank == 0 and not cfg.quiet
    if show:
        print(f"# pycomm bench_mpi: all-reduce through {library.split(',')[0]}", flush=True)
        print(f"# world size {world_size} (mpirun), mpi4py {meta['mpi4py_version']}, "
              f"op {op_name}, dtype {cfg.dtype}, in place", flush=True)
        print(f"# memcpy (1 thread): {memcpy_gbps:.2f} GB/s; time = median over iterations, max "
              "over ranks; algbw = S/t; busbw = algbw*2(n-1)/n", flush=True)
        print(f"#{'size(B)':>12} {'count':>12} {'type':>8} {'time(us)':>10} {'algbw':>8} "
              f"{'busbw':>8} {'check':>6}", flush=True)

    rows: List[Dict[str, Any]] = []
    all_ok = True
    for nbytes in sizes:
        count = nbytes // element_size
        iters, warmup = bench._iterations_for(nbytes, cfg.iters, cfg.warmup)
        tensor = torch.empty(count, dtype=dtype)
        buffer = tensor.numpy()  # shares the memory; mpi4py takes the buffer protocol
        check = "SKIP"
        if cfg.check:
            tensor.copy_(bench._tiled(in_block, count, dtype))
            comm.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)
            ok = bench._matches(tensor, bench._tiled(expected_block, count, dtype))
            ok = comm.allreduce(ok, op=MPI.LAND)
            check = "OK" if ok else "FAIL"
            all_ok = all_ok and ok
        tensor.fill_(bench._stable_fill(op_name, rank))
        for _ in range(warmup):
            comm.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)
            times.append(time.perf_counter() - start)
        median, q1, q3 = (comm.allreduce(value, op=MPI.MAX) for value in bench._quartiles(times))
        algbw = bench.alg_bandwidth(nbytes, median)
        busbw = bench.bus_bandwidth(algbw, world_size)
        rows.append({
            "size_bytes": nbytes, "count": count, "dtype": cfg.dtype, "op": op_name,
            "world_size": world_size, "name": "mpi", "backend": "openmpi", "algo": None,
            "selected": None, "peer": True, "iters": iters, "warmup": warmup,
            "time_us": median * 1e6, "time_us_q1": q1 * 1e6, "time_us_q3": q3 * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": busbw, "check": check, "error": None,
            "vs_peer": None,
        })
        if show:
            print(f" {nbytes:>12} {count:>12} {cfg.dtype:>8} {bench._fmt(median * 1e6, 10, 1)} "
                  f"{bench._fmt(algbw, 8)} {bench._fmt(busbw, 8)} {check:>6}", flush=True)
    if show:
        print(f"# check: {'OK' if all_ok else 'FAIL'}", flush=True)
    return bench.BenchResult(meta=meta, rows=rows, ok=all_ok)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycomm-bench-mpi",
        description="pycomm-bench's all-reduce sweep through MPI (run it under mpirun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-b", "--minbytes", type=bench._size_arg, default="8")
    parser.add_argument("-e", "--maxbytes", type=bench._size_arg, default="64M")
    parser.add_argument("-f", "--stepfactor", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=MPI_DTYPES)
    parser.add_argument("--op", default="sum", choices=MPI_OPS)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                        help="rank 0 writes the result here (pycomm.bench's JSON shape)")
    parser.add_argument("--quiet", action="store_true", help="no table on stdout")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    cfg = bench.BenchConfig(min_bytes=args.minbytes, max_bytes=args.maxbytes,
                            step_factor=args.stepfactor, iters=args.iters, warmup=args.warmup,
                            dtype=args.dtype, op=args.op, check=args.check, quiet=args.quiet,
                            peer=None)
    try:
        cfg.validate()
        MPI = _import_mpi()
        torch.set_num_threads(1)
        result = run_mpi_sweep(cfg)
    except (RuntimeError, ValueError) as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1
    if args.json_path and MPI.COMM_WORLD.Get_rank() == 0:
        directory = os.path.dirname(os.path.abspath(args.json_path))
        os.makedirs(directory, exist_ok=True)
        tmp = args.json_path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(result.to_json(), handle, indent=1)
        os.replace(tmp, args.json_path)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
