"""pycomm-bench's all-reduce sweep through Open MPI (mpi4py): the third peer.

    mpirun --allow-run-as-root --oversubscribe -np 2 python benchmarks/mpi_allreduce.py \
        -b 8 -e 64M -f 4 --json mpi.json

Same sizes, iteration rule, samples, in-place float32 SUM (by default), correctness check
and nccl-tests algbw/busbw definitions as pycomm-bench; prints a table and writes JSON in
pycomm-bench's shape. The code is pycomm/bench/mpi.py, which `pycomm-bench --mpi` runs
after its own sweep to print every peer in one table. Setup (Debian):
apt-get install openmpi-bin libopenmpi-dev && pip install mpi4py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycomm.bench.mpi import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
