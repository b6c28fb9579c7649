"""Output of the benchmark: the nccl-tests-like tables, the JSON file, the plot, and the
join of MPI's sweep with ours into one table."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from .link import LINK_SECONDS
from .sweep import (
    BLOCK_MEDIUM,
    BLOCK_MEDIUM_BYTES,
    BLOCK_SMALL,
    BLOCK_SMALL_BYTES,
    LARGE_BYTES,
    MEMCPY_BYTES,
    MEMCPY_REPEATS,
    MIN_LARGE_ITERS,
    PREFIX,
    BenchResult,
    Runner,
    format_size,
)

__all__ = [
    "MpiTablePrinter",
    "TablePrinter",
    "column_names",
    "fmt",
    "import_pyplot",
    "join_mpi",
    "print_peers",
    "write_json",
    "write_plot",
]


def fmt(value: Optional[float], width: int, digits: int = 2) -> str:
    """``value`` right-aligned in ``width`` with ``digits`` decimals (none from 1000 up); ``-``
    for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    if digits and abs(value) >= 1000:
        digits = 0
    return f"{value:>{width}.{digits}f}"


def _sampling(realigned: str, timing: str = "block") -> str:
    """How a timed iteration is made (sweep.time_samples), for the table headers."""
    if timing == "barrier":
        return "an iteration is a barrier on the control group, then one timed call (--timing barrier)"
    if timing == "shm-barrier":
        return ("an iteration is the benchmark's own shared-memory barrier (the same in every column), "
                "then one timed call (--timing shm-barrier)")
    return (f"an iteration up to {format_size(BLOCK_SMALL_BYTES)} is {BLOCK_SMALL} back-to-back calls, "
            f"up to {format_size(BLOCK_MEDIUM_BYTES)} {BLOCK_MEDIUM}, divided (each after one untimed "
            f"call{realigned})")


