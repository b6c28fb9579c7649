"""Predicted against measured: on this host (--validate-local) and across network namespaces
(--validate, with the namespace path's own calibration)."""

from __future__ import annotations

import datetime
import math
import os
import socket
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _C
from ..config import cost_cache_path, read_cost_model
from .calibration import (CALIBRATION_ROUNDS, HOOK_COLUMNS, _fit_regimes, _hook_costs, _kernel_costs,
                          _median_points, _one_way, _tree_from, save_calibration)
from .model import (DEFAULT_MODEL, DENSE, Topology, _compressed, _cost_object, _fmt_const, _rate, _size,
                    oversubscription, predict)

VALIDATE_HOSTS = (2, 4, 8)
VALIDATE_RATES = (None, "1gbit")
# tc tbf counts every byte of a frame: a full TCP segment carries 1448 payload bytes
# (MTU 1500 less 20 of IP, 20 of TCP and 12 of timestamps) in a frame of 1514 (plus the
# Ethernet header's 14), so the payload moves at 1448/1514 of the rate.
TBF_PAYLOAD = 1448.0 / 1514.0


def validate(model, codec, ranks: Sequence[int] = (2, 4), max_bytes: int = 64 << 20,
             iters: int = 10) -> Tuple[List[str], Dict[int, float]]:
    """On this host: ring / sharded / tree over TCP and shm, from 1 MiB, against the
    prediction with the ranks per core of this machine. Returns (table lines, {ranks:
    worst relative error})."""
    from ..bench import BenchConfig, run_benchmark

    lines = [f"{'ranks':>5} {'algorithm':>9} {'size':>9} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"]
    worst: Dict[int, float] = {}
    for n in ranks:
        for transport, algos in (("tcp", DENSE), ("auto", ("shm",))):
            cfg = BenchConfig(nprocs=n, min_bytes=1 << 20, max_bytes=max_bytes, step_factor=4, iters=iters,
                              warmup=2, algos=algos, peer=None, check=False, quiet=True, tcp_reference=False,
                              settings={"PYCOMM_TRANSPORT": transport})
            rows = run_benchmark(cfg).rows
            # Over TCP every rank is a host of its own to the model.
            topology = Topology(1 if transport != "tcp" else n, n if transport != "tcp" else 1,
                                oversubscription=oversubscription(n))
            for row in rows:
                if not row["time_us"]:
                    continue
                costs = predict(model, topology, row["size_bytes"])
                predicted, measured = costs[row["algo"]], row["time_us"] * 1e-6
                if math.isinf(predicted):  # never chosen by auto here (sharded on 2 ranks)
                    continue
                error = (predicted - measured) / measured
                worst[n] = max(worst.get(n, 0.0), abs(error))
                lines.append(f"{n:>5} {row['algo']:>9} {_size(row['size_bytes']):>9} {predicted * 1e3:>13.2f} "
                             f"{measured * 1e3:>12.2f} {100 * error:>+6.0f}%")
    return lines, worst


def _host_rows(hosts: int, rate: Optional[str], algos: Sequence[str], min_bytes: int, max_bytes: int,
               iters: int, warmup: int, cost_path: Optional[str] = None) -> List[dict]:
    """pycomm-bench --hosts ``hosts`` (one rank each, tbf ``rate`` on each host's egress):
    the rows with a time. ``cost_path``: the ranks' PYCOMM_COST_MODEL (what auto uses)."""
    from ..bench import BenchConfig, run_benchmark

    # "": the ranks' own cache, as if PYCOMM_COST_MODEL were unset
    cfg = BenchConfig(nprocs=hosts, hosts=hosts, ranks_per_host=1, rate=rate, min_bytes=min_bytes,
                      max_bytes=max_bytes, step_factor=4, iters=iters, warmup=warmup, algos=tuple(algos),
                      peer=None, check=False, quiet=True, tcp_reference=False, timeout_s=120.0,
                      settings={"PYCOMM_COST_MODEL": cost_path or ""})
    return [row for row in run_benchmark(cfg).rows if row["time_us"]]


