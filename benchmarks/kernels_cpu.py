"""CPU compression kernels vs torch, one thread, in one run.

  * top-k of 16M float32 at density 1 %: pycomm exact and approximate vs
    torch.topk(x.abs(), k) (median time; ratio = torch / pycomm); then the same on
    buffers of ties (constant, +-1, 9 levels);
  * 8-bit block quantize + dequantize (block 256): GB/s of float32 input
    (4 * n bytes / (t_quantize + t_dequantize)), output buffers reused, and
    the same round trip written in torch ops for comparison.
  * element-wise reduction dst = op(dst, src) (kernels/cpu/reduce.h, what the
    all-reduce algorithms run on every received segment): GB/s = bytes of one
    operand / median time, per dtype and op, for every instruction set this CPU
    supports (kernels.set_cpu_isa forces one), at 64 MiB per operand (memory
    bound) and 1 MiB (cache resident; includes ~2 us of Python call overhead),
    next to single-thread memcpy (torch copy_) of the same byte count.
Every figure is checked in the same pass (the reduction exactly against torch).
Usage: python benchmarks/kernels_cpu.py [--only compression|reduce]
"""
import argparse
import statistics
import time

import torch

from pycomm._C import kernels as K


def median_time(fn, iters, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def torch_quant_roundtrip(x, block):
    xb = x.view(-1, block)
    scale = xb.abs().amax(1, keepdim=True) / 127
    codes = torch.round(xb / torch.where(scale > 0, scale, torch.ones_like(scale))).to(torch.int8)
    return (codes.float() * scale).view(-1)


REDUCE_CASES = [
    # (dtype, ops)
    (torch.float32, ("sum", "min", "max", "product")),
    (torch.bfloat16, ("sum", "min", "max", "product")),
    (torch.float16, ("sum", "min", "max", "product")),
    (torch.float64, ("sum", "max")),
    (torch.int32, ("sum", "max")),
    (torch.int64, ("sum",)),
    (torch.int8, ("sum",)),
]

TORCH_OPS = {
    "sum": torch.add,
    "product": torch.mul,
    "min": torch.minimum,
    "max": torch.maximum,
}


def reduce_operands(dtype, count, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        # In [0.9, 1.1): a running sum or product stays finite and normal over the
        # timed iterations (no overflow, no subnormals slowing the timed loop).
        return (torch.rand(count, generator=g, dtype=torch.float32) * 0.2 + 0.9).to(dtype)
    return torch.randint(-100, 100, (count,), generator=g, dtype=torch.int64).to(dtype)


def reduce_rows(nbytes, isas, iters):
    """GB/s (bytes of one operand / median time) of dst = op(dst, src) per ISA."""
    rows = []
    for dtype, ops in REDUCE_CASES:
        count = nbytes // torch.empty((), dtype=dtype).element_size()
        a = reduce_operands(dtype, count, 1)
        b = reduce_operands(dtype, count, 2)
        dst = a.clone()
        for op in ops:
            want = TORCH_OPS[op](a, b)
            cells = []
            for isa in isas:
                K.set_cpu_isa(isa)
                dst.copy_(a)
                K.reduce(dst, b, op, out=dst)  # dst = op(dst, src), in place
                assert torch.equal(dst, want), (dtype, op, isa)
                # Timed on the running result: values stay finite for these ops over a few
                # iterations, and the kernel's speed does not depend on them.
                t = median_time(lambda: K.reduce(dst, b, op, out=dst), iters=iters)
                cells.append(nbytes / t / 1e9)
            rows.append((str(dtype).replace("torch.", ""), op, cells))
    K.set_cpu_isa("auto")
    return rows


def print_reduce(isas):
    print(f"element-wise reduce dst = op(dst, src), 1 thread, GB/s of one operand "
          f"(ISAs this CPU supports: {', '.join(isas)}; auto picks {K.cpu_isa()})")
    for nbytes, iters in ((64 << 20, 5), (1 << 20, 51)):
        memcpy_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        memcpy_dst = torch.empty_like(memcpy_src)
        memcpy_gbs = nbytes / median_time(lambda: memcpy_dst.copy_(memcpy_src), iters=iters) / 1e9
        rows = reduce_rows(nbytes, isas, iters)
        print()
        head = f"{nbytes >> 20} MiB per operand"
        print(f"{head:<28}" + "".join(f"{isa:>9}" for isa in isas) + f"{'best/memcpy':>13}")
        for dtype, op, cells in rows:
            print(f"{dtype + ' ' + op:<28}" + "".join(f"{c:>9.2f}" for c in cells)
                  + f"{max(cells) / memcpy_gbs:>12.2f}x")
        print(f"{'memcpy (copy_)':<28}{memcpy_gbs:>9.2f}")


def print_compression():
    n, density, block = 16 * 1024 * 1024, 0.01, 256
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    k = K.topk_count(n, density)
    lo, hi = K.topk_band(k)

    rows = []
    t_torch = median_time(lambda: torch.topk(x.abs(), k), iters=3)
    idx, _ = K.topk(x, density, exact=True)
    assert torch.equal(idx, torch.topk(x.abs(), k).indices.sort().values)
    t_exact = median_time(lambda: K.topk(x, density, exact=True), iters=5)
    a_idx, _ = K.topk(x, density, exact=False)
    assert lo <= a_idx.numel() <= hi
    t_approx = median_time(lambda: K.topk(x, density, exact=False), iters=5)
    info = K.topk_info(x, density)
    rows.append(("torch.topk(|x|)", t_torch, "1.00x", f"k={k}"))
    rows.append(("pycomm topk exact", t_exact, f"{t_torch / t_exact:.2f}x", "same set as torch"))
    rows.append(("pycomm topk approx", t_approx, f"{t_torch / t_approx:.2f}x",
                 f"selected={a_idx.numel()} band=[{lo},{hi}] path={info['path']}"))

    # Inputs whose k-th magnitude is shared by far more than k elements: the selection
    # must stay one pass (before 2026-11-27 it collected and sorted every tie: 410-500 ms
    # here against 8-15 ms for normal values; benchmarks/results/topk_ties.txt).
    g = torch.Generator().manual_seed(1)
    tied = {"constant -0.25": torch.full((n,), -0.25),
            "sign +-1": torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0),
            "9 levels": (torch.randn(n, generator=g) * 2).round().clamp(-4, 4)}
    tie_rows = []
    for name, t in tied.items():
        order = torch.sort(t.abs(), descending=True, stable=True).indices[:k].sort().values
        assert torch.equal(K.topk(t, density, exact=True)[0], order), name  # ties to the lowest index
        a_n = K.topk(t, density, exact=False)[0].numel()
        assert lo <= a_n <= hi, name
        tie_rows.append((name, median_time(lambda: K.topk(t, density, exact=True), iters=5),
                         median_time(lambda: K.topk(t, density, exact=False), iters=5)))

    packed = torch.empty(K.packed_size(n, 8, block), dtype=torch.uint8)
    out = torch.empty(n)
    K.quantize(x, 8, block, out=packed)
    K.dequantize(packed, n, 8, block, out=out)
    err = (x - out).abs().max().item()
    t_q = median_time(lambda: K.quantize(x, 8, block, out=packed), iters=7)
    t_d = median_time(lambda: K.dequantize(packed, n, 8, block, out=out), iters=7)
    t_qs = median_time(lambda: K.quantize(x, 8, block, True, 1, out=packed), iters=7)
    t_tq = median_time(lambda: torch_quant_roundtrip(x, block), iters=3)
    gbs = lambda t: 4 * n / t / 1e9
    memcpy_t = median_time(lambda: out.copy_(x), iters=7)

    print(f"pycomm CPU compression kernels: n = {n} float32, 1 thread "
          f"(torch {torch.__version__})")
    print()
    print(f"{'top-k at density 1%':<24}{'median ms':>11}{'vs torch':>10}  notes")
    for name, t, ratio, note in rows:
        print(f"{name:<24}{t * 1e3:>11.1f}{ratio:>10}  {note}")
    print()
    print(f"{'top-k 1% of tied values':<24}{'exact ms':>11}{'approx ms':>11}  (exact: the lowest-index ties, checked)")
    for name, t_e, t_a in tie_rows:
        print(f"{name:<24}{t_e * 1e3:>11.1f}{t_a * 1e3:>11.1f}")
    print()
    print(f"{'8-bit, block 256':<34}{'median ms':>11}{'GB/s':>8}")
    print(f"{'quantize (deterministic)':<34}{t_q * 1e3:>11.1f}{gbs(t_q):>8.2f}")
    print(f"{'quantize (stochastic)':<34}{t_qs * 1e3:>11.1f}{gbs(t_qs):>8.2f}")
    print(f"{'dequantize':<34}{t_d * 1e3:>11.1f}{gbs(t_d):>8.2f}")
    print(f"{'quantize + dequantize':<34}{(t_q + t_d) * 1e3:>11.1f}{gbs(t_q + t_d):>8.2f}"
          f"   max |x - deq| = {err:.4f}")
    print(f"{'torch ops round trip (reference)':<34}{t_tq * 1e3:>11.1f}{gbs(t_tq):>8.2f}")
    print(f"{'memcpy (copy_) same machine':<34}{memcpy_t * 1e3:>11.1f}{gbs(memcpy_t):>8.2f}")
    print()
    ok_topk = t_torch / t_approx >= 5
    ok_q = gbs(t_q + t_d) >= 2
    print(f"target approx top-k >= 5x torch.topk: {'met' if ok_topk else 'NOT met'}; "
          f"target 8-bit q+dq >= 2 GB/s: {'met' if ok_q else 'NOT met'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("compression", "reduce"), default=None,
                        help="run one of the two sections (default: both)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only != "reduce":
        print_compression()
    if args.only is None:
        print()
    if args.only != "compression":
        print_reduce(K.cpu_isas())


if __name__ == "__main__":
    main()
