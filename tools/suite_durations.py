"""Summarise a pytest log written with ``--durations=0``: the N slowest entries and the
total per test file (setup + call + teardown), slowest first.

    python tools/suite_durations.py LOG [--top 25] [--files 40]
    python tools/suite_durations.py BEFORE.log AFTER.log   # per-file totals side by side
"""
from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+?)(?:::(\S.*))?$")
SUMMARY = re.compile(r"^=+ (.*) in ([0-9.]+)s")


def parse(path: str):
    entries, summary = [], None
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                entries.append((float(m.group(1)), m.group(2), m.group(3), m.group(4) or ""))
                continue
            m = SUMMARY.match(line.strip()) if line.startswith("=") else None
            if m is None and re.match(r"^\d+ (passed|failed)", line.strip()):
                m = re.match(r"^(.*) in ([0-9.]+)s", line.strip())
            if m:
                summary = (m.group(1), float(m.group(2)))
    return entries, summary


def per_file(entries) -> dict:
    totals = collections.Counter()
    for seconds, _, path, _ in entries:
        totals[path] += seconds
    return totals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--files", type=int, default=60)
    opts = ap.parse_args()
    parsed = [parse(p) for p in opts.logs]
    for path, (entries, summary) in zip(opts.logs, parsed):
        print(f"== {path}: {summary[0] if summary else '?'} in {summary[1] if summary else '?'} s; "
              f"durations summed: {sum(e[0] for e in entries):.1f} s")
        print(f"-- {opts.top} slowest")
        for seconds, phase, file, test in sorted(entries, reverse=True)[:opts.top]:
            print(f"{seconds:8.2f}s {phase:8s} {file}::{test}")
    totals = [per_file(entries) for entries, _ in parsed]
    files = sorted(set().union(*totals), key=lambda f: -totals[0].get(f, 0.0))
    print("-- per file (s): " + " | ".join(opts.logs))
    for file in files[:opts.files]:
        print("".join(f"{t.get(file, 0.0):9.1f}" for t in totals) + f"  {file}")
    print("".join(f"{sum(t.values()):9.1f}" for t in totals) + "  (all)")


if __name__ == "__main__":
    main()