class TablePrinter:
    """Prints the nccl-tests-like table of the torch.distributed sweep row by row (rank 0 only)."""

    def __init__(self, runs: Sequence[Runner], world_size: int, enabled: bool):
        self.runs = list(runs)
        self.tested = [run for run in runs if not run.is_peer]
        self.peer = next((run for run in runs if run.is_peer), None)
        self.world_size = world_size
        self.enabled = enabled
        self.tested_label = self.tested[0].backend if self.tested else "tested"

    def _print(self, line: str = "") -> None:
        if self.enabled:
            print(line, flush=True)

    def header(self, meta: Dict[str, Any], skipped: int) -> None:
        self._print(f"# pycomm bench: all-reduce, op {meta['op']}, dtype {meta['dtype']}")
        self._print(f"# date {meta['date']}  host {meta['hostname']}")
        pycomm_version = meta["pycomm_version"] or ("-" if meta["backend"] != "pycomm" else "?")
        self._print(f"# world size {meta['world_size']} ({meta['launcher']}), torch {meta['torch_version']}, "
                    f"pycomm {pycomm_version}, python {meta['python_version']}, "
                    f"torch threads/rank {meta['torch_threads']}")
        if meta.get("hosts"):
            rate = (f"tc tbf rate {meta['rate']} (burst 256kb, latency 50ms) on each host's egress"
                    if meta.get("rate") else "no rate limit")
            self._print(f"# hosts: {meta['hosts']} network namespaces on one machine, {meta['ranks_per_host']} "
                        f"rank(s) each, a veth per host on a private bridge, {rate}; gloo and pycomm on "
                        f"{meta.get('host_ifname') or '?'}")
        self._print(f"# memcpy (1 thread, {format_size(MEMCPY_BYTES)}, median of {MEMCPY_REPEATS}): "
                    f"{meta['memcpy_gbps']:.2f} GB/s")
        if meta.get("tcp_ring_gbps") is not None:
            streams, threads = meta.get("tcp_ring_streams") or (1, 1)
            self._print(f"# raw TCP, ring pattern (each rank {streams} stream(s) out + {streams} in at once, "
                        f"{threads} thread(s), {meta.get('tcp_ring_send') or 'sendfile'}, {LINK_SECONDS:g} s): "
                        f"{meta['tcp_ring_gbps']:.2f} GB/s (slowest rank; "
                        f"ranks {', '.join(f'{r:.2f}' for r in meta['tcp_ring_rates'])})")
        if meta.get("tcp_streams"):
            self._print(f"# TCP: {meta['tcp_streams'][0]} stream(s) per peer, {meta['tcp_streams'][1]} I/O "
                        "thread(s) (PYCOMM_SOCKETS_PER_PEER, PYCOMM_IO_THREADS; rank 0's streams)")
        self._print(f"# backend {meta['backend']}, algorithms {','.join(meta['algos'])}, "
                    f"peer {meta['peer'] or 'none'}; iters {meta['iters']} (fewer from "
                    f"{format_size(LARGE_BYTES)} up, at least {MIN_LARGE_ITERS}), warmup {meta['warmup']}, "
                    f"check {'on' if meta['check'] else 'off'}")
        self._print(f"# time = median over iterations, max over ranks; {_sampling(' when columns alternate', meta.get('timing', 'block'))}; "
                    "algbw = S/t (S = bytes per rank); busbw = algbw*2(n-1)/n; GB/s = 1e9 B/s")
        if skipped:
            self._print(f"# skipped {skipped} size(s) smaller than one element or duplicated after rounding")
        self._print("#")
        top = f"#{'':>12} {'':>12} {'':>8}"
        sub = f"#{'size(B)':>12} {'count':>12} {'type':>8}"
        for run in self.tested:
            top += f" {run.name[:28]:^28}"
            sub += f" {'time(us)':>10} {'algbw':>8} {'busbw':>8}"
        if self.peer is not None:
            top += f" {self.peer.name[:19]:^19}"
            sub += f" {'time(us)':>10} {'busbw':>8}"
            top += f" {'best/':>9}"
            sub += f" {'peer':>9}"
        top += f" {'':>6}"
        sub += f" {'check':>6}"
        self._print(top)
        self._print(sub)

    def row(self, nbytes: int, count: int, dtype: str, rows: List[Dict[str, Any]]) -> None:
        by_name = {row["name"]: row for row in rows}
        line = f" {nbytes:>12} {count:>12} {dtype:>8}"
        for run in self.tested:
            row = by_name[run.name]
            if row["check"] == "ERR":
                line += f" {'ERR':>10} {'-':>8} {'-':>8}"
            else:
                line += (f" {fmt(row['time_us'], 10, 1)} {fmt(row['algbw_gbps'], 8)}"
                         f" {fmt(row['busbw_gbps'], 8)}")
        if self.peer is not None:
            row = by_name[self.peer.name]
            if row["check"] == "ERR":
                line += f" {'ERR':>10} {'-':>8}"
            else:
                line += f" {fmt(row['time_us'], 10, 1)} {fmt(row['busbw_gbps'], 8)}"
            ratios = [r["vs_peer"] for r in rows if r["vs_peer"] is not None]
            line += f" {fmt(max(ratios) if ratios else None, 9)}"
        checks = [row["check"] for row in rows if not (row["peer"] and row["check"] == "ERR")]
        if "ERR" in checks:
            verdict = "ERR"
        elif "FAIL" in checks:
            verdict = "FAIL"
        elif all(check == "SKIP" for check in checks):
            verdict = "-"
        else:
            verdict = "OK"
        line += f" {verdict:>6}"
        self._print(line)

    def footer(self, result: BenchResult) -> None:
        rows = result.rows
        if self.peer is not None and self.world_size > 1:
            self._print("#")
            self._print(f"# busbw ratio vs {self.peer.name} per algorithm (auto: the algorithm it picked)")
            line = f"#{'size(B)':>12}"
            for run in self.tested:
                line += f" {run.name[:18]:>18}"
            self._print(line)
            sizes = sorted({row["size_bytes"] for row in rows})
            for nbytes in sizes:
                line = f" {nbytes:>12}"
                for run in self.tested:
                    row = next(r for r in rows if r["size_bytes"] == nbytes and r["name"] == run.name)
                    cell = fmt(row["vs_peer"], 6)
                    if row["selected"]:
                        cell = f"{cell.strip()} ({row['selected']})"
                    line += f" {cell:>18}"
                self._print(line)
        self._print("#")
        for run in self.runs:
            values = [row["busbw_gbps"] for row in rows
                      if row["name"] == run.name and row["busbw_gbps"] is not None]
            average = sum(values) / len(values) if values else float("nan")
            self._print(f"# avg busbw {run.name:<16}: {fmt(average, 8).strip()} GB/s")
        link = result.meta.get("tcp_ring_gbps")
        if link:
            largest = max(row["size_bytes"] for row in rows)
            from .runners import compressed_spec

            for run in self.runs:
                if compressed_spec(run.name) is not None:
                    continue  # moves a fraction of the bytes: its busbw is not the link's
                row = next((r for r in rows if r["size_bytes"] == largest and r["name"] == run.name), None)
                if row is not None and row["busbw_gbps"] is not None:
                    self._print(f"# busbw {run.name:<16} at {format_size(largest)}: "
                                f"{100.0 * row['busbw_gbps'] / link:.0f}% of raw TCP ({link:.2f} GB/s)")
        _print_skews(rows, column_names(rows), self._print)
        failures = [row for row in rows if row["check"] in ("FAIL", "ERR")]
        for row in failures[:10]:
            detail = f": {row['error']}" if row["error"] else ""
            self._print(f"# {row['check']} size {row['size_bytes']} {row['name']}{detail}")
        tested = [row for row in rows if not row["peer"]]
        checked = [row for row in tested if row["check"] != "SKIP"]
        bad = [row for row in tested if row["check"] in ("FAIL", "ERR")]
        peer_errors = [row for row in rows if row["peer"] and row["check"] == "ERR"]
        note = f"; the peer could not run {len(peer_errors)} size(s)" if peer_errors else ""
        if not checked and not bad:
            self._print(f"# check: skipped (--no-check){note}")
        else:
            self._print(f"# check: {'OK' if result.ok else 'FAIL'} "
                        f"({len(checked) - len(bad)}/{len(checked)} {self.tested_label} runs correct{note})")


