"""Point-to-point latency: a ping-pong of blocking send/recv between two ranks on
this host, pycomm and a peer backend (gloo) in one run, and for comparison a
blocking 8-byte all_reduce back to back. Each configuration runs in fresh
processes, in turn, twice; each run prints three rounds of --iters round trips.

    python benchmarks/p2p_latency.py                       # pycomm over TCP, pycomm over shm, gloo
    python benchmarks/p2p_latency.py --configs pycomm:tcp,gloo --bytes 8 --iters 2000

pycomm's send/recv always go over TCP (PYCOMM_TRANSPORT picks the collectives' path).
Prints microseconds per round trip (two messages) and per all_reduce."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, backend, port, nbytes, iters, queue):
    if backend == "pycomm":
        import pycomm  # noqa: F401  registers the backend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    t = torch.zeros(max(1, nbytes // 4))
    peer = 1 - rank
    trips, reduces = [], []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
        trips.append((time.perf_counter() - start) / iters * 1e6)
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        reduces.append((time.perf_counter() - start) / iters * 1e6)
    if rank == 0:
        queue.put((trips, reduces))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="pycomm:tcp,pycomm:shm,gloo",
                        help="comma-separated backend[:PYCOMM_TRANSPORT] (default: %(default)s)")
    parser.add_argument("--bytes", type=int, default=8, help="message size (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=2000, help="round trips per round (default: %(default)s)")
    parser.add_argument("--port", type=int, default=29870)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    configs = args.configs.split(",")
    print(f"{args.bytes}-byte messages, 2 ranks, {args.iters} per round, 3 rounds (us)")
    for i, config in enumerate(configs * 2):
        backend, _, transport = config.partition(":")
        if transport:
            os.environ["PYCOMM_TRANSPORT"] = transport
        else:
            os.environ.pop("PYCOMM_TRANSPORT", None)
        mp.start_processes(_rank, args=(backend, args.port + i, args.bytes, args.iters, queue),
                           nprocs=2, start_method="spawn")
        trips, reduces = queue.get(timeout=600)
        print(f"{config:12s} send/recv round trip: {' '.join(f'{x:7.1f}' for x in trips)}   "
              f"all_reduce: {' '.join(f'{x:7.1f}' for x in reduces)}", flush=True)


if __name__ == "__main__":
    main()
