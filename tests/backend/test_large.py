"""All-reduce of a uint8 tensor with 2**31 + 5 elements (> 2 GiB, more
elements than a signed 32-bit count can hold) on 2 ranks through pycomm.

Inputs: element i of rank r is (i % 61) + r, so the SUM is 2 * (i % 61) + 1
(<= 121: no uint8 overflow), and an element that lands at the wrong offset
(e.g. a count or offset truncated to 32 bits) shows up as a wrong value.
Checked: a strided sample over the whole tensor, the elements around 2**31
and at the end, and the sums of a few slices. Memory: ~2 GiB per rank plus
whatever the backend allocates."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run

N = 2**31 + 5
PERIOD = 61


def _expected(idx):
    return (2 * (idx % PERIOD) + 1).to(torch.uint8)


def large_worker(ctx):
    ctx.progress("filling")
    t = torch.empty(N, dtype=torch.uint8)
    tile = (torch.arange(PERIOD * (1 << 20)) % PERIOD).to(torch.uint8)  # a multiple of the period
    for start in range(0, N, tile.numel()):
        n = min(tile.numel(), N - start)
        t[start:start + n].copy_(tile[:n])
    del tile
    t.add_(ctx.rank)
    ctx.progress("all_reduce of 2**31 + 5 uint8")
    t0 = time.monotonic()
    dist.all_reduce(t)
    seconds = time.monotonic() - t0
    ctx.progress("checking")
    failures = []
    idx = torch.cat([torch.arange(0, N, 9973), torch.arange(2**31 - 8, 2**31 + 5), torch.arange(N - 8, N)])
    got, exp = t[idx], _expected(idx)
    bad = (got != exp).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        failures.append(f"rank {ctx.rank}: {bad.numel()}/{idx.numel()} sampled elements wrong; first at "
                        f"[{int(idx[i])}]: got {int(got[i])}, expected {int(exp[i])}")
    for a, b in [(0, 1 << 20), (2**31 - (1 << 19), 2**31 + 5), (N - (1 << 20), N), (1 << 30, (1 << 30) + 12345)]:
        s = int(t[a:b].sum(dtype=torch.int64))
        e = int(_expected(torch.arange(a, b)).sum(dtype=torch.int64))
        if s != e:
            failures.append(f"rank {ctx.rank}: sum of [{a}:{b}] is {s}, expected {e}")
    return {"failures": failures, "seconds": seconds}


@pytest.mark.slow
def test_allreduce_uint8_over_2_pow_31_elements():
    res = spawn_run(large_worker, 2, make_ref=False, timeout_s=420, pg_timeout_s=300).check()
    failures = [f for r in range(2) for f in res.returns[r]["failures"]]
    assert not failures, "\n".join(failures)
    print(f"all_reduce of {N} uint8 on 2 ranks: {max(r['seconds'] for r in res.returns.values()):.1f} s")