def calibrate_netns(max_bytes: int = 16 << 20, iters: int = 10, verbose: bool = True,
                    hook_max_bytes: int = 64 << 20, rounds: int = CALIBRATION_ROUNDS) -> dict:
    """The namespace path's constants (veth + bridge, no rate): pycomm's 2-host ring
    from 8 B and tree (each size's median over ``rounds`` sweeps), fitted as calibrate()
    fits loopback (beta 0, the CPU is the limit); the
    shared-memory constants and delta from this host's calibration (or the built-in);
    the compressed hooks' own work per byte over the same path (2 hosts, 1 MiB to
    ``hook_max_bytes``)."""
    gamma, _ = _kernel_costs()
    codec = _hook_costs(_host_rows(2, None, tuple(HOOK_COLUMNS), 1 << 20, max(hook_max_bytes, 4 << 20), 3, 1))
    runs = [_host_rows(2, None, ("ring", "tree"), 8, max_bytes, iters, 3) for _ in range(rounds)]

    def sweeps(algo, min_bytes=0):
        return _median_points([[(float(row["size_bytes"]), row["time_us"] * 1e-6) for row in rows
                                if row["algo"] == algo and row["size_bytes"] >= min_bytes] for rows in runs])

    points, tree = sweeps("ring"), sweeps("tree", _tree_from(max_bytes))
    a, b = _fit_regimes(points)
    path = cost_cache_path()
    base = read_cost_model(path) if os.path.exists(path) else dict(DEFAULT_MODEL)
    model = dict(base, alpha=max(a / 2.0, 1e-7), beta=0.0, gamma=gamma, cpu_beta=max(b - gamma / 2.0, 1e-12),
                 cpu_beta_oneway=_one_way(tree, gamma), link_burst=0.0)  # no rate: no bucket
    calibration = {"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "path": "network namespaces: veth + bridge, 2 hosts x 1 rank, no rate", "model": model,
                   "codec": codec, "points": {"ring_netns": points, "tree_netns": tree},
                   "note": "beta 0 (no rate: the CPU is the limit); with a tbf rate, link_model sets beta"}
    if verbose:
        print("# calibrated the namespace path: " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()))
    return calibration


def link_model(model: Dict[str, float], rate: Optional[str]) -> Dict[str, float]:
    """``model`` with a tbf ``rate`` as its link: beta = 1 / (rate x TBF_PAYLOAD), and the
    bucket's burst (pycomm/netns.py), which a phase that starts on an idle link sends
    at once (link_burst; the tree's phases do)."""
    from ..netns import TBF_BURST_BYTES

    m = dict(model)
    if rate:
        m["beta"] = 8.0 / (_rate(rate) * 1e9 * TBF_PAYLOAD)
        m["link_burst"] = float(TBF_BURST_BYTES)
    return m


def _compressed_name(column: str) -> Optional[str]:
    """The prediction's name of a pycomm-bench compressed column ("topk1%" -> "topk d=0.01",
    "quant8" -> "quantize 8-bit"), or None."""
    from ..bench.runners import compressed_spec

    spec = compressed_spec(column)
    if spec is None:
        return None
    kind, value = spec
    return f"topk d={value:g}" if kind == "topk" else f"quantize {int(value)}-bit"


