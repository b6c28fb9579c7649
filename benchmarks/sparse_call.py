"""Time of one sparse all-reduce call (pycomm's allreduce_sparse, as TopKState's hook
issues it) on the digits MLP's bucket: 267,786 elements in 4 parameters, 2,700 pairs
per rank (1%), owners keeping 2%.

    python benchmarks/sparse_call.py --ranks 1 --iters 1000

Prints the wall time per call of every rank (a one-rank group is the call's own CPU:
no peers, nothing to wait for) and a checksum of the result."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COUNT, LENGTHS, PAIRS = 267786, [262144, 512, 5120, 10], 2700


def _rank(rank, world, port, iters, queue):
    import pycomm  # noqa: F401  registers the backend
    from pycomm.hooks._common import _pycomm_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("pycomm", rank=rank, world_size=world)
    backend = _pycomm_backend(None)
    g = torch.Generator().manual_seed(rank)
    indices = torch.randperm(COUNT, generator=g)[:PAIRS].sort().values
    values = torch.randn(PAIRS, generator=g)
    out, residual = torch.empty(COUNT), torch.zeros(COUNT)

    def call():
        backend.allreduce_sparse(indices, values, out, residual, "float32", 0.02, LENGTHS).wait()

    for _ in range(20):
        call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    queue.put((rank, (time.perf_counter() - start) / iters * 1e6, float(out.sum())))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args()
    if args.ranks < 1 or args.iters < 1:
        parser.error("--ranks and --iters must be at least 1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, args.port, args.iters, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1))
        except Exception:  # queue.Empty: a rank that died never reports
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank exited with {dead[0]}")
    results.sort()
    for p in procs:
        p.join()
    print(f"{args.ranks} rank(s), {args.iters} calls: us per call "
          + " ".join(f"{us:.1f}" for _, us, _ in results) + f"; checksum {results[0][2]:.4f}")


if __name__ == "__main__":
    main()
