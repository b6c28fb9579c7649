"""``python -m pycomm.plan``: argparse and main."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from typing import Optional, Sequence

from ..config import cost_cache_path
from .calibration import calibrate, load_calibration, save_calibration
from .model import PREFIX, Topology, _fmt_const, _latency, _rate
from .report import compression_table, extrapolation, stream_lines, table, write_plot
from .validation import (TBF_PAYLOAD, VALIDATE_HOSTS, VALIDATE_RATES, _compressed_name, calibrate_netns,
                         validate, validate_hosts, validation_table)

DESCRIPTION = "The all-reduce cost model, calibrated on this host, and what it predicts elsewhere."


def netns_cache_path() -> str:
    """This host's calibration of the namespace path (next to cost_cache_path())."""
    return cost_cache_path()[: -len(".json")] + "-netns.json"


def _validate_command(args) -> None:
    from ..bench.hosts import hosts_unavailable_reason

    hosts = [int(h) for h in args.validate_hosts.split(",") if h.strip()]
    rates = [None if r.strip().lower() == "none" else r.strip() for r in args.rates.split(",") if r.strip()]
    reason = hosts_unavailable_reason(next((r for r in rates if r), None))
    if reason:
        raise RuntimeError(f"{PREFIX} --validate runs across network namespaces: {reason}")
    header = [f"# python -m pycomm.plan {' '.join(sys.argv[1:]) if args.argv is None else ' '.join(args.argv)}",
              f"# {datetime.datetime.now().isoformat(timespec='seconds')} on {socket.gethostname()}, "
              f"{os.cpu_count()} CPUs; uptime before: {_uptime()}"]
    compressed = [c.strip() for c in args.compressed.split(",") if c.strip()]
    for column in compressed:
        if _compressed_name(column) not in ("topk d=0.01", "topk d=0.001", "quantize 8-bit", "quantize 4-bit"):
            raise ValueError(f"{PREFIX} --compressed {column!r}: the model has topk1%, topk0.1%, quant8, quant4")
    print("\n".join(header), flush=True)
    calibration = calibrate_netns(max_bytes=min(args.max_bytes or 16 << 20, 16 << 20), iters=2 * args.iters,
                                  hook_max_bytes=args.max_bytes or 64 << 20)
    print(f"# cached: {save_calibration(calibration, netns_cache_path())}", flush=True)
    model = calibration["model"]
    records = validate_hosts(model, hosts, rates, max_bytes=args.max_bytes or 64 << 20, iters=args.iters,
                             codec=calibration["codec"], compressed=compressed,
                             progress=lambda text: print(text, flush=True))
    lines = header + [
        "# model (namespace path): " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()),
        f"# with a rate: beta = 1 / (rate x {TBF_PAYLOAD:.3f}), the TCP payload of a 1514-byte frame; only "
        "egress limited (tbf on each host's interface); ranks/core = hosts / this machine's CPUs",
        *([f"# codecs (the hooks' work per byte besides the collective): "
           + ", ".join(f"{k} {v * 1e9:.3f} ns" for k, v in calibration["codec"].items())] if compressed else []),
        f"# uptime after: {_uptime()}"] + validation_table(records)
    print("\n".join(lines[len(header):]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
        print(f"# table: {args.out}")


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as handle:
            return "load average " + ", ".join(handle.read().split()[:3])
    except OSError:
        return "unknown"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycomm.plan", description=DESCRIPTION)
    parser.add_argument("--calibrate", action="store_true", help="measure this host and cache the constants")
    parser.add_argument("--model", help="a calibration JSON (default: this host's cache, else built-in)")
    parser.add_argument("--hosts", type=int, default=None, help="hosts of the topology to predict")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--bandwidth", type=_rate, default=None, help="link between hosts, e.g. 10gbit")
    parser.add_argument("--latency", type=_latency, default=None, help="one-way latency, e.g. 20us")
    parser.add_argument("--extrapolate", action="store_true", help="64 / 512 / 4096 ranks, 100 and 10 Gbit/s")
    parser.add_argument("--plot", help="PNG of the extrapolation (needs matplotlib)")
    parser.add_argument("--validate", action="store_true",
                        help="predicted against measured across network namespaces (root): calibrate the "
                             "namespace path, then --validate-hosts x --rates, one rank per host")
    parser.add_argument("--compressed", default="",
                        help="with --validate: also pycomm-bench's compressed columns, e.g. topk1%%,quant8 "
                             "(a DDP hook's exchange of one bucket, against the model with the calibrated codecs)")
    parser.add_argument("--validate-hosts", default=",".join(map(str, VALIDATE_HOSTS)),
                        help="host counts for --validate (default 2,4,8)")
    parser.add_argument("--rates", default=",".join(r or "none" for r in VALIDATE_RATES),
                        help="tc tbf rates for --validate, 'none' for no limit (default none,1gbit)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size for --validate")
    parser.add_argument("--out", help="also write the --validate table to this file")
    parser.add_argument("--validate-local", action="store_true",
                        help="predicted against measured on this host (2 and 4 ranks, TCP loopback and shm)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="largest size measured (default: 16 MiB for --calibrate, 64 MiB for the validations)")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    try:
        if args.calibrate:
            calibration = calibrate(max_bytes=args.max_bytes or 16 << 20)
            print(f"# cached: {save_calibration(calibration, args.model)}")
        model, codec, source = load_calibration(args.model)
        print(f"# model from {source}: " + ", ".join(f"{k} {_fmt_const(k, v)}" for k, v in model.items()))
        from ..config import _per_stream, bind_address, load_config
        from ..streams import link_gbps
        per_stream = _per_stream({"PYCOMM_COST_MODEL": args.model} if args.model else os.environ)
        if args.bandwidth:
            print("\n".join(stream_lines(per_stream, args.bandwidth, "--bandwidth")))
        else:
            address = bind_address(load_config())
            print("\n".join(stream_lines(per_stream, link_gbps(address), f"this host's {address}")))
        if args.hosts is not None:
            topology = Topology(args.hosts, args.ranks_per_host, args.bandwidth, args.latency)
            print("\n".join(table(model, codec, topology)))
            print("\n".join(compression_table(model, codec, topology)))
        if args.extrapolate or args.plot:
            print("\n".join(extrapolation(model, codec)))
        if args.plot:
            write_plot(model, codec, args.plot)
            print(f"# plot: {args.plot}")
        if args.validate_local:
            lines, worst = validate(model, codec, max_bytes=max(args.max_bytes or 64 << 20, 1 << 20))
            print("\n".join(lines))
            for n, error in sorted(worst.items()):
                print(f"# {n} ranks on this host's {os.cpu_count()} CPUs: worst error from 1 MiB up "
                      f"{100 * error:.0f}% (goal: within 25%)")
        if args.validate:
            _validate_command(args)
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
        print(message if message.startswith(("pycomm", PREFIX)) else f"{PREFIX} {message}", file=sys.stderr)
        return 1
    return 0
