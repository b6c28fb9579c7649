"""benchmarks/soak.py with a small op count: mixed collectives with checked
results, no growth of RSS / fds / threads, nothing left after destroy."""

from __future__ import annotations

import pathlib
import sys

import pytest

from netns_util import run_bounded

SOAK = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.parametrize("ranks", [2, 3])
def test_soak_small(ranks):
    rc, out = run_bounded([sys.executable, str(SOAK), "--ops", "3000", "--ranks", str(ranks),
                           "--report-every", "1000"], timeout=120)
    assert rc == 0 and "SOAK OK" in out, out[-4000:]
    assert "/dev/shm pycomm files at exit: none" in out
    # one line per sample with every rank's figures
    assert sum(1 for line in out.splitlines() if line.strip().startswith(("1000 ", "2000 ", "3000 "))) == 3, out