class MpiTablePrinter:
    """The table of the MPI sweep alone (``python -m pycomm.bench.mpi``), rank 0 only."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def _print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def header(self, meta: Dict[str, Any], skipped: int) -> None:
        self._print(f"# pycomm bench_mpi: all-reduce through {meta['mpi_library'].split(',')[0]}")
        self._print(f"# world size {meta['world_size']} (mpirun), mpi4py {meta['mpi4py_version']}, "
                    f"op {meta['op']}, dtype {meta['dtype']}, in place")
        self._print(f"# memcpy (1 thread): {meta['memcpy_gbps']:.2f} GB/s; time = median over iterations, "
                    f"max over ranks; {_sampling('', meta.get('timing', 'block'))}; algbw = S/t; busbw = algbw*2(n-1)/n")
        self._print(f"#{'size(B)':>12} {'count':>12} {'type':>8} {'time(us)':>10} {'algbw':>8} "
                    f"{'busbw':>8} {'check':>6}")

    def row(self, nbytes: int, count: int, dtype: str, rows: List[Dict[str, Any]]) -> None:
        for row in rows:
            self._print(f" {nbytes:>12} {count:>12} {dtype:>8} {fmt(row['time_us'], 10, 1)} "
                        f"{fmt(row['algbw_gbps'], 8)} {fmt(row['busbw_gbps'], 8)} {row['check']:>6}")

    def footer(self, result: BenchResult) -> None:
        self._print(f"# check: {'OK' if result.ok else 'FAIL'}")


def write_json(result: BenchResult, path: str) -> None:
    """``result.to_json()`` into ``path`` (directories made; replaced in one step)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result.to_json(), handle, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# Open MPI as a third peer (--mpi) and the plot (--plot)
# ---------------------------------------------------------------------------

def join_mpi(result: BenchResult, mpi: BenchResult) -> BenchResult:
    """``result`` with MPI's rows added (name "mpi") and, on each tested row of the same
    size, ``vs_mpi`` = busbw / MPI's busbw; ``meta["mpi"]`` holds MPI's metadata."""
    mpi_bw = {row["size_bytes"]: row["busbw_gbps"] for row in mpi.rows}
    rows = []
    for row in result.rows:
        row = dict(row)
        if not row["peer"]:
            peer_bw = mpi_bw.get(row["size_bytes"])
            row["vs_mpi"] = (row["busbw_gbps"] / peer_bw
                             if peer_bw and row["busbw_gbps"] is not None else None)
        rows.append(row)
    rows += [dict(row) for row in mpi.rows]
    rows.sort(key=lambda row: row["size_bytes"])  # stable: each size keeps its column order
    meta = dict(result.meta, mpi=mpi.meta)
    return BenchResult(meta=meta, rows=rows, ok=result.ok and mpi.ok)


def column_names(rows: List[Dict[str, Any]]) -> List[str]:
    """The rows' column names in order of first appearance."""
    names: List[str] = []
    for row in rows:
        if row["name"] not in names:
            names.append(row["name"])
    return names


