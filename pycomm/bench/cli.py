"""``pycomm-bench`` / ``python -m pycomm.bench``: the command line of the benchmark."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .harness import run_benchmark
from .sweep import DTYPES, MIN_LARGE_ITERS, OPS, PREFIX, TIMINGS, BenchConfig, size_arg

__all__ = ["main", "parse_args"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycomm-bench",
        description=(
            "All-reduce microbenchmark in the style of nccl-tests. Each pycomm algorithm and a "
            "peer backend run on the same buffers in the same processes; the table reports the "
            "median time over iterations (slowest rank), algbw = S/t and busbw = algbw*2(n-1)/n, "
            "and checks every result against a closed-form value. Under torchrun (RANK and "
            "WORLD_SIZE set) the launched processes are the ranks; otherwise -n ranks are "
            "spawned on this host, or, with --hosts, across network namespaces made for the run."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-n", "--nprocs", type=int, default=None,
                        help="ranks to spawn on this host (ignored under torchrun; default 2, or "
                             "hosts x ranks-per-host with --hosts)")
    parser.add_argument("-b", "--minbytes", type=size_arg, default="8",
                        help="smallest message in bytes per rank; suffixes K, M, G (binary)")
    parser.add_argument("-e", "--maxbytes", type=size_arg, default="64M",
                        help="largest message; sizes are minbytes*stepfactor^k <= maxbytes")
    parser.add_argument("-f", "--stepfactor", type=int, default=4,
                        help="multiply the size by this factor between rows")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations per size and algorithm (scaled down from 16 MiB up, "
                             f"at least {MIN_LARGE_ITERS})")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before timing")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="element type")
    parser.add_argument("--op", default="sum", choices=sorted(OPS), help="reduction operation")
    parser.add_argument("--algos", default="auto,ring,tree,sharded",
                        help="comma-separated pycomm algorithms to measure: auto (what pycomm "
                             "picks: shm when every rank shares a host), ring, tree, sharded, "
                             "shm, hierarchical; and the compressed DDP hooks' exchange of one "
                             "bucket (encode with error feedback, compressed all-reduce, average; "
                             "lossy, not checked): topk1%% (any density), quant8, quant4")
    parser.add_argument("--backend", default="pycomm",
                        help="backend under test; any other than pycomm (e.g. gloo) is measured "
                             "as a single column and --algos is ignored")
    parser.add_argument("--peer", default="gloo",
                        help="peer backend measured in the same run for comparison; 'none' to skip")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="check every algorithm's result against the closed-form value")
    parser.add_argument("--timing", default="block", choices=TIMINGS,
                        help="how a sample is timed: block = back-to-back calls (16 per sample up to "
                             "64 KiB, 4 up to 1 MiB), divided: the pipelined cost; barrier = a barrier "
                             "on the gloo control group (MPI_Barrier for --mpi), then one timed call: "
                             "what a training loop sees; shm-barrier = the same with the benchmark's "
                             "own shared-memory barrier, the same code for every column and MPI "
                             "(ranks on one host; gloo's barrier lets ranks leave it far apart on a "
                             "busy host). Every time = median over samples of the slowest rank")
    parser.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                        help="write metadata and one row per (size, algorithm) to this JSON file")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a collective is declared hung")
    parser.add_argument("--plot", dest="plot_path", metavar="PATH.png", default=None,
                        help="write a PNG of busbw (and time) vs message size, one line per "
                             "algorithm / peer, memcpy as a reference line (needs matplotlib)")
    parser.add_argument("--mpi", action="store_true",
                        help="after the sweep, run the same sweep through Open MPI (mpirun + "
                             "mpi4py, python -m pycomm.bench.mpi) and print one table with every "
                             "peer; its rows go to --json and --plot too")
    parser.add_argument("--tcp-reference", action=argparse.BooleanOptionalAction, default=None,
                        help="measure raw TCP between the same ranks in the ring's pattern (each rank "
                             "sends and receives at once, over as many streams per peer and I/O "
                             "threads as the pycomm group uses) and print it as the reference for busbw "
                             "(default: on when PYCOMM_TRANSPORT=tcp, and with --hosts at one rank per host)")
    hosts = parser.add_argument_group(
        "several hosts on this machine (root, iproute2)",
        "Make N network namespaces on a private bridge (veth per host), run the ranks inside "
        "them (gloo and pycomm over TCP between hosts; the raw-TCP reference line on by default "
        "with one rank per host) "
        "and remove everything afterwards, also on Ctrl-C / SIGTERM.")
    hosts.add_argument("--hosts", type=int, default=None, metavar="N",
                       help="run across N namespaces made for this run")
    hosts.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                       help="ranks in each namespace (they share memory within a host)")
    hosts.add_argument("--rate", default=None, metavar="RATE",
                       help="limit each host's egress with tc tbf at this rate (e.g. 10gbit, 1gbit)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchConfig:
    """Parse command-line arguments into a validated :class:`BenchConfig`."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    algos = tuple(name.strip() for name in args.algos.split(",") if name.strip())
    peer = None if args.peer.strip().lower() in ("", "none") else args.peer.strip()
    nprocs = args.nprocs
    if nprocs is None:
        nprocs = args.hosts * args.ranks_per_host if args.hosts is not None else 2
    cfg = BenchConfig(
        nprocs=nprocs,
        min_bytes=args.minbytes,
        max_bytes=args.maxbytes,
        step_factor=args.stepfactor,
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        op=args.op,
        algos=algos,
        backend=args.backend,
        peer=peer,
        check=args.check,
        json_path=args.json_path,
        timeout_s=args.timeout,
        plot_path=args.plot_path,
        mpi=args.mpi,
        timing=args.timing,
        tcp_reference=args.tcp_reference,
        hosts=args.hosts,
        ranks_per_host=args.ranks_per_host,
        rate=args.rate,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (``pycomm-bench``). Returns 0 when every check passed, 1 otherwise."""
    cfg = parse_args(argv)
    try:
        result = run_benchmark(cfg)
    except (RuntimeError, ValueError) as exc:
        message = str(exc)
        if not message.startswith(PREFIX):
            message = f"{PREFIX} {message}"
        print(message, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PREFIX} interrupted", file=sys.stderr)
        return 130
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
