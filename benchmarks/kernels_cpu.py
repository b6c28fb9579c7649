"""CPU compression kernels vs torch, one thread, in one run.

  * top-k of 16M float32 at density 1 %: pycomm exact and approximate vs
    torch.topk(x.abs(), k) (median time; ratio = torch / pycomm);
  * 8-bit block quantize + dequantize (block 256): GB/s of float32 input
    (4 * n bytes / (t_quantize + t_dequantize)), output buffers reused, and
    the same round trip written in torch ops for comparison.
Every figure is checked in the same pass. Usage: python benchmarks/kernels_cpu.py
"""
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


def main():
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
