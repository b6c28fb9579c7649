"""nccl-tests-style all-reduce microbenchmark: ``python -m pycomm.bench`` (``pycomm-bench``).

For every message size of a geometric sweep, each pycomm all-reduce algorithm
(chosen with ``pycomm.set_algorithm``) and a peer backend (gloo by default)
run on the same buffer in the same processes; ``--mpi`` adds the same sweep
through Open MPI. Figures follow nccl-tests (time = median over iterations of
the slowest rank, algbw = S/t, busbw = algbw * 2(n-1)/n) and every result is
checked against a closed-form value in the same run.

The package is a harness plus one small runner per backend:

* :mod:`.sweep`: sizes, iteration counts, the sampling discipline and the loop every
  runner goes through, the closed-form check patterns, the figures, :class:`BenchConfig`;
* :mod:`.runners`: pycomm (one column per algorithm) and torch.distributed peers (gloo);
  :mod:`.mpi`: Open MPI through mpi4py, run under mpirun (``python -m pycomm.bench.mpi``);
* :mod:`.report`: tables, JSON, plot; :mod:`.harness`: one run (spawn or torchrun, then
  MPI); :mod:`.hosts`: ``--hosts N``, the ranks in network namespaces made for the run
  (:mod:`pycomm.netns`); :mod:`.cli`: argparse and ``main``.

Workers are spawned on this host (``-n``), or, when ``RANK`` and
``WORLD_SIZE`` are set (``torchrun``), the current processes are the ranks
(:mod:`pycomm.launch`).
"""

from pycomm.launch import launch_workers

from .cli import main, parse_args
from .harness import mpi_unavailable_reason, run_benchmark
from .report import join_mpi, write_plot
from .sweep import (
    DTYPES,
    OPS,
    BenchConfig,
    BenchResult,
    alg_bandwidth,
    bus_bandwidth,
    format_size,
    memcpy_bandwidth,
    parse_size,
    size_sweep,
)

__all__ = [
    "BenchConfig",
    "BenchResult",
    "DTYPES",
    "OPS",
    "alg_bandwidth",
    "bus_bandwidth",
    "format_size",
    "join_mpi",
    "launch_workers",
    "main",
    "memcpy_bandwidth",
    "mpi_unavailable_reason",
    "parse_args",
    "parse_size",
    "run_benchmark",
    "size_sweep",
    "write_plot",
]
