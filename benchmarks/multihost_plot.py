"""One figure of several ``pycomm-bench --hosts`` runs: a panel per JSON file, busbw vs
message size, one line per pycomm algorithm and gloo, the raw-TCP reference of the same
run as a horizontal line.

    python benchmarks/multihost_plot.py -o benchmarks/results/multihost.png \\
        benchmarks/results/multihost_2hosts.json benchmarks/results/multihost_2hosts_1gbit.json \\
        benchmarks/results/multihost_4hosts.json benchmarks/results/multihost_4hosts_1gbit.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pycomm.bench.report import column_names, import_pyplot
from pycomm.bench.sweep import format_size


def _title(meta: dict) -> str:
    rate = f"tbf {meta['rate']}" if meta.get("rate") else "no rate limit"
    return (f"{meta['hosts']} hosts x {meta['ranks_per_host']} rank, {rate}\n"
            f"({meta['date']}, memcpy {meta['memcpy_gbps']:.1f} GB/s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="pycomm-bench --hosts ... --json files")
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    args = parser.parse_args(argv)
    plt = import_pyplot()
    cols = 2 if len(args.json) > 1 else 1
    rows_n = math.ceil(len(args.json) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(7 * cols, 4.6 * rows_n), squeeze=False)
    for ax, path in zip(axes.flat, args.json):
        with open(path) as handle:
            data = json.load(handle)
        meta, rows = data["meta"], data["rows"]
        for name in column_names(rows):
            mine = [row for row in rows if row["name"] == name and row["busbw_gbps"] is not None]
            if not mine:
                continue
            pycomm = mine[0]["backend"] == "pycomm"
            ax.plot([row["size_bytes"] for row in mine], [row["busbw_gbps"] for row in mine],
                    "-o" if pycomm else "--s", markersize=3,
                    label=f"pycomm {name}" if pycomm else mine[0]["backend"])
        link = meta.get("tcp_ring_gbps")
        if link:
            ax.axhline(link, color="gray", linestyle="-.", linewidth=1.2,
                       label=f"raw TCP, ring pattern ({link:.2f} GB/s)")
        sizes = sorted({row["size_bytes"] for row in rows})
        ax.set_xscale("log", base=2)
        ticks = sizes[::3]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(size).replace(" ", "") for size in ticks], rotation=45, fontsize=7)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(_title(meta), fontsize=9)
        ax.set_xlabel("message size per rank")
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(args.json):]:
        ax.set_visible(False)
    fig.suptitle("all-reduce float32 sum across network namespaces on one 2-core VM "
                 "(pycomm-bench --hosts; shared machine, noisy)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    plt.close(fig)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