def print_peers(result: BenchResult) -> None:
    """One table with every column and peer: time and busbw side by side, then the ratios."""
    rows = result.rows
    names = column_names(rows)
    tested = [name for name in names
              if not next(row for row in rows if row["name"] == name)["peer"]]
    peers = [name for name in names if name not in tested]
    mpi_meta = result.meta.get("mpi", {})
    print("#")
    print(f"# all peers, one run: pycomm {','.join(tested)} and "
          f"{', '.join(p for p in peers if p != 'mpi')} in the same processes; mpi = "
          f"{mpi_meta.get('mpi_library', 'MPI').split(',')[0]} ({mpi_meta.get('command', 'mpirun')}),"
          " right after")
    print(f"# memcpy 1 thread: {result.meta['memcpy_gbps']:.2f} GB/s (this sweep), "
          f"{mpi_meta.get('memcpy_gbps', float('nan')):.2f} GB/s (MPI sweep); "
          f"{_sampling(' when columns alternate', result.meta.get('timing', 'block'))}")
    width = 9
    head = f"#{'':>12}" + f" {'time (us)':^{(width + 1) * len(names) - 1}}"
    head += f" {'busbw (GB/s)':^{(width + 1) * len(names) - 1}}"
    head += f" {'best pycomm busbw /':^{(width + 1) * len(peers) - 1}}"
    print(head)
    sub = f"#{'size(B)':>12}" + "".join(f" {name[:width]:>{width}}" for name in names) * 2
    sub += "".join(f" {name[:width]:>{width}}" for name in peers)
    print(sub)
    for nbytes in sorted({row["size_bytes"] for row in rows}):
        at = {row["name"]: row for row in rows if row["size_bytes"] == nbytes}
        line = f" {nbytes:>12}"
        line += "".join(f" {fmt(at[n]['time_us'] if n in at else None, width, 1)}" for n in names)
        line += "".join(f" {fmt(at[n]['busbw_gbps'] if n in at else None, width, 3)}"
                        for n in names)
        best = max((at[n]["busbw_gbps"] for n in tested
                    if n in at and at[n]["busbw_gbps"] is not None), default=None)
        for peer in peers:
            peer_bw = at[peer]["busbw_gbps"] if peer in at else None
            line += f" {fmt(best / peer_bw if best and peer_bw else None, width)}"
        print(line)
    _print_skews(rows, names, print)
    print(f"# check: {'OK' if result.ok else 'FAIL'} (pycomm and MPI results against the closed form)",
          flush=True)


def _print_skews(rows: List[Dict[str, Any]], names: Sequence[str], out) -> None:
    """With --timing barrier: how far apart the ranks left the barrier, per size and column
    (the earliest rank's time includes it)."""
    if not any(row.get("barrier_skew_us") is not None for row in rows):
        return
    out("# barrier exit skew (us; median over samples of the last rank's exit minus the first's; "
        "the time above includes it)")
    out(f"#{'size(B)':>12}" + "".join(f" {name[:9]:>9}" for name in names))
    for nbytes in sorted({row["size_bytes"] for row in rows}):
        at = {row["name"]: row for row in rows if row["size_bytes"] == nbytes}
        out(f" {nbytes:>12}" + "".join(f" {fmt(at[n].get('barrier_skew_us') if n in at else None, 9, 1)}"
                                       for n in names))


def import_pyplot():
    """matplotlib's pyplot on the Agg backend, or a ``pycomm bench:`` RuntimeError."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(f"{PREFIX} --plot needs matplotlib (pip install matplotlib): {exc}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(result: BenchResult, path: str) -> None:
    """PNG of busbw vs message size (log x), one line per column (pycomm algorithms, gloo,
    MPI, ...), the machine's single-thread memcpy as a horizontal line; a second panel
    shows the median time (log-log) for the small-message end."""
    plt = import_pyplot()
    meta, rows = result.meta, result.rows
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5.2))
    for name in column_names(rows):
        mine = [row for row in rows if row["name"] == name and row["busbw_gbps"] is not None]
        if not mine:
            continue
        first = mine[0]
        if first["backend"] == "pycomm":
            label, style = f"pycomm {name}" + (" (auto)" if name == "auto" else ""), "-o"
        else:
            label = {"openmpi": "Open MPI", "gloo": "gloo"}.get(first["backend"], first["backend"])
            style = "--s"
        sizes = [row["size_bytes"] for row in mine]
        ax_bw.plot(sizes, [row["busbw_gbps"] for row in mine], style, label=label, markersize=4)
        ax_t.plot(sizes, [row["time_us"] for row in mine], style, label=label, markersize=4)
    memcpy = meta.get("memcpy_gbps")
    if memcpy:
        ax_bw.axhline(memcpy, color="black", linestyle=":", linewidth=1.2,
                      label=f"memcpy, 1 thread ({memcpy:.1f} GB/s)")
    link = meta.get("tcp_ring_gbps")
    if link:
        ax_bw.axhline(link, color="gray", linestyle="-.", linewidth=1.2,
                      label=f"raw TCP, ring pattern ({link:.2f} GB/s)")
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        sizes = sorted({row["size_bytes"] for row in rows})
        ticks = sizes if len(sizes) <= 14 else sizes[::2]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(size).replace(" ", "") for size in ticks], rotation=45,
                           fontsize=8)
        ax.set_xlabel("message size per rank")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("busbw (GB/s) = S/t x 2(n-1)/n")
    ax_bw.set_ylim(bottom=0)
    ax_bw.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time (us), median of the slowest rank")
    fig.suptitle(f"all-reduce {meta.get('op', '')} {meta.get('dtype', '')}, "
                 f"{meta.get('world_size', '?')} ranks on {meta.get('hostname', '?')} "
                 f"({meta.get('date', '')})")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
