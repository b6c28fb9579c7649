"""Instructions per small all-reduce call, counted by callgrind (repeatable, unlike timings).

    python benchmarks/call_instructions.py            # pycomm and, with mpi4py, MPI
    python benchmarks/call_instructions.py --backends pycomm,gloo

Each backend runs twice under ``valgrind --tool=callgrind`` in a group of one: N1 and N2
calls of an 8-byte all-reduce (``dist.all_reduce``; ``MPI.COMM_WORLD.Allreduce`` for
mpi). The difference of the two totals over N2 - N1 is the cost of one call with start-up
and warm-up cancelled out. In a group of one pycomm moves no data, so this is the call
path: torch's frontend plus the backend's own share.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_CHILD = r"""
import os, sys
which, n = sys.argv[1], int(sys.argv[2])
if which == "mpi":
    import numpy as np
    from mpi4py import MPI
    a = np.ones(2, dtype=np.float32); b = np.empty_like(a)
    call = lambda: MPI.COMM_WORLD.Allreduce(a, b)
else:
    import torch, torch.distributed as dist
    import pycomm  # registers the backend
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[3])
    dist.init_process_group(which, rank=0, world_size=1)
    t = torch.ones(2)
    call = lambda: dist.all_reduce(t)
for _ in range(n):
    call()
"""


def _total(backend: str, calls: int, port: int, workdir: str) -> int:
    out = os.path.join(workdir, f"cg_{backend}_{calls}.out")
    child = os.path.join(workdir, "child.py")
    with open(child, "w") as f:
        f.write(_CHILD)
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    os.path.realpath(sys.executable), child, backend, str(calls), str(port)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        for line in f:
            m = re.match(r"summary:\s+(\d+)", line)
            if m:
                return int(m.group(1))
    raise RuntimeError(f"no summary line in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="pycomm,mpi")
    parser.add_argument("--calls", default="200,2200", help="N1,N2")
    args = parser.parse_args()
    n1, n2 = (int(x) for x in args.calls.split(","))
    with tempfile.TemporaryDirectory() as workdir:
        for i, backend in enumerate(args.backends.split(",")):
            if backend == "mpi":
                try:
                    import mpi4py  # noqa: F401
                except ImportError:
                    print("mpi: skipped (no mpi4py)")
                    continue
            port = 29640 + i
            per_call = (_total(backend, n2, port, workdir) - _total(backend, n1, port, workdir)) / (n2 - n1)
            print(f"{backend}: {per_call:,.0f} instructions per call")


if __name__ == "__main__":
    main()
