"""dist.all_reduce of sparse COO tensors through pycomm, compared with gloo on the same
data in the same processes (differential), over shared memory (the default on one
host) and over TCP (PYCOMM_TRANSPORT=tcp), on 2 and 3 ranks: sparse_dim 1..3 with
dense_dim 0..2, uneven nnz, nnz 0 on some or all ranks, overlapping and repeated
indices, uncoalesced input; float32/float64/int64 (and complex64) against gloo, float16/bfloat16
against a local reference; SUM, AVG (gloo: SUM / world), and the usage errors.

Like gloo, the result is the coalesced sum, written into the tensor in place; the
Work's result and its Future's value are the tensor itself."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run


def make_sparse(rank, shape, sparse_dim, nnz, dtype, seed):
    """Uncoalesced (repeated indices), integer-valued: every summation order is exact."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dim)]) \
        if nnz else torch.empty(sparse_dim, 0, dtype=torch.long)
    if nnz >= 2:
        idx[:, -1] = idx[:, 0]  # a repeat on every rank with two or more entries
    vals = torch.randint(-4, 5, (nnz, *shape[sparse_dim:]), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, shape, check_invariants=True)


def total(tensors):
    tensors = list(tensors)
    acc = tensors[0]
    for t in tensors[1:]:
        acc = acc + t
    return acc


CASES = [
    # name, shape, sparse_dim, nnz(rank)
    ("embedding 100x16", (100, 16), 1, lambda r: 5 + 3 * r),
    ("embedding empty on odd ranks", (1000, 8), 1, lambda r: 0 if r % 2 else 30),
    ("all empty", (40, 4), 1, lambda r: 0),
    ("one entry", (40, 4), 1, lambda r: 1),
    ("sparse 2-d, dense 0", (20, 30), 2, lambda r: 10 * (r + 1)),
    ("sparse 2-d, dense 1", (6, 7, 5), 2, lambda r: 9 + r),
    ("sparse 1-d, dense 2", (50, 3, 4), 1, lambda r: 12 - 2 * r),
    ("sparse 3-d", (5, 6, 7), 3, lambda r: 25),
    ("vector", (1000,), 1, lambda r: 100 + 50 * r),
    ("dense overlap", (8, 3), 1, lambda r: 40),  # more entries than rows: full overlap
]


