"""The all-reduce of tensor-parallel inference (docs/inference.md): one tensor, in place,
back to back, 2 KiB to 4 MiB, bfloat16 and float32, on pycomm (`dist.all_reduce`), gloo
and DeepSpeed's CPU shared-memory `inference_all_reduce` (its `deepspeed_shm_comm` op,
called as DeepSpeed's AutoTP calls it), in the same processes.

    python benchmarks/inference_allreduce.py --ranks 2 --out benchmarks/results/inference_allreduce_2ranks
    python benchmarks/inference_allreduce.py --ranks 4 --out benchmarks/results/inference_allreduce_4ranks

Per size and dtype the implementations alternate, --batches times each: a barrier, then
--calls all-reduces; a batch's figure is rank 0's time over the calls, and a figure in
the table is the median over batches (spread: min..max). DeepSpeed's op needs AVX-512BW
for bfloat16 and float16 (its kernels fault without it; DeepSpeed then falls back to
torch's all_reduce on its process group): where the CPU lacks it the table says so
instead of calling it.

Noisy neighbours (``--background-load N``): each of --batches rounds measures every
implementation twice, once on the machine as it is ("quiet") and once with N busy
processes (``sh -c 'while :; do :; done'``, started and stopped by rank 0, each bounded
by `timeout`) competing for the cores ("loaded"); the order of the two alternates from
round to round, and the implementations alternate inside each. The table gives per
implementation the quiet and loaded medians over rounds and loaded / quiet, the figure
that says how much a neighbour's load costs it (the load average before each phase is
in the JSON):

    python benchmarks/inference_allreduce.py --ranks 4 --background-load 2 --sizes 524288 \
        --dtypes float32 --out benchmarks/results/inference_allreduce_noisy
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_op(world, rank):
    """DeepSpeed's shm op, initialised as deepspeed.comm does; None where it does not build."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.comm.torch import build_shm_op
        op = build_shm_op()
    except Exception as e:  # noqa: BLE001  (reported, not hidden)
        return None, f"did not build: {type(e).__name__}: {e}"
    if op is None:
        return None, "not compatible here"
    os.environ["LOCAL_SIZE"] = str(world)
    op.initialize(world, rank)
    return op, None


class BackgroundLoad:
    """``n`` busy processes, each a shell loop bounded by ``timeout`` (so an orphan dies
    on its own if the benchmark is killed before it stops them)."""

    def __init__(self, n, limit_s=1800):
        self.n, self.limit_s, self.procs = n, limit_s, []

    def start(self):
        import subprocess
        self.procs = [subprocess.Popen(["timeout", str(self.limit_s), "sh", "-c", "while :; do :; done"])
                      for _ in range(self.n)]
        time.sleep(0.2)  # running, and the scheduler has seen them

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)
        self.procs = []


def _time(fn, t, calls, barrier):
    barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(t)
    return (time.perf_counter() - start) / calls * 1e6


