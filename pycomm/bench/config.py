"""The bottom of the benchmark: what a run is asked to do (:class:`BenchConfig`), what it
produced (:class:`BenchResult`), the names it accepts (dtypes, ops, timings, sizes, compressed
columns, tc rates) and the interfaces of a column (:class:`Runner`) and of the ranks'
agreement (:class:`Control`). It imports nothing else of pycomm.bench."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

PREFIX = "pycomm bench:"

#: Accepted ``--dtype`` names (torch names and the nccl-tests short names).
DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
    "long": torch.int64,
}

#: Accepted ``--op`` names.
OPS: Dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
}

#: dtypes with an MPI datatype (MPI has no float16 / bfloat16).
MPI_DTYPES = ("float32", "float", "float64", "double", "int8", "uint8", "int16", "int32", "int",
              "int64", "long")
#: ops MPI has (no AVG).
MPI_OPS = ("sum", "min", "max", "product", "prod")

#: Sampling disciplines (``--timing``): blocks of back-to-back calls, or barrier then one call.
TIMINGS = ("block", "barrier", "shm-barrier")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


HOSTS_MPI_REASON = ("--mpi is not supported with --hosts: mpirun forks its ranks in its own network "
                    "namespace; across namespaces it would need to run inside host 0 with an rsh agent "
                    "that enters each namespace (see pycomm/bench/hosts.py)")

# tc's rate syntax, the forms we accept: a number and a bit or byte unit.
_RATE_RE = re.compile(r"^\d+(\.\d+)?([kmgt]i?)?(bit|bps)$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse a byte count such as ``8``, ``64K``, ``1.5M``, ``2GiB`` (binary units)."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"{PREFIX} cannot parse size {text!r} (expected e.g. 8, 64K, 16M, 1G)")
    number, unit = match.groups()
    value = float(number) * _SIZE_UNITS[unit.lower()]
    if value != int(value):
        raise ValueError(f"{PREFIX} size {text!r} is not a whole number of bytes")
    return int(value)


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type=``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(nbytes: int) -> str:
    """Human-readable binary size: ``8 B``, ``64 KiB``, ``1.5 MiB``."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def size_sweep(min_bytes: int, max_bytes: int, step_factor: int) -> List[int]:
    """Sizes ``min_bytes * step_factor**k`` up to ``max_bytes`` (nccl-tests' ``-f``), plus
    ``max_bytes`` itself when the geometric steps skip it, so ``-e 64M`` always shows 64M."""
    if min_bytes < 0 or max_bytes < 0:
        raise ValueError(f"{PREFIX} sizes must be non-negative")
    if min_bytes > max_bytes:
        raise ValueError(f"{PREFIX} --minbytes ({min_bytes}) is larger than --maxbytes ({max_bytes})")
    if min_bytes == max_bytes:
        return [min_bytes]
    if step_factor < 2:
        raise ValueError(f"{PREFIX} --stepfactor must be at least 2 (got {step_factor})")
    if min_bytes == 0:
        raise ValueError(f"{PREFIX} --minbytes must be positive for a geometric sweep")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def valid_rate(rate: str) -> bool:
    """True when ``rate`` is a tc rate we accept (``10gbit``, ``1gbit``, ``100mbit``, ``125mbps``)."""
    return bool(_RATE_RE.match(rate))


# "topk1%", "topk0.1%": top-k at that density; "quant8", "quant4": 8- / 4-bit quantization.
_COMPRESSED = re.compile(r"^(?:topk(?P<density>\d+(?:\.\d+)?)%|quant(?P<bits>8|4))$")


def compressed_spec(name: str) -> Optional[Tuple[str, float]]:
    """("topk", density) or ("quantize", bits) for a compressed column's name, else None."""
    match = _COMPRESSED.match(name)
    if match is None:
        return None
    if match.group("density") is not None:
        density = float(match.group("density")) / 100.0
        if not 0.0 < density <= 1.0:
            raise ValueError(f"{PREFIX} {name}: the density must be in (0, 100]%")
        return "topk", density
    return "quantize", float(match.group("bits"))


