"""Tables of the predictions: per algorithm, the compressed all-reduces' break-even link
speeds, the extrapolation to many hosts (and its plot), the TCP stream model."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence

from .. import _C
from .model import (DENSE, SIZES, Topology, _cost_object, _fmt_const, _size, break_even_gbps, predict,
                    winners)


def table(model, codec, topology: Topology, sizes: Sequence[int] = SIZES) -> List[str]:
    lines = [f"# {topology} ({topology.ranks} ranks): predicted time (us) per algorithm"]
    names = list(predict(model, topology, sizes[0], codec))
    lines.append(f"{'size':>9} " + " ".join(f"{n[:15]:>15}" for n in names) + f" {'auto':>12} {'best':>16}")
    for nbytes in sizes:
        costs = predict(model, topology, nbytes, codec)
        auto = _C._select_algorithm(nbytes, cost=_cost_object(topology.model(model)), **topology.shape())
        lines.append(f"{_size(nbytes):>9} " + " ".join(f"{costs[n] * 1e6:>15.1f}" for n in names)
                     + f" {auto:>12} {winners(costs)[1]:>16}")
    return lines


def compression_table(model, codec, topology: Topology, nbytes: int = 64 << 20) -> List[str]:
    """The break-even link speed of each compressed all-reduce, twice: with the link
    alone carrying a byte (cpu_beta 0, as the extrapolation) and with this host's TCP
    copies too (where they are slower than any link, a dense all-reduce cannot go
    faster than them and compression always pays)."""
    copies = model.get("cpu_beta", 0.0)
    lines = [f"# {topology}, {_size(nbytes)}: link speed below which each compressed all-reduce "
             "beats the best dense network algorithm: the link alone carrying a byte (cpu_beta 0)"
             + (f"; and with this host's TCP copies ({_fmt_const('cpu_beta', copies)})" if copies else "")]

    def text(gbps):
        return "never" if gbps is None else "always" if math.isinf(gbps) else f"{gbps:.1f} Gbit/s"

    for name in [k for k in predict(model, topology, nbytes, codec) if k.startswith(("topk", "quantize"))]:
        line = f"{name:>16}: {text(break_even_gbps(_network_only(model), topology, nbytes, name, codec))}"
        if copies:
            line += f"; {text(break_even_gbps(model, topology, nbytes, name, codec))}"
        lines.append(line)
    return lines


EXTRAPOLATE = [(64, 8), (512, 8), (4096, 8)]
LINKS = [(100.0, 5e-6), (10.0, 20e-6)]  # Gbit/s, one-way latency between hosts


def _network_only(model: Dict[str, float]) -> Dict[str, float]:
    """The extrapolation's model: this host's per-message overhead, reduction and
    shared-memory constants, but no TCP copy cost per byte (cpu_beta and cpu_beta_oneway
    0): what one TCP stream moves on the calibrating host says nothing of a 100 Gbit/s
    host."""
    return dict(model, cpu_beta=0.0, cpu_beta_oneway=0.0)


def _crossing(model, topology: Topology, fast: str, slow: str, sizes: Sequence[int]) -> Optional[int]:
    """The largest size at which ``fast`` is still predicted cheaper than ``slow``."""
    below = [n for n in sizes if (lambda c: c[fast] < c[slow])(predict(model, topology, n))]
    return max(below) if below else None


def extrapolation(model, codec) -> List[str]:
    model = _network_only(model)
    sizes = [1 << e for e in range(8, 31)]
    lines = ["# extrapolation: 8 ranks per host, cpu_beta 0 (the link, not this VM's TCP copies, carries a "
             "byte); network algorithms among the host leaders (what hierarchical runs between hosts), "
             "and flat over every rank"]
    for gbps, latency in LINKS:
        for ranks, per_host in EXTRAPOLATE:
            hosts = ranks // per_host
            leaders = Topology(hosts, 1, gbps, latency)
            flat = Topology(hosts, per_host, gbps, latency)
            crossings = []
            previous = None
            for nbytes in sizes:
                costs = {k: v for k, v in predict(model, leaders, nbytes).items() if k in DENSE}
                best = min(costs, key=costs.get)
                if best != previous:
                    crossings.append(f"{best} from {_size(nbytes)}")
                    previous = best
            tree_flat = _crossing(model, flat, "tree", "ring", sizes)
            small, big = predict(model, flat, 64 << 10), predict(model, flat, 64 << 20, codec)
            lines.append(f"{ranks:>5} ranks ({hosts} hosts), {gbps:g} Gbit/s, {latency * 1e6:g} us: leaders: "
                         + ", ".join(crossings)
                         + "; flat: tree beats ring up to "
                         + (_size(tree_flat) if tree_flat else "never")
                         + f"; 64 KiB ring {small['ring'] * 1e3:.2f} ms, tree {small['tree'] * 1e3:.2f} ms, "
                         f"hierarchical {small['hierarchical'] * 1e3:.2f} ms; 64 MiB ring {big['ring'] * 1e3:.1f} ms, "
                         f"hierarchical {big['hierarchical'] * 1e3:.1f} ms"
                         + (f"; compressed, flat (a direct exchange with every rank): topk d=0.01 "
                            f"{big['topk d=0.01'] * 1e3:.1f} ms, quantize 8-bit {big['quantize 8-bit'] * 1e3:.1f} ms; "
                            f"among the host leaders (hosts='auto'): topk d=0.01 "
                            f"{big['topk d=0.01 hosts'] * 1e3:.1f} ms, quantize 8-bit "
                            f"{big['quantize 8-bit hosts'] * 1e3:.1f} ms"
                            if codec else ""))
    return lines


def write_plot(model, codec, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(LINKS), len(EXTRAPOLATE), figsize=(15, 8), sharex=True)
    sizes = [1 << e for e in range(8, 31)]
    for row, (gbps, latency) in enumerate(LINKS):
        for col, (ranks, per_host) in enumerate(EXTRAPOLATE):
            ax = axes[row][col]
            topology = Topology(ranks // per_host, per_host, gbps, latency)
            costs = [predict(_network_only(model), topology, s, codec) for s in sizes]
            for name in ("ring", "sharded", "tree", "hierarchical", "topk d=0.01", "quantize 8-bit",
                         "topk d=0.01 hosts", "quantize 8-bit hosts"):
                if name in costs[0]:
                    ax.plot(sizes, [c[name] for c in costs], "--" if " " in name else "-", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{ranks} ranks, {gbps:g} Gbit/s, {latency * 1e6:g} us", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if row == len(LINKS) - 1:
                ax.set_xlabel("bytes per rank")
            if col == 0:
                ax.set_ylabel("predicted time (s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("pycomm cost model: predicted all-reduce time (8 ranks per host, flat over every rank "
                 "except hierarchical and the hosts variants; cpu_beta 0)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def stream_lines(per_stream: Optional[float], link: Optional[float], where: str) -> List[str]:
    """The TCP stream model (pycomm.streams): what 1, 2, 4, 8 and 16 streams move over
    ``link`` Gbit/s when one moves ``per_stream``, and what auto picks."""
    from ..streams import choose_streams, stream_gbps

    sockets, threads = choose_streams(link, per_stream)
    head = (f"# TCP streams: one stream moves {per_stream:.2f} Gbit/s on this host (calibration)"
            if per_stream else "# TCP streams: per-stream throughput not measured (python -m pycomm.plan --calibrate)")
    lines = [head + f"; link {f'{link:g} Gbit/s' if link else 'speed unknown'} ({where})"]
    if per_stream:
        lines.append("#   streams -> Gbit/s, min(link, streams x per-stream): " + ", ".join(
            f"{n} -> {stream_gbps(n, link, per_stream):.1f}" for n in (1, 2, 4, 8, 16)))
    lines.append(f"#   auto: PYCOMM_SOCKETS_PER_PEER={sockets}, PYCOMM_IO_THREADS={threads}")
    return lines
