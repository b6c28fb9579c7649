"""The paths tensor-parallel inference takes through the backend (docs/inference.md):
the small bfloat16 all-reduce of a row-parallel layer under torch.inference_mode(), the
functional collectives (torch.distributed._functional_collectives, what DTensor's
redistribute and the lm_head's gather run) eagerly and inside torch.compile, and a
two-layer tensor-parallel MLP against the same MLP on one process."""
import pytest
import torch
import torch.distributed as dist

from mp_util import run_multiprocess


def _bf16_rows(rank, rows=3, cols=512):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, cols, generator=g).to(torch.bfloat16)


def _inference_worker(ctx):
    w, r = ctx.world_size, ctx.rank
    out = {}
    with torch.inference_mode():
        # a decode step's message (1 x hidden) and a prefill's (32 x hidden), bfloat16
        for rows in (1, 32):
            t = _bf16_rows(r, rows)
            assert t.is_inference()
            dist.all_reduce(t)
            out[f"sum{rows}"] = t.clone()
        t = _bf16_rows(r, 1)
        dist.all_reduce(t, async_op=True).wait()
        out["async"] = t.clone()
    return out


@pytest.mark.parametrize("w", [2, 3])
def test_bf16_allreduce_in_inference_mode(w):
    results = run_multiprocess(_inference_worker, w, timeout_s=120)
    for rows in (1, 32):
        # the reference sums in float32 and rounds once, as the shared-memory path does
        # (with 3 ranks, rounding the partial sum of two first gives other bits)
        exp = sum(_bf16_rows(j, rows).float() for j in range(w)).to(torch.bfloat16)
        for res in results:
            assert torch.equal(res[f"sum{rows}"], exp), (rows, (res[f"sum{rows}"] != exp).sum())
    exp = sum(_bf16_rows(j, 1).float() for j in range(w)).to(torch.bfloat16)
    for res in results:
        assert torch.equal(res["async"], exp)


def _funcol_worker(ctx, compiled):
    import torch.distributed._functional_collectives as funcol

    w, r = ctx.world_size, ctx.rank
    group = dist.group.WORLD

    def step(x):
        # what a row-parallel layer and a gathered lm_head do with their outputs
        y = funcol.all_reduce(x * 2, "sum", group)
        z = funcol.all_gather_tensor(y[:, :4] + r, 0, group)
        return y, z

    fn = torch.compile(step, backend="eager", fullgraph=True) if compiled else step
    x = torch.arange(8, dtype=torch.float32).reshape(1, 8) + r
    with torch.inference_mode():
        y, z = fn(x)
        y, z = y.clone(), z.clone()
    y2, z2 = fn(x)  # outside inference mode too
    # clone() waits for a functional collective's result (pickling would not)
    return {"y": y, "z": z, "y2": y2.clone(), "z2": z2.clone()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_functional_collectives(compiled):
    w = 2
    results = run_multiprocess(_funcol_worker, w, args=(compiled,), timeout_s=240)
    x = [torch.arange(8, dtype=torch.float32).reshape(1, 8) + j for j in range(w)]
    y = sum(2 * xi for xi in x)
    z = torch.cat([y[:, :4] + j for j in range(w)], 0)
    for res in results:
        assert torch.equal(res["y"], y) and torch.equal(res["y2"], y)
        assert torch.equal(res["z"], z) and torch.equal(res["z2"], z)


def _tp_mlp_worker(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    w, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (w,))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torch.inference_mode():
        y = mlp(x)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    return y.clone()  # waits for the functional all-reduce DTensor issued


def test_tensor_parallel_mlp_matches_one_process():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.inference_mode():
        ref = mlp(x).float()
    for y in run_multiprocess(_tp_mlp_worker, 2, timeout_s=180):
        # the two halves' partial sums are rounded to bfloat16 before the all-reduce
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
        assert not torch.equal(y.float(), torch.zeros_like(ref))