def validate_hosts(model: Dict[str, float], hosts: Sequence[int] = VALIDATE_HOSTS,
                   rates: Sequence[Optional[str]] = VALIDATE_RATES, min_bytes: int = 1 << 20,
                   max_bytes: int = 64 << 20, iters: int = 5, warmup: int = 2,
                   workdir: Optional[str] = None, progress=None, codec: Optional[Dict[str, float]] = None,
                   compressed: Sequence[str] = ()) -> List[dict]:
    """Across network namespaces (one rank per host, with and without tbf): every dense
    algorithm and auto, measured at sizes from ``min_bytes`` by 4x, against the
    prediction (the namespace model, the rate as the link, only egress limited, the
    hosts' ranks per core of this machine). The ranks' auto reads the same model with
    the rate (PYCOMM_COST_MODEL). One record per (hosts, rate, size, algorithm), and
    one per (hosts, rate, size) for auto. ``compressed``: pycomm-bench's compressed
    columns too ("topk1%", "quant8": a DDP hook's exchange of one bucket), against the
    prediction with ``codec``."""
    import tempfile

    records: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="pycomm-plan-") as tmp:
        for rate in rates:
            m = link_model(model, rate)
            path = save_calibration({"model": m, "path": f"netns, rate {rate or 'none'}"},
                                    os.path.join(workdir or tmp, f"netns-{rate or 'unlimited'}.json"))
            for h in hosts:
                if progress:
                    progress(f"# measuring {h} hosts, rate {rate or 'none'}")
                # sharded does not run on 2 ranks under auto (the ring without its pipeline)
                algos = [a for a in DENSE if h > 2 or a != "sharded"] + ["auto"] + list(compressed)
                rows = _host_rows(h, rate, algos, min_bytes, max_bytes, iters, warmup, path)
                over = oversubscription(h)
                by_size: Dict[int, Dict[str, dict]] = {}
                for row in rows:
                    by_size.setdefault(int(row["size_bytes"]), {})[row["algo"]] = row
                for size, got in sorted(by_size.items()):
                    costs = dict(_C.allreduce_costs(size, h, False, h, _cost_object(m), oversubscription=over,
                                                    ingress_limited=False))
                    measured = {a: got[a]["time_us"] * 1e-6 for a in DENSE
                                if a in got and not math.isinf(costs.get(a, math.inf))}
                    for algo, seconds in measured.items():
                        records.append({"hosts": h, "rate": rate, "size": size, "algo": algo,
                                        "oversubscription": over, "predicted": costs[algo], "measured": seconds,
                                        "error": (costs[algo] - seconds) / seconds})
                    if codec:
                        shape = Topology(h, 1, oversubscription=over, ingress_limited=False)
                        predicted = _compressed(m, shape, size, codec)
                        for column in compressed:
                            name = _compressed_name(column)
                            if column in got and name in predicted:
                                seconds = got[column]["time_us"] * 1e-6
                                records.append({"hosts": h, "rate": rate, "size": size, "algo": column,
                                                "compressed": True, "oversubscription": over,
                                                "predicted": predicted[name], "measured": seconds,
                                                "error": (predicted[name] - seconds) / seconds})
                    if "auto" in got and measured:
                        pick = got["auto"]["selected"] or ""
                        fastest = min(measured, key=measured.get)
                        records.append({"hosts": h, "rate": rate, "size": size, "algo": "auto", "picked": pick,
                                        "predicted_best": min((a for a in DENSE if a in costs), key=costs.get),
                                        "fastest": fastest, "auto_measured": got["auto"]["time_us"] * 1e-6,
                                        "slowdown": measured.get(pick, math.nan) / measured[fastest] - 1.0})
    return records


def validation_table(records: List[dict], goal: float = 0.25, auto_slack: float = 0.05) -> List[str]:
    """The records as a table: predicted against measured with the error, then auto's
    pick against the measured fastest, then the verdicts."""
    lines = [f"{'hosts':>5} {'rate':>7} {'ranks/core':>10} {'algorithm':>9} {'size':>8} {'predicted ms':>13} "
             f"{'measured ms':>12} {'error':>7}"]
    dense = [r for r in records if r["algo"] != "auto"]
    for r in dense:
        lines.append(f"{r['hosts']:>5} {r['rate'] or 'none':>7} {r['oversubscription']:>10g} {r['algo']:>9} "
                     f"{_size(r['size']):>8} {r['predicted'] * 1e3:>13.2f} {r['measured'] * 1e3:>12.2f} "
                     f"{100 * r['error']:>+6.0f}%")
    autos = [r for r in records if r["algo"] == "auto"]
    if autos:
        lines.append("")
        lines.append(f"{'hosts':>5} {'rate':>7} {'size':>8} {'auto took':>9} {'model best':>10} "
                     f"{'fastest':>9} {'auto vs fastest':>15}")
        for r in autos:
            lines.append(f"{r['hosts']:>5} {r['rate'] or 'none':>7} {_size(r['size']):>8} {r['picked']:>9} "
                         f"{r['predicted_best']:>10} {r['fastest']:>9} {100 * r['slowdown']:>+14.0f}%")
    lines.append("")
    groups: Dict[Tuple[int, Optional[str], bool], List[dict]] = {}
    for r in dense:
        groups.setdefault((r["hosts"], r["rate"], r.get("compressed", False)), []).append(r)
    for (h, rate, lossy), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1] or "", kv[0][0])):
        within = sum(abs(r["error"]) <= goal for r in rs)
        worst = max(rs, key=lambda r: abs(r["error"]))
        lines.append(f"# {'compressed: ' if lossy else ''}{h} hosts, rate {rate or 'none'} "
                     f"({rs[0]['oversubscription']:g} ranks per core): "
                     f"{within}/{len(rs)} within {100 * goal:.0f}%, worst {100 * worst['error']:+.0f}% "
                     f"({worst['algo']}, {_size(worst['size'])})")
    if autos:
        good = sum(r["slowdown"] <= auto_slack for r in autos)
        lines.append(f"# auto took the measured fastest or one within {100 * auto_slack:.0f}% of it at "
                     f"{good}/{len(autos)} (hosts, rate, size) points")
    return lines