def _rank(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import pycomm  # registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("pycomm", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    op, why = ds_op(world, rank) if "deepspeed" in args.impls else (None, "not asked")
    level = op.vector_kernel_level() if op is not None and hasattr(op, "vector_kernel_level") else None

    def impls_for(dtype):
        out = {}
        if "pycomm" in args.impls:
            out["pycomm"] = lambda t: dist.all_reduce(t)
        if "gloo" in args.impls:
            out["gloo"] = lambda t: dist.all_reduce(t, group=gloo)
        if op is not None:
            need = 1 if dtype == torch.float32 else 2
            if level is None or level >= need:
                out["deepspeed"] = lambda t: torch.ops.deepspeed.inference_all_reduce_(t)
        return out

    cases = []  # (dtype name, size, base tensor, implementations, calls)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for size in args.sizes:
            if size > args.max_bytes:
                continue
            n = size // torch.tensor([], dtype=dtype).element_size()
            base = torch.arange(n, dtype=torch.float32).remainder(7).to(dtype) + rank
            impls = impls_for(dtype)
            # correctness first: every implementation's sum equals the closed form
            exp = (world * torch.arange(n, dtype=torch.float32).remainder(7) + world * (world - 1) / 2).to(dtype)
            for name, fn in impls.items():
                t = base.clone()
                fn(t)
                if not torch.equal(t, exp):
                    raise AssertionError(f"{name} {dname} {size}: wrong sum")
            cases.append((dname, size, base, impls, max(4, min(args.calls, (8 << 20) // size))))

    def barrier():
        dist.barrier(group=gloo)

    rows = []
    phases = []  # with --background-load: (round, "quiet"/"loaded", load average before)
    if args.background_load:
        load = BackgroundLoad(args.background_load) if rank == 0 else None
        times = [{"quiet": {name: [] for name in impls}, "loaded": {name: [] for name in impls}}
                 for (_, _, _, impls, _) in cases]
        try:
            for b in range(args.batches):
                for phase in (("quiet", "loaded") if b % 2 == 0 else ("loaded", "quiet")):
                    if rank == 0 and phase == "loaded":
                        load.start()
                    barrier()
                    if rank == 0:
                        phases.append((b, phase, os.getloadavg()[0]))
                    for i, (_, _, base, impls, calls) in enumerate(cases):
                        t = base.clone()
                        for name, fn in impls.items():
                            times[i][phase][name].append(_time(fn, t, calls, barrier))
                    barrier()
                    if rank == 0 and phase == "loaded":
                        load.stop()
        finally:
            if rank == 0:
                load.stop()
        for (dname, size, _, impls, calls), tm in zip(cases, times):
            rows.append({"dtype": dname, "bytes": size, "calls": calls,
                         "us": {k: statistics.median(v) for k, v in tm["quiet"].items()},
                         "us_all": tm["quiet"],
                         "us_loaded": {k: statistics.median(v) for k, v in tm["loaded"].items()},
                         "us_loaded_all": tm["loaded"]})
    else:
        for dname, size, base, impls, calls in cases:
            times = {name: [] for name in impls}
            t = base.clone()
            for _ in range(args.batches):
                for name, fn in impls.items():
                    times[name].append(_time(fn, t, calls, barrier))
            rows.append({"dtype": dname, "bytes": size, "calls": calls,
                         "us": {k: statistics.median(v) for k, v in times.items()},
                         "us_all": times})
    if rank == 0:
        queue.put({"pycomm": pycomm.__file__, "rows": rows, "phases": phases, "deepspeed": {"vector_level": level, "why_not": why},
                   "loadavg": os.getloadavg()})
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--impls", default="pycomm,gloo,deepspeed")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--max-bytes", type=int, default=4 << 20)
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=SIZES,
                    help="message sizes in bytes, comma-separated (default 2 KiB to 4 MiB)")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="also measure each round with N busy processes running (see above)")
    ap.add_argument("--out")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    load = os.getloadavg()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join(120)
    result.update(ranks=args.ranks, loadavg_before=load, command=" ".join(sys.argv), cpus=os.cpu_count())
    impls = [i for i in ("pycomm", "gloo", "deepspeed") if i in args.impls]
    lines = [f"# All-reduce for TP inference, {args.ranks} ranks on {os.cpu_count()} CPUs",
             "", f"`{result['command']}`; load average (1/5/15 min) before {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
             f"after {result['loadavg'][0]:.1f}; pycomm from {os.path.dirname(result['pycomm'])}. Microseconds per call, median over {args.batches} batches (min..max). "
             f"DeepSpeed shm op: vector level {result['deepspeed']['vector_level']} "
             f"({result['deepspeed']['why_not'] or 'built'}; level 2 = AVX-512BW, needed for its 16-bit kernels).", "",
             "| dtype | bytes | " + " | ".join(impls) + " | pycomm / best other |",
             "| --- | ---: | " + " | ".join("---:" for _ in impls) + " | ---: |"]
    for row in result["rows"]:
        cells = []
        for i in impls:
            if i in row["us"]:
                v = row["us_all"][i]
                cells.append(f"{row['us'][i]:.1f} ({min(v):.0f}..{max(v):.0f})")
            else:
                cells.append("n/a (needs AVX-512BW)" if i == "deepspeed" else "n/a")
        others = [row["us"][i] for i in impls if i != "pycomm" and i in row["us"]]
        ratio = f"{row['us']['pycomm'] / min(others):.2f}" if others and "pycomm" in row["us"] else ""
        lines.append(f"| {row['dtype']} | {row['bytes']} | " + " | ".join(cells) + f" | {ratio} |")
    if args.background_load:
        phases = result["phases"]
        quiet = [f"{x[2]:.1f}" for x in phases if x[1] == "quiet"]
        loaded = [f"{x[2]:.1f}" for x in phases if x[1] == "loaded"]
        lines += ["", f"## Quiet against {args.background_load} busy background processes",
                  "", f"Rounds alternate the two phases ({args.batches} each); 1-minute load average before "
                  f"each quiet phase {', '.join(quiet)}, before each loaded phase {', '.join(loaded)}. "
                  "Microseconds per call, median over rounds (min..max); loaded / quiet per implementation.", "",
                  "| dtype | bytes | implementation | quiet | loaded | loaded / quiet |",
                  "| --- | ---: | --- | ---: | ---: | ---: |"]
        for row in result["rows"]:
            for i in impls:
                if i not in row["us"]:
                    continue
                q, lo = row["us_all"][i], row["us_loaded_all"][i]
                lines.append(f"| {row['dtype']} | {row['bytes']} | {i} | {row['us'][i]:.1f} ({min(q):.0f}..{max(q):.0f}) "
                             f"| {row['us_loaded'][i]:.1f} ({min(lo):.0f}..{max(lo):.0f}) "
                             f"| {row['us_loaded'][i] / row['us'][i]:.2f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