@dataclasses.dataclass
class BenchConfig:
    """Everything one benchmark run needs; picklable, so it travels to the workers."""

    nprocs: int = 2
    min_bytes: int = 8
    max_bytes: int = 64 * 2 ** 20
    step_factor: int = 4
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    op: str = "sum"
    algos: Sequence[str] = ("auto", "ring", "tree", "sharded")
    backend: str = "pycomm"
    peer: Optional[str] = "gloo"
    check: bool = True
    json_path: Optional[str] = None
    timeout_s: float = 300.0
    quiet: bool = False
    plot_path: Optional[str] = None
    mpi: bool = False
    # How a sample is taken (TIMINGS): "block" of back-to-back calls, or a barrier ("barrier": the
    # control group's, "shm-barrier": the benchmark's own on one host) then one call.
    timing: str = "block"
    # The raw-TCP reference line (pycomm.bench.link): None = on when pycomm runs over TCP
    # only (PYCOMM_TRANSPORT=tcp) or across hosts with one rank each (--hosts N; with more
    # ranks per host half the ring's links stay inside a host, so it is no ceiling).
    tcp_reference: Optional[bool] = None
    # --hosts N: N network namespaces made for the run (pycomm.bench.hosts), ranks_per_host
    # ranks in each (nprocs is then hosts * ranks_per_host); rate: tc tbf on each host's egress.
    hosts: Optional[int] = None
    ranks_per_host: int = 1
    rate: Optional[str] = None
    # The ranks' pycomm settings (PYCOMM_* name -> value) over their environment, handed to
    # the group as pg_options (pycomm.config.with_settings): how a caller such as
    # python -m pycomm.plan picks the transport or the streams of a run without touching
    # os.environ. None: the environment alone.
    settings: Optional[Dict[str, str]] = None

    @property
    def op_name(self) -> str:
        """The reduction's canonical name (``prod`` is ``product``)."""
        return "product" if self.op == "prod" else self.op

    def validate(self) -> None:
        """Raise ``ValueError`` (message prefixed ``pycomm bench:``) on a bad setting."""
        if self.hosts is not None:
            if self.hosts < 1:
                raise ValueError(f"{PREFIX} --hosts must be at least 1 (got {self.hosts})")
            if self.ranks_per_host < 1:
                raise ValueError(f"{PREFIX} --ranks-per-host must be at least 1 (got {self.ranks_per_host})")
            if self.nprocs != self.hosts * self.ranks_per_host:
                raise ValueError(f"{PREFIX} --hosts {self.hosts} x --ranks-per-host {self.ranks_per_host} "
                                 f"makes {self.hosts * self.ranks_per_host} ranks, not -n {self.nprocs}")
            if self.rate is not None and not valid_rate(self.rate):
                raise ValueError(f"{PREFIX} --rate {self.rate!r} is not a tc rate (e.g. 10gbit, 1gbit, "
                                 "100mbit)")
            if self.mpi:
                raise ValueError(f"{PREFIX} {HOSTS_MPI_REASON}")
        elif self.rate is not None or self.ranks_per_host != 1:
            raise ValueError(f"{PREFIX} --rate and --ranks-per-host need --hosts")
        if self.nprocs < 1:
            raise ValueError(f"{PREFIX} --nprocs must be at least 1 (got {self.nprocs})")
        if self.settings:
            from ..config import load_config, with_settings

            try:
                load_config(with_settings(self.settings))
            except ValueError as exc:
                raise ValueError(f"{PREFIX} settings: {exc}") from None
        if self.iters < 1:
            raise ValueError(f"{PREFIX} --iters must be at least 1 (got {self.iters})")
        if self.warmup < 0:
            raise ValueError(f"{PREFIX} --warmup must be non-negative (got {self.warmup})")
        if self.dtype not in DTYPES:
            raise ValueError(f"{PREFIX} unknown --dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.op not in OPS:
            raise ValueError(f"{PREFIX} unknown --op {self.op!r}; choose from {', '.join(OPS)}")
        if self.op == "avg" and not DTYPES[self.dtype].is_floating_point:
            raise ValueError(f"{PREFIX} --op avg needs a floating --dtype (got {self.dtype})")
        if self.backend == "pycomm" and not self.algos:
            raise ValueError(f"{PREFIX} --algos is empty")
        if len(set(self.algos)) != len(self.algos):
            raise ValueError(f"{PREFIX} --algos names an algorithm twice: {','.join(self.algos)}")
        compressed = [a for a in self.algos if compressed_spec(a) is not None]
        if compressed and (self.backend != "pycomm" or self.dtype != "float32" or self.op not in ("sum", "avg")
                           or self.mpi):
            raise ValueError(f"{PREFIX} {','.join(compressed)}: the compressed hooks' exchange needs the pycomm "
                             f"backend, --dtype float32 and --op sum or avg, without --mpi (got {self.backend}, "
                             f"{self.dtype}, {self.op})")
        if self.timing not in TIMINGS:
            raise ValueError(f"{PREFIX} unknown --timing {self.timing!r}; choose from {', '.join(TIMINGS)}")
        if self.timing == "shm-barrier" and self.hosts is not None:
            raise ValueError(f"{PREFIX} --timing shm-barrier needs every rank on one host (not --hosts)")
        if self.timeout_s <= 0:
            raise ValueError(f"{PREFIX} --timeout must be positive")
        if self.plot_path is not None and not self.plot_path.lower().endswith(".png"):
            raise ValueError(f"{PREFIX} --plot writes a PNG: give a path ending in .png "
                             f"(got {self.plot_path!r})")
        if self.mpi:
            if self.dtype not in MPI_DTYPES:
                raise ValueError(f"{PREFIX} --mpi: MPI has no {self.dtype} datatype "
                                 f"(use one of {', '.join(MPI_DTYPES)})")
            if self.op not in MPI_OPS:
                raise ValueError(f"{PREFIX} --mpi: MPI has no {self.op} reduction "
                                 "(use sum, min, max or product)")
        size_sweep(self.min_bytes, self.max_bytes, self.step_factor)


@dataclasses.dataclass
class BenchResult:
    """What a run produced: metadata, one row per (size, measured backend/algorithm), overall verdict."""

    meta: Dict[str, Any]
    rows: List[Dict[str, Any]]
    ok: bool

    def to_json(self) -> Dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, "ok": self.ok}


class Runner:
    """One column of the table: one in-place all-reduce of a buffer through some backend.

    ``name`` heads the column; ``backend`` and ``algo`` go into its rows; a peer
    (``is_peer``) is measured for comparison: a dtype or op it cannot run is reported,
    not counted as a failure.
    """

    name: str = ""
    backend: str = ""
    algo: Optional[str] = None
    is_peer: bool = False

    def select(self) -> None:
        """Make this column's settings current; called before each batch of its calls."""

    def selected(self, nbytes: int) -> Optional[str]:
        """What this column runs at ``nbytes`` when it chooses by itself (pycomm's auto)."""
        return None

    def call(self, buffer: torch.Tensor) -> None:
        """One all-reduce of ``buffer`` in place."""
        raise NotImplementedError

    def release(self) -> None:
        """Called after the timed samples of every size."""


class Control:
    """How the ranks agree on statuses and figures, never through the backend under test."""

    def min_ints(self, values: List[int]) -> List[int]:
        """Element-wise minimum over ranks."""
        raise NotImplementedError

    def max_floats(self, rows: List[List[float]]) -> List[List[float]]:
        """Element-wise maximum over ranks."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError
