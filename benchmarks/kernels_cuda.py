"""pycomm's CUDA kernels and CUDA all-reduce against the device's own limits, in one run.

Needs a GPU and pycomm built with CUDA (benchmarks/README.md, "On a GPU machine");
without them it prints why and exits with status 2 (no traceback).

Measured, each checked for correctness in the same pass (median of --iters after warm-up,
CUDA events on the current stream):
  * copy: device-to-device copy_ of N float32; GB/s = bytes read + written (8 N) / t.
    This is the reference every kernel below is compared with.
  * reduce (kernels.reduce, the collectives' reduction kernel): out = a + b
    (float32 and bfloat16) and in place a += b; bytes = 2 reads + 1 write.
  * quantize 8-bit (block 256, stochastic) / dequantize / quantize_ef (error
    feedback): bytes = float32 in + packed out, packed in + float32 out, g + e in
    and e + packed out.
  * top-k of --topk-n float32 (default 256M) at density 0.1 % and 1 %: pycomm's
    approximate (sampled threshold) and exact selection vs torch.topk(x.abs(), k);
    ratio = t_torch / t_pycomm.
  * all-reduce of one --allreduce-mib MiB float32 CUDA tensor (default 256) between 2
    processes sharing the GPU: pycomm vs gloo in the same processes; algbw = S / t,
    busbw = algbw (2 ranks: 2(n-1)/n = 1); t = median over iterations of the slower rank.

Targets (issue "CUDA tensors"): quantize / dequantize / error feedback >= 80 % of copy
bandwidth; reduce >= 85 %; approximate top-k at 0.1-1 % >= 5x torch.topk; same-GPU
all-reduce of 256 MiB >= 10x gloo. Each row says whether its target was met.

Usage: python benchmarks/kernels_cuda.py [--quick] [--json FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch


def fail(message: str) -> None:
    print(f"kernels_cuda: {message}", file=sys.stderr)
    sys.exit(2)


def event_time(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


# --------------------------------------------------------------------------- kernels

def kernel_rows(args, K):
    rows = []
    n = args.n
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g)
    dst = torch.empty_like(a)

    t_copy = event_time(lambda: dst.copy_(a), args.iters)
    assert torch.equal(dst, a)
    copy_bw = gbps(8 * n, t_copy)
    rows.append({"kernel": "copy_ (device to device)", "n": n, "seconds": t_copy, "GB/s": copy_bw,
                 "of_copy": 1.0, "target": None})

    def bw_row(name, fn, nbytes, target):
        t = event_time(fn, args.iters)
        bw = gbps(nbytes, t)
        rows.append({"kernel": name, "n": n, "seconds": t, "GB/s": bw, "of_copy": bw / copy_bw,
                     "target": target, "met": bw / copy_bw >= target})

    # reduce: out = a + b, checked against torch's add (one rounding per element).
    out = torch.empty_like(a)
    K.reduce(a, b, "sum", out=out)
    assert torch.equal(out, a + b), "reduce float32 sum differs from a + b"
    bw_row("reduce sum float32 (out = a + b)", lambda: K.reduce(a, b, "sum", out=out), 12 * n, 0.85)
    acc = a.clone()
    bw_row("reduce sum float32 (a += b)", lambda: K.reduce(acc, b, "sum", out=acc), 12 * n, 0.85)
    ah, bh = a.bfloat16(), b.bfloat16()
    outh = torch.empty_like(ah)
    K.reduce(ah, bh, "sum", out=outh)
    assert torch.equal(outh, ah + bh), "reduce bfloat16 sum differs from a + b"
    bw_row("reduce sum bfloat16 (out = a + b)", lambda: K.reduce(ah, bh, "sum", out=outh), 6 * n, 0.85)

    # quantize 8-bit, block 256, stochastic; dequantize; error feedback.
    block = 256
    psize = K.packed_size(n, 8, block)
    packed = torch.empty(psize, dtype=torch.uint8, device="cuda")
    deq = torch.empty_like(a)
    K.quantize(a, 8, block, True, 1, out=packed)
    K.dequantize(packed, n, 8, block, out=deq)
    scale = a.view(-1, block).abs().amax(1).repeat_interleave(block) / 127 if n % block == 0 else None
    if scale is not None:
        assert torch.all((a - deq).abs() <= scale * (1 + 1e-5)), "quantize error above one step"
    bw_row("quantize 8-bit stochastic", lambda: K.quantize(a, 8, block, True, 1, out=packed),
           4 * n + psize, 0.80)
    bw_row("dequantize 8-bit", lambda: K.dequantize(packed, n, 8, block, out=deq), psize + 4 * n, 0.80)
    e = torch.zeros_like(a)
    v = a + e
    K.quantize_ef(a, e, 8, block, True, 1, out=packed)
    assert torch.equal(e, v - K.dequantize(packed, n, 8, block)), "error feedback residual wrong"
    bw_row("quantize_ef 8-bit (error feedback)", lambda: K.quantize_ef(a, e, 8, block, True, 1, out=packed),
           12 * n + psize, 0.80)
    return rows, copy_bw


def topk_rows(args, K):
    rows = []
    n = args.topk_n
    x = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    for density in (0.001, 0.01):
        k = K.topk_count(n, density)
        lo, hi = K.topk_band(k)
        t_torch = event_time(lambda: torch.topk(x.abs(), k), args.topk_iters, warmup=1)
        idx, val = K.topk(x, density, exact=False, seed=1)
        assert lo <= idx.numel() <= hi, (idx.numel(), lo, hi)
        sel = torch.zeros(n, dtype=torch.bool, device="cuda")
        sel[idx] = True
        assert x.abs()[sel].min() >= x.abs()[~sel].max(), "approximate top-k is not a top set"
        sel = None
        t_approx = event_time(lambda: K.topk(x, density, exact=False, seed=1), args.topk_iters, warmup=1)
        eidx, _ = K.topk(x, density, exact=True)
        assert torch.equal(eidx.sort().values, torch.topk(x.abs(), k).indices.sort().values)
        t_exact = event_time(lambda: K.topk(x, density, exact=True), args.topk_iters, warmup=1)
        rows.append({"kernel": f"torch.topk(|x|) density {density:g}", "n": n, "k": k, "seconds": t_torch,
                     "speedup": 1.0, "target": None})
        rows.append({"kernel": f"pycomm topk approx density {density:g}", "n": n, "k": k,
                     "selected": idx.numel(), "seconds": t_approx, "speedup": t_torch / t_approx,
                     "target": 5.0, "met": t_torch / t_approx >= 5.0})
        rows.append({"kernel": f"pycomm topk exact density {density:g}", "n": n, "k": k,
                     "seconds": t_exact, "speedup": t_torch / t_exact, "target": None})
    return rows


# --------------------------------------------------------------------------- all-reduce

def _allreduce_rank(rank, world, init_file, nbytes, iters, q):
    try:
        import torch.distributed as dist

        import pycomm  # noqa: F401  (registers the backend)

        torch.cuda.set_device(0)
        dist.init_process_group("pycomm", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        gloo = dist.new_group(backend="gloo")
        n = nbytes // 4
        base = torch.full((n,), float(rank + 1), device="cuda")
        want = float(world * (world + 1) // 2)
        result = {}
        for name, group in (("pycomm", None), ("gloo", gloo)):
            t = base.clone()
            times = []
            for it in range(iters + 2):
                t.copy_(base)
                torch.cuda.synchronize()
                dist.barrier(group=gloo)
                start = time.perf_counter()
                dist.all_reduce(t, group=group)
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                if it >= 2:
                    times.append(elapsed)
            ok = bool(torch.all(t == want).item())
            result[name] = {"times": times, "correct": ok}
        dist.destroy_process_group()
        q.put((rank, result, None))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which prints it)
        import traceback

        q.put((rank, None, f"{exc!r}\n{traceback.format_exc()}"))


def allreduce_rows(args):
    world = 2
    nbytes = args.allreduce_mib << 20
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_allreduce_rank, args=(r, world, init_file, nbytes, args.allreduce_iters, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        results, errors = {}, []
        deadline = time.time() + args.allreduce_timeout
        while len(results) + len(errors) < world and time.time() < deadline:
            try:
                rank, result, error = q.get(timeout=1.0)
            except Exception:  # noqa: BLE001  (queue.Empty: keep waiting until the deadline)
                continue
            if error:
                errors.append(f"rank {rank}: {error}")
            else:
                results[rank] = result
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors or len(results) < world:
        raise RuntimeError("all-reduce benchmark failed: " + ("; ".join(errors) or
                                                              f"timed out after {args.allreduce_timeout} s"))
    rows = []
    medians = {}
    for name in ("pycomm", "gloo"):
        slowest = [max(results[r][name]["times"][i] for r in range(world))
                   for i in range(len(results[0][name]["times"]))]
        t = statistics.median(slowest)
        medians[name] = t
        correct = all(results[r][name]["correct"] for r in range(world))
        rows.append({"collective": f"all_reduce {args.allreduce_mib} MiB float32 CUDA, 2 ranks on one GPU",
                     "backend": name, "seconds": t, "algbw GB/s": gbps(nbytes, t),
                     "busbw GB/s": gbps(nbytes, t) * 2 * (world - 1) / world, "correct": correct})
    ratio = medians["gloo"] / medians["pycomm"]
    rows[0]["vs_gloo"] = ratio
    rows[0]["target"] = 10.0
    rows[0]["met"] = ratio >= 10.0
    return rows


# --------------------------------------------------------------------------- main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=256 << 20, help="elements for copy/reduce/quantize (float32)")
    parser.add_argument("--topk-n", type=int, default=256 << 20, help="elements for top-k (float32)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--topk-iters", type=int, default=5)
    parser.add_argument("--allreduce-mib", type=int, default=256)
    parser.add_argument("--allreduce-iters", type=int, default=10)
    parser.add_argument("--allreduce-timeout", type=float, default=500.0)
    parser.add_argument("--skip-allreduce", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test of this script")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.topk_n, args.iters, args.topk_iters = 1 << 22, 1 << 22, 3, 2
        args.allreduce_mib, args.allreduce_iters = 8, 3

    if not torch.cuda.is_available():
        fail("no CUDA device visible to torch (torch.version.cuda = "
             f"{torch.version.cuda}); run this on a GPU machine, see benchmarks/README.md")
    import pycomm

    if not pycomm.built_with_cuda():
        fail("pycomm was built without CUDA; rebuild with a CUDA torch and nvcc: "
             "PYCOMM_BUILD_CUDA=1 python setup.py build_ext --inplace")
    K = pycomm._C.kernels

    props = torch.cuda.get_device_properties(0)
    header = (f"device {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__} "
              f"(CUDA {torch.version.cuda}), {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(header)
    report = {"header": header, "args": vars(args)}

    rows, copy_bw = kernel_rows(args, K)
    report["bandwidth"] = rows
    print(f"\nmemory-bound kernels, n = {args.n} float32 (GB/s = bytes read + written / median time)")
    print(f"{'kernel':<38} {'ms':>9} {'GB/s':>8} {'of copy':>8}  target")
    for r in rows:
        target = "" if r["target"] is None else f">= {r['target']:.0%}: {verdict(r['met'])}"
        print(f"{r['kernel']:<38} {r['seconds'] * 1e3:9.3f} {r['GB/s']:8.1f} {r['of_copy']:8.1%}  {target}")

    torch.cuda.empty_cache()  # kernel_rows' buffers are gone with its frame
    rows = topk_rows(args, K)
    report["topk"] = rows
    print(f"\ntop-k of {args.topk_n} float32 by magnitude (speedup = t_torch / t)")
    print(f"{'selection':<38} {'ms':>9} {'speedup':>8}  target")
    for r in rows:
        target = "" if r["target"] is None else f">= {r['target']:.0f}x: {verdict(r['met'])}"
        print(f"{r['kernel']:<38} {r['seconds'] * 1e3:9.3f} {r['speedup']:7.2f}x  {target}")

    if not args.skip_allreduce:
        torch.cuda.empty_cache()
        rows = allreduce_rows(args)
        report["allreduce"] = rows
        print(f"\nall-reduce, 2 processes sharing GPU 0 (slower rank, median of {args.allreduce_iters})")
        print(f"{'backend':<8} {'ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} {'correct':>8}  vs gloo")
        for r in rows:
            extra = ""
            if "vs_gloo" in r:
                extra = f"{r['vs_gloo']:.2f}x (target >= 10x: {verdict(r['met'])})"
            print(f"{r['backend']:<8} {r['seconds'] * 1e3:9.2f} {r['algbw GB/s']:11.2f} {r['busbw GB/s']:11.2f} "
                  f"{str(r['correct']):>8}  {extra}")
        if not all(r["correct"] for r in rows):
            fail("an all-reduce result was wrong (see the table)")
    print(f"\ncopy bandwidth of this device in this run: {copy_bw:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