def sparse_worker(ctx):
    problems = []
    r, w = ctx.rank, ctx.world_size

    def check(what, got, exp):
        if not got.is_sparse or not got.is_coalesced():
            problems.append(f"{what}: result is not a coalesced sparse tensor")
            return
        exp = exp.coalesce()
        if got.shape != exp.shape or got.dtype != exp.dtype:
            problems.append(f"{what}: {got.shape} {got.dtype}, expected {exp.shape} {exp.dtype}")
        elif not torch.equal(got.indices(), exp.indices()):
            problems.append(f"{what}: indices differ from the reference")
        elif not torch.allclose(got.values().double(), exp.values().double(), rtol=1e-6, atol=1e-6):
            problems.append(f"{what}: values differ from the reference")

    for seed, (name, shape, sparse_dim, nnz_of) in enumerate(CASES):
        for dtype in (torch.float32, torch.float64, torch.int64):
            what = f"{name} {dtype}"
            ctx.progress(what)
            t = make_sparse(r, shape, sparse_dim, nnz_of(r), dtype, seed)
            mine, ref = t.clone(), t.clone()
            work = dist.all_reduce(mine, async_op=True)
            work.wait()
            if work.result()[0] is not mine and not torch.equal(work.result()[0].to_dense(), mine.to_dense()):
                problems.append(f"{what}: Work.result() is not the tensor")
            fut_value = work.get_future().value()[0]
            dist.all_reduce(ref, group=ctx.ref)  # gloo
            check(what, mine, ref)
            check(what + " (future value)", fut_value, ref)
            # exact reference: the sum of every rank's tensor, built locally
            full = total(make_sparse(q, shape, sparse_dim, nnz_of(q), dtype, seed) for q in range(w))
            check(what + " (local reference)", mine, full)
        # AVG (gloo has SUM only: compare with its SUM / world)
        t = make_sparse(r, shape, sparse_dim, nnz_of(r), torch.float64, seed)
        mine, ref = t.clone(), t.clone()
        dist.all_reduce(mine, op=dist.ReduceOp.AVG)
        dist.all_reduce(ref, group=ctx.ref)
        check(f"{name} AVG", mine, (ref.coalesce() / w))
        # 16-bit floats: against the local sum (gloo's CPU sparse add may lack them)
        for dtype in (torch.float16, torch.bfloat16):
            t = make_sparse(r, shape, sparse_dim, nnz_of(r), dtype, seed)
            dist.all_reduce(t)
            full = total(make_sparse(q, shape, sparse_dim, nnz_of(q), torch.float64, seed) for q in range(w))
            check(f"{name} {dtype}", t, full.to(dtype))

    # an embedding-sized table, blocking, several times in a row (the DDP pattern)
    for step in range(3):
        t = make_sparse(r, (100_000, 64), 1, 300 + 100 * r, torch.float32, 100 + step)
        ref = t.clone()
        dist.all_reduce(t)
        dist.all_reduce(ref, group=ctx.ref)
        check(f"100000x64 step {step}", t, ref)

    # usage errors raise at the call, naming the op; the group stays usable
    t = make_sparse(r, (10, 2), 1, 3, torch.float32, 0)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        try:
            dist.all_reduce(t.clone(), op=op)
            problems.append(f"{op}: no error")
        except ValueError as e:
            if "pycomm allreduce" not in str(e) or "SUM" not in str(e):
                problems.append(f"{op}: unexpected message {e}")
    # complex: torch hands the backend view_as_real (one more dense dimension), a new
    # tensor, so the caller's tensor stays as it was (gloo too); the Future holds the sum
    def complex_of(q):
        v = make_sparse(q, (10, 2), 1, 3, torch.float32, 0)
        return torch.sparse_coo_tensor(v._indices(), torch.complex(v._values(), -2 * v._values()), v.shape,
                                       check_invariants=True)

    got = dist.all_reduce(complex_of(r), async_op=True).get_future().wait()[0].to_dense()
    got = got if got.is_complex() else torch.view_as_complex(got)
    if not torch.equal(got, total(complex_of(q) for q in range(w)).to_dense()):
        problems.append("complex64: the Future's value is not the sum")
    # PREMUL_SUM (torch's _make_nccl_premul_sum; gloo refuses it): the factor times the sum
    t = make_sparse(r, (20, 3), 1, 6, torch.float64, 5)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.5))
    check("PREMUL_SUM 2.5", t, 2.5 * total(make_sparse(q, (20, 3), 1, 6, torch.float64, 5) for q in range(w)))
    try:
        dist.all_reduce(make_sparse(r, (20, 3), 1, 6, torch.int64, 5), op=dist._make_nccl_premul_sum(2.0))
        problems.append("PREMUL_SUM on int64: no error")
    except ValueError as e:
        if "PREMUL_SUM" not in str(e):
            problems.append(f"PREMUL_SUM on int64: unexpected message {e}")
    # an index space up to torch's limit, 2^63 - 1 rows (gloo takes it too)
    for size in ((1 << 63) - 1, (1 << 62) + 5):
        idx = torch.tensor([[0, size - 1, (1 << 61) + r, size // 2]])
        t = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0, 3.0, 4.0]) * (r + 1), (size,), check_invariants=True)
        mine, ref = t.clone(), t.clone()
        dist.all_reduce(mine)
        dist.all_reduce(ref, group=ctx.ref)
        check(f"{size} rows", mine, ref)
    x = torch.full((4,), float(r))
    dist.all_reduce(x)
    if not torch.equal(x, torch.full((4,), float(w * (w - 1) // 2))):
        problems.append("dense all_reduce after the usage errors is wrong")
    return problems


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3])
def test_sparse_allreduce_matches_gloo(world, transport):
    env = {"PYCOMM_TRANSPORT": transport}
    rets = spawn_run(sparse_worker, world, env=env, timeout_s=240, pg_timeout_s=60).check().returns
    problems = [f"rank {r}: {p}" for r in range(world) for p in rets[r]]
    assert not problems, "\n".join(problems)


MISMATCHES = {
    # rank 0's tensor, rank 1's: (sizes, sparse_dim)
    "row width": (((10, 4), 1), ((10, 5), 1)),
    # the same rows and row width, another shape (each was summed as if it matched)
    "transposed": (((4, 6), 2), ((6, 4), 2)),
    "dense sizes split": (((4, 6), 1), ((4, 2, 3), 1)),
    "vector against matrix": (((24,), 1), ((4, 6), 2)),
}


def mismatch_worker(ctx, case):
    sizes, sparse_dim = MISMATCHES[case][ctx.rank]
    idx = torch.zeros(sparse_dim, 1, dtype=torch.long)
    t = torch.sparse_coo_tensor(idx, torch.ones(1, *sizes[sparse_dim:]), sizes, check_invariants=True)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the message is the point
        return str(e)
    return "no error"


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_sparse_shape_mismatch_fails_naming_ranks(case):
    rets = spawn_run(mismatch_worker, 2, args=(case,), make_ref=False, timeout_s=120,
                     pg_timeout_s=20).check().returns
    for msg in (rets[r] for r in range(2)):
        assert "pycomm allreduce" in msg and "different sparse tensors" in msg and "rank 1" in msg, msg
