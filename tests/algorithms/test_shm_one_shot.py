"""The shared-memory all-reduce's one-pass reduction (allreduce_shm.cc over
kernels/cpu/reduce.h's reduceMany), through the C++ algorithm with threads as ranks
(tests/loopback.py): every dtype, odd sizes, 2 to 4 ranks, both forms (whole: every rank
reduces all slots, the small messages of tensor-parallel inference; split: each rank
reduces its share of a large segment). float16 / bfloat16 are summed in float32 in rank
order and rounded once, so the result is the correctly rounded float32 sum's rounding,
the same on every rank and in both forms."""
import pytest
import torch

import loopback

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8, torch.int16]
# elements: odd counts, one under and one over a 16-bit block (512), a few segments
COUNTS = [1, 3, 511, 513, 1537]
SEGMENT = 4096  # bytes per arena slot: whole form up to 1 KiB per segment, split above


def _inputs(n, count, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        if dtype.is_floating_point:
            # magnitudes that make a second rounding of a 16-bit partial sum visible
            t = (torch.randn(count, generator=g, dtype=torch.float64) * 3 + 0.3 * r).to(dtype)
        elif dtype == torch.uint8:
            t = torch.randint(0, 60, (count,), generator=g, dtype=dtype)
        else:
            t = torch.randint(-30, 30, (count,), generator=g, dtype=dtype)
        out.append(t)
    return out


def _expected_sum(inputs):
    dtype = inputs[0].dtype
    if dtype in (torch.float16, torch.bfloat16):
        acc = inputs[0].float()
        for t in inputs[1:]:
            acc = acc + t.float()  # float32, rank order, then one rounding
        return acc.to(dtype)
    acc = inputs[0].clone()
    for t in inputs[1:]:
        acc = acc + t
    return acc


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_shm_sum_every_dtype(n, dtype):
    for count in COUNTS:
        inputs = _inputs(n, count, dtype, seed=count)
        exp = _expected_sum(inputs)
        outs = loopback.collective("allreduce", [t.clone() for t in inputs], algorithm="shm",
                                   segment_bytes=SEGMENT)
        for r, out in enumerate(outs):
            assert torch.equal(out, exp), f"rank {r}, {count} elements: {out[:8]} != {exp[:8]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16bit_rounded_once_with_three_ranks(dtype):
    """1 + 2^-8 + 2^-8 in bfloat16 (2^-7 in float16 terms of its own ulp): pairwise
    rounding loses both small terms (1 + u/2 rounds to 1, twice), one rounding of the
    float32 sum keeps them."""
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    count = 1000  # the whole form (2000 bytes <= a quarter slot of 8 KiB) and the split one
    inputs = [torch.full((count,), v, dtype=dtype) for v in (1.0, ulp / 2, ulp / 2)]
    for segment in (8192, 1024):
        outs = loopback.collective("allreduce", [t.clone() for t in inputs], algorithm="shm",
                                   segment_bytes=segment)
        for out in outs:
            assert torch.equal(out, torch.full((count,), 1.0 + ulp, dtype=dtype)), (segment, out[:4])


@pytest.mark.parametrize("op", ["max", "min", "product"])
def test_shm_other_ops_four_ranks(op):
    inputs = _inputs(4, 513, torch.float32, seed=7)
    stack = torch.stack(inputs)
    exp = {"max": stack.max(0).values, "min": stack.min(0).values, "product": stack.prod(0)}[op]
    for out in loopback.collective("allreduce", [t.clone() for t in inputs], op=op, algorithm="shm",
                                   segment_bytes=SEGMENT):
        if op == "product":  # rank order, float32: as stack.prod up to rounding order
            torch.testing.assert_close(out, exp, rtol=1e-6, atol=0)
        else:
            assert torch.equal(out, exp)
