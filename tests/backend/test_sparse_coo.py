"""The COO all-reduce (csrc/algorithms/allreduce_coo.cc, torch's sparse tensors) over the
loopback transport, threads as ranks, through the transport algorithms and through a
node-local arena: worlds 1..9, nnz 0 / 1 / uneven / empty on some ranks, overlapping and
repeated rows, unsorted input, row widths 0 / 1 / 64, float and integer dtypes, SUM and
AVG. Expected values are the coalesced sum of every rank's rows, computed by torch;
integer-valued data makes every summation order exact, and random floats check that
every rank gets the same bits."""
from __future__ import annotations

import pytest
import torch

import loopback

WORLDS = [1, 2, 3, 4, 5, 8, 9]


def make_rank_rows(n, row_count, width, nnz_of, dtype, seed, integer=True, unsorted=True):
    g = torch.Generator().manual_seed(seed)
    rows, values = [], []
    for r in range(n):
        nnz = nnz_of(r)
        idx = torch.randint(0, row_count, (nnz,), generator=g) if row_count else torch.empty(0, dtype=torch.long)
        if not unsorted:
            idx = torch.unique(idx)
        if integer:
            val = torch.randint(-8, 9, (idx.numel(), width), generator=g).to(dtype)
        else:
            val = torch.randn(idx.numel(), width, generator=g).to(dtype)
        rows.append(idx.contiguous())
        values.append(val.contiguous())
    return rows, values


def expected(rows, values, row_count, width, op):
    n = len(rows)
    dtype = values[0].dtype
    acc = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long), torch.empty(0, width, dtype=torch.float64),
                                  (row_count, width), check_invariants=True)
    for r, v in zip(rows, values):
        acc = acc + torch.sparse_coo_tensor(r.view(1, -1), v.to(torch.float64), (row_count, width),
                                            check_invariants=True)
    acc = acc.coalesce()
    vals = acc.values()
    if op == "avg":
        vals = vals / n
    return acc.indices()[0], vals.to(dtype)


PATTERNS = {
    "uneven": lambda r: 3 + 7 * r,
    "empty_on_odd": lambda r: 0 if r % 2 else 40,
    "all_empty": lambda r: 0,
    "one": lambda r: 1,
    "many": lambda r: 600 + 13 * r,
}


@pytest.mark.parametrize("shm", [False, True], ids=["transport", "shm"])
@pytest.mark.parametrize("n", WORLDS)
def test_coo_sum_matches_coalesced_sum(n, shm):
    for name, nnz_of in PATTERNS.items():
        for row_count, width in [(50, 4), (1000, 64), (7, 1), (30, 0)]:
            rows, values = make_rank_rows(n, row_count, width, nnz_of, torch.float32, seed=n * 100 + row_count)
            outs = loopback.allreduce_coo(rows, values, row_count, shm=shm)
            exp_rows, exp_vals = expected(rows, values, row_count, width, "sum")
            for r, (got_rows, got_vals) in enumerate(outs):
                what = f"n={n} {name} rows={row_count} width={width} rank {r}"
                assert torch.equal(got_rows, exp_rows), what
                assert got_vals.shape == (exp_rows.numel(), width), what
                assert torch.equal(got_vals, exp_vals), what


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_coo_dtypes(n, dtype):
    rows, values = make_rank_rows(n, 200, 8, lambda r: 50 + r, dtype, seed=n)
    outs = loopback.allreduce_coo(rows, values, 200)
    exp_rows, exp_vals = expected(rows, values, 200, 8, "sum")
    for got_rows, got_vals in outs:
        assert torch.equal(got_rows, exp_rows)
        assert torch.equal(got_vals, exp_vals)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_coo_avg(n):
    rows, values = make_rank_rows(n, 100, 4, lambda r: 30 + 5 * r, torch.float64, seed=7 * n)
    outs = loopback.allreduce_coo(rows, values, 100, op="avg")
    exp_rows, exp_vals = expected(rows, values, 100, 4, "avg")
    for got_rows, got_vals in outs:
        assert torch.equal(got_rows, exp_rows)
        torch.testing.assert_close(got_vals, exp_vals, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shm", [False, True], ids=["transport", "shm"])
@pytest.mark.parametrize("n", [2, 3, 6])
def test_coo_random_floats_bit_identical_on_every_rank(n, shm):
    rows, values = make_rank_rows(n, 5000, 16, lambda r: 300 + 50 * r, torch.float32, seed=n, integer=False)
    outs = loopback.allreduce_coo(rows, values, 5000, shm=shm)
    exp_rows, exp_vals = expected(rows, values, 5000, 16, "sum")
    for got_rows, got_vals in outs:
        assert torch.equal(got_rows, outs[0][0])
        assert torch.equal(got_vals, outs[0][1])  # bit-identical everywhere
        assert torch.equal(got_rows, exp_rows)
        torch.testing.assert_close(got_vals, exp_vals, rtol=1e-5, atol=1e-5)


def test_coo_large_payload_crosses_many_arena_slots():
    # 3 ranks x 3000 rows x 64 float32 = 768 KB each: several 64 KiB slots per all-gather.
    rows, values = make_rank_rows(3, 1_000_000, 64, lambda r: 3000, torch.float32, seed=11)
    for shm in (False, True):
        outs = loopback.allreduce_coo(rows, values, 1_000_000, shm=shm)
        exp_rows, exp_vals = expected(rows, values, 1_000_000, 64, "sum")
        for got_rows, got_vals in outs:
            assert torch.equal(got_rows, exp_rows)
            assert torch.equal(got_vals, exp_vals)


def test_coo_usage_errors():
    rows = [torch.tensor([0, 1]), torch.tensor([2])]
    values = [torch.ones(2, 3), torch.ones(1, 3)]
    with pytest.raises(ValueError, match="only SUM and AVG"):
        loopback.allreduce_coo(rows, values, 10, op="max")
    with pytest.raises(ValueError, match="outside the tensor"):
        loopback.allreduce_coo([torch.tensor([0, 10]), torch.tensor([2])], values, 10)
