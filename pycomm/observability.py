"""What pycomm did, for people debugging or tuning a job.

* ``flight_recorder(group=None)``: the group's last collectives (a fixed ring of
  256 per group), oldest first, as dicts: ``seq`` (the group's sequence number),
  ``op``, ``dtype``, ``bytes``, ``algorithm`` (what ran; "" until it ran),
  ``state`` ("queued", "started", "completed", "failed") and ``time_queued`` /
  ``time_started`` / ``time_ended`` (seconds since the epoch, None until then).
* ``comm_summary()``: per op, group size and power-of-two size bucket, the count,
  total bytes, mean time, algbw and busbw of this process's collectives since start
  (or ``reset_stats()``), as rows and as a printable table.

torch.profiler traces show each collective as ``pycomm:<op>`` with args ``op``,
``bytes``, ``dtype``, ``algorithm``, ``seq``, ``group_size`` and ``async_op``
(recorded in the C++ backend, csrc/backend/work.cc).
"""
from __future__ import annotations

import dataclasses

from . import _C
from ._backend import _backend_of

__all__ = ["CommSummary", "comm_summary", "flight_recorder"]


def flight_recorder(group=None) -> list:
    """The last collectives of `group` (the default group if None), oldest first."""
    return _backend_of(group).flight_recorder()


def _bus_factor(op: str, n: int):
    """(S / recorded bytes, busbw / algbw) after nccl-tests; None where it defines none.

    The recorded bytes are those of the output tensors: for reduce-scatter that is one
    rank's chunk, while nccl-tests' S is the whole input (n chunks)."""
    if n < 1:
        return None
    if op.startswith("allreduce"):
        return 1, 2 * (n - 1) / n
    if op.startswith("allgather") or op == "alltoall":
        return 1, (n - 1) / n
    if op.startswith("reduce_scatter"):
        return n, (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1, 1.0
    return None


def _size(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


@dataclasses.dataclass
class CommSummary:
    """``rows``: one dict per (op, group size, size bucket), sorted; ``table``: the same
    as text (also ``str(summary)``)."""

    rows: list
    table: str

    def __str__(self) -> str:
        return self.table


def comm_summary() -> CommSummary:
    """Counts, bytes, mean time and bandwidth per op and power-of-two size bucket.

    Each row: ``op``, ``group_size``, ``bucket_lo`` / ``bucket_hi`` (sizes in
    [lo, hi), bytes of the tensors the op was called with), ``count``, ``failures``,
    ``bytes`` (total), ``mean_s`` (mean time on the worker thread), ``algbw_gbps`` and
    ``busbw_gbps`` (GB/s, nccl-tests' definitions: busbw = algbw x 2(n-1)/n for
    all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for
    broadcast and reduce; None for ops without one, such as barrier)."""
    rows = []
    for b in _C._stats()["buckets"]:
        lo = 0 if b["bucket"] < 0 else 1 << b["bucket"]
        hi = 1 if b["bucket"] < 0 else 1 << (b["bucket"] + 1)
        mean = b["seconds"] / b["count"] if b["count"] else 0.0
        algbw = busbw = None
        factors = _bus_factor(b["op"], b["group_size"])
        if factors is not None and b["seconds"] > 0:
            algbw = b["bytes"] * factors[0] / b["seconds"] / 1e9
            busbw = algbw * factors[1]
        rows.append(dict(op=b["op"], group_size=b["group_size"], bucket_lo=lo, bucket_hi=hi, count=b["count"],
                         failures=b["failures"], bytes=b["bytes"], mean_s=mean, algbw_gbps=algbw,
                         busbw_gbps=busbw))
    rows.sort(key=lambda r: (r["op"], r["group_size"], r["bucket_lo"]))
    header = (f"{'op':<32} {'ranks':>5} {'size':>13} {'count':>8} {'total bytes':>14} "
              f"{'mean(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    lines = [header]
    for r in rows:
        bw = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        size = f"[{_size(r['bucket_lo'])},{_size(r['bucket_hi'])})"
        failed = f" ({r['failures']} failed)" if r["failures"] else ""
        lines.append(f"{r['op']:<32} {r['group_size']:>5} {size:>13} {r['count']:>8} {r['bytes']:>14} "
                     f"{r['mean_s'] * 1e6:>10.1f} {bw(r['algbw_gbps']):>12} {bw(r['busbw_gbps']):>12}{failed}")
    return CommSummary(rows, "\n".join(lines))
