"""Fixed cost of one small collective, as topk_hook issues them: a dense float32
all-reduce, the 8-bit quantized all-reduce (TopKState(small_bits=8)'s path for the small
parameters) and the sparse all-reduce, each of a few elements; the dense one also async
and the quantized one also blocking, to separate the worker-thread hand-off from the rest.

    python benchmarks/small_call.py --ranks 2 --elements 10 --iters 300
    PYCOMM_TRANSPORT=tcp python benchmarks/small_call.py --ranks 2   # dense over TCP too

Every call is timed as a training loop sees it: barrier, then one call. Prints rank 0's
median and 90th percentile per kind, in two rounds (the kinds alternate, so an order
effect shows as a difference between the rounds)."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, port, iters, elements, queue):
    import pycomm  # noqa: F401  registers the backend
    from pycomm.hooks._common import _pycomm_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("pycomm", rank=rank, world_size=world)
    torch.set_num_threads(1)
    backend = _pycomm_backend(None)
    g = torch.Generator().manual_seed(rank)
    x, error = torch.randn(elements, generator=g), torch.zeros(elements)
    pairs = max(1, elements // 100)
    indices = torch.randperm(elements, generator=g)[:pairs].sort().values
    values, out, residual = torch.randn(pairs, generator=g), torch.empty(elements), torch.zeros(elements)
    # the hook issues its collectives async (queued to the group's worker thread) and waits
    # on their futures; dist.all_reduce without async_op runs inline on the caller's thread
    kinds = {
        "dense all_reduce": lambda: dist.all_reduce(x),
        "dense, async": lambda: dist.all_reduce(x, async_op=True).wait(),
        "quantized 8-bit": lambda: backend.allreduce_quantized(x, error, 8, 256, True, 1, [elements], [0]).wait(),
        "quantized, blocking": lambda: backend.allreduce_quantized(x, error, 8, 256, True, 1, [elements], [0],
                                                                   async_op=False),
        "sparse (1%, bfloat16)": lambda: backend.allreduce_sparse(indices, values, out, residual, "bfloat16", 0.02,
                                                                  [elements]).wait(),
    }
    rows = []
    for round_ in (1, 2):
        for name, call in kinds.items():
            times = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            times.sort()
            rows.append((round_, name, times[len(times) // 2], times[int(0.9 * len(times))]))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--elements", type=int, default=10)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--port", type=int, default=29641)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, args.port, args.iters, args.elements, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"# {args.ranks} ranks, {args.elements} elements, barrier then one call, {args.iters} calls per row")
    print(f"{'round':>5}  {'kind':<24}{'median us':>10}{'p90 us':>10}")
    for round_, name, median, p90 in rows:
        print(f"{round_:>5}  {name:<24}{median * 1e6:>10.0f}{p90 * 1e6:>10.0f}")


if __name__ == "__main__":
    main()
