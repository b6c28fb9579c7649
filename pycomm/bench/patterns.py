"""Data patterns whose all-reduce is known in closed form: the check every column passes
before it is timed, and the fill the timed loop keeps stable."""

from __future__ import annotations

import math

import torch

from .config import PREFIX

#: Largest integer every value up to which the dtype represents exactly.
EXACT_LIMIT = {
    torch.float16: 2 ** 11,
    torch.bfloat16: 2 ** 8,
    torch.float32: 2 ** 24,
    torch.float64: 2 ** 53,
    torch.int8: 2 ** 7 - 1,
    torch.uint8: 2 ** 8 - 1,
    torch.int16: 2 ** 15 - 1,
    torch.int32: 2 ** 31 - 1,
    torch.int64: 2 ** 63 - 1,
}

# Relative tolerance of the correctness check for floating dtypes. The
# patterns reduce to exactly representable integers, so only "avg" (which an
# implementation may compute as a sum of pre-divided terms) can round.
_RTOL = {
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
    torch.float32: 2e-6,
    torch.float64: 1e-12,
}

# Pattern period cap: a prime, so pattern boundaries do not line up with the
# power-of-two chunk boundaries of the algorithms (a misplaced chunk shows).
_MAX_PERIOD = 251


def pattern_period(dtype: torch.dtype, op: str, world_size: int) -> int:
    """Period of the position weights ``w[i] = i % period + 1``, kept exactly representable."""
    limit = EXACT_LIMIT[dtype]
    n = world_size
    if op in ("sum", "avg"):
        largest_factor = n * (n + 1) // 2
    elif op in ("min", "max"):
        largest_factor = n
    else:  # product: one rank contributes w[i] + 1, the others 1
        largest_factor = 1
        limit -= 1
    period = min(_MAX_PERIOD, limit // largest_factor)
    if period < 1:
        raise ValueError(
            f"{PREFIX} --op {op} over {n} ranks leaves the exactly representable range of "
            f"{dtype} (largest value {largest_factor} > {limit}); use a wider --dtype"
        )
    return period


def tiled(block: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``block`` repeated to ``count`` elements in ``dtype``, without a full-size int64 temporary."""
    out = torch.empty(count, dtype=dtype)
    length = block.numel()
    whole = count // length
    block = block.to(dtype)
    if whole:
        out[: whole * length].view(whole, length).copy_(block.expand(whole, length))
    tail = count - whole * length
    if tail:
        out[whole * length:].copy_(block[:tail])
    return out


def pattern_blocks(op: str, rank: int, world_size: int, period: int):
    """(input block, expected block) as float64, one period of the pattern (lcm with n for product)."""
    n = world_size
    if op == "product":
        length = period * n // math.gcd(period, n)
        index = torch.arange(length, dtype=torch.int64)
        weights = (index % period + 1).to(torch.float64)
        mine = (index % n) == rank
        inp = torch.where(mine, weights + 1, torch.ones_like(weights))
        return inp, weights + 1
    weights = torch.arange(period, dtype=torch.float64) + 1
    inp = weights * (rank + 1)
    if op == "sum":
        expected = weights * (n * (n + 1) // 2)
    elif op == "avg":
        expected = weights * ((n + 1) / 2)
    elif op == "min":
        expected = weights
    elif op == "max":
        expected = weights * n
    else:
        raise ValueError(f"{PREFIX} unknown op {op!r}")
    return inp, expected


def stable_fill(op: str, rank: int) -> float:
    """A fill value that repeated all-reduces keep bounded (the timed loop does not re-fill)."""
    if op == "sum":
        return 0.0
    if op == "product":
        return 1.0
    return float(rank + 1)


def matches(result: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``result`` is the closed-form ``expected`` (exact, or within _RTOL for floats)."""
    if result.dtype.is_floating_point:
        return bool(torch.allclose(result, expected, rtol=_RTOL[result.dtype], atol=0.0))
    return bool(torch.equal(result, expected))
