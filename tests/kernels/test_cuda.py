"""pycomm on CUDA tensors: kernels, collectives, DDP hooks (marked `gpu`).

Every test here is skipped without a CUDA device (the `gpu` marker, conftest.py).
Where torch sees a GPU, pycomm must have been built with CUDA: a CPU build there is
a failure (rebuild: benchmarks/README.md, "On a GPU machine"), not a skip.
First run on a GPU (one H100) on 2026-11-22: benchmarks/gpu_check.sh.

Tolerances (stated once):
  * reduce / divide_: bit-identical to the CPU kernels (same semantics: float16 and
    bfloat16 widen to float32 and round once; integers wrap; MIN/MAX propagate NaN).
  * exact top-k: the selected index set equals torch.topk(|x|)'s (continuous data,
    no ties); values == x[indices].
  * approximate top-k: count within topk_band(k), every selected |x| >= every
    unselected |x|, values == x[indices].
  * quantize 8/4-bit and stochastic draws: bit-identical to the CPU kernels
    (kernels/cuda/quantize.cuh); the 1-bit deterministic scale (a mean summed in a
    different order) within rel 1e-5. Error bound |x - deq| <= scale / 2 (nearest)
    or < scale (stochastic); stochastic rounding unbiased within 5 standard errors.
  * error feedback: e_new == g + e - dequantize(packed) bit for bit.
  * collectives on CUDA tensors (2 processes sharing one GPU): all-reduce equal to the
    closed form computed with torch ops (2 ranks: one rounding per element either way;
    AVG rel 1e-6), the other collectives equal to gloo on CPU copies of the same data.
  * DDP on a CUDA model: pycomm vs gloo on the same GPU, same hook: final
    parameters within 1e-5 (the hooks' arithmetic is the same torch code).
  * compressed collectives (exchange="auto") on a CUDA bucket: results and residuals
    bit-identical to the same bucket on CPU (the bucket is staged through the host).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycomm
from mp_util import spawn_run

pytestmark = pytest.mark.gpu

K = pycomm._C.kernels


@pytest.fixture(autouse=True)
def _built_with_cuda():
    if not pycomm.built_with_cuda():
        pytest.fail("torch sees a GPU but pycomm was built without CUDA: rebuild with a CUDA torch "
                    "and nvcc (PYCOMM_BUILD_CUDA=1 python setup.py build_ext --inplace)")


def gen(n, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(device)


# --------------------------------------------------------------------------- reduce

COUNTS = [0, 1, 7, 4095, 4097, (1 << 20) + 3]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def sample(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 3
        if n > 10:
            x[3] = float("nan")
            x[5] = float("inf")
        return x.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


def ops_for(dtype):
    ops = ["sum", "product", "min", "max"]
    if not dtype.is_floating_point:
        ops += ["band", "bor", "bxor"]
    return ops


def assert_same(got, want, what):
    """Equal element for element; NaN equals NaN (the GPU writes the canonical NaN where
    the CPU may keep an operand's payload)."""
    assert got.is_cuda, what
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True, msg=str(what))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES + [torch.bool], ids=str)
def test_reduce_matches_cpu_kernel(dtype):
    for n in COUNTS:
        a, b = sample(dtype, n, 1), sample(dtype, n, 2)
        for op in ops_for(dtype):
            want = K.reduce(a, b, op)
            assert_same(K.reduce(a.cuda(), b.cuda(), op), want, (op, n))
            # In place (out = a), and unaligned pointers (the scalar path).
            ac = a.cuda()
            K.reduce(ac, b.cuda(), op, out=ac)
            assert_same(ac, want, (op, n, "in place"))
            if n > 2:
                assert_same(K.reduce(a.cuda()[1:], b.cuda()[1:], op), K.reduce(a[1:], b[1:], op),
                            (op, n, "unaligned"))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_divide_matches_cpu_kernel(dtype):
    for n in COUNTS:
        x = sample(dtype, n, 3)
        assert_same(K.divide_(x.cuda(), 3), K.divide_(x.clone(), 3), n)


def test_reduce_runs_on_the_current_stream():
    """The input is written on a side stream behind ~tens of ms of device sleep: only a
    kernel ordered on that (current) stream sees the new values."""
    a, b, new = gen(1 << 22, 1), gen(1 << 22, 2), gen(1 << 22, 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        a.copy_(new)
        out = K.reduce(a, b, "sum")
    side.synchronize()
    assert torch.equal(out, new + b)


def test_reduce_usage_errors_on_cuda():
    a = gen(10)
    with pytest.raises(ValueError, match="pycomm reduce: a and b must have the same dtype, size and device"):
        K.reduce(a, a.cpu())
    with pytest.raises(ValueError, match="ReduceOp.BAND is not supported for float32"):
        K.reduce(a, a, "band")


# --------------------------------------------------------------------------- top-k

@pytest.mark.parametrize("n", [1, 1000, 1 << 20, (1 << 22) + 7])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_topk_exact_selected_set(n, density):
    x = gen(n, seed=n)
    k = K.topk_count(n, density)
    idx, val = K.topk(x, density, exact=True)
    assert idx.is_cuda and idx.numel() == k
    want = torch.topk(x.abs(), k).indices
    assert torch.equal(torch.sort(idx).values, torch.sort(want).values)
    assert torch.equal(val, x[idx])


@pytest.mark.parametrize("n", [1000, 1 << 20, (1 << 22) + 7])
@pytest.mark.parametrize("density", [0.001, 0.01])
def test_topk_approx_band_and_threshold(n, density):
    x = gen(n, seed=n + 1)
    k = K.topk_count(n, density)
    idx, val = K.topk(x, density, exact=False, seed=3)
    low, high = K.topk_band(k)
    assert low <= idx.numel() <= high
    assert torch.equal(val, x[idx])
    mask = torch.zeros(n, dtype=torch.bool, device="cuda")
    mask[idx] = True
    assert mask.sum().item() == idx.numel(), "an index was selected twice"
    if idx.numel() < n:
        assert x.abs()[mask].min() >= x.abs()[~mask].max()


def test_topk_ef_on_cuda():
    g, e = gen(100_000, 1), gen(100_000, 2) * 0.1
    v = g + e
    idx, val = K.topk_ef(g, e, 0.01, exact=True)
    assert torch.equal(val, v[idx])
    expected = v.clone()
    expected[idx] = 0
    assert torch.equal(e, expected)


# --------------------------------------------------------------------------- quantize

@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("block", [7, 256])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_matches_cpu(bits, block, stochastic):
    for n in (1, block - 1, block + 1, 100_003):
        x = gen(n, seed=n, device="cpu")
        want = K.quantize(x, bits, block, stochastic, 5)
        got = K.quantize(x.cuda(), bits, block, stochastic, 5)
        assert got.is_cuda and got.numel() == want.numel()
        deq_cpu = K.dequantize(want, n, bits, block)
        deq = K.dequantize(got, n, bits, block)
        assert deq.is_cuda
        if bits == 1 and not stochastic:
            assert torch.allclose(deq.cpu(), deq_cpu, rtol=1e-5, atol=0)
        else:
            assert torch.equal(got.cpu(), want), "codes differ from the CPU kernel"
            assert torch.equal(deq.cpu(), deq_cpu)
        # Error bound on the GPU result itself (8/4 bit).
        if bits != 1:
            levels = 127 if bits == 8 else 7
            pad = (-n) % block
            xb = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
            scale = (xb.abs().amax(1) / levels).repeat_interleave(block)[:n]
            err = (x - deq.cpu()).abs()
            bound = scale if stochastic else scale / 2
            assert torch.all(err <= bound + 1e-6 * scale * levels + 1e-30)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_unbiased_on_cuda(bits):
    n, block, seeds = 4096, 64, 300
    x = gen(n, seed=9)
    acc = torch.zeros(n, dtype=torch.float64, device="cuda")
    for s in range(seeds):
        acc += K.dequantize(K.quantize(x, bits, block, True, s), n, bits, block).double()
    mean = acc / seeds
    mx = x.abs().view(-1, block).amax(1).repeat_interleave(block).double()
    se = mx / (127 if bits == 8 else 7) / 2 / seeds ** 0.5
    assert torch.all((mean - x.double()).abs() <= 5 * se + 1e-6 * mx)


@pytest.mark.parametrize("bits", [8, 4, 1])
def test_quantize_error_feedback_on_cuda(bits):
    n = 100_003
    g, e = gen(n, 1), gen(n, 2) * 0.1
    v = g + e
    packed = K.quantize_ef(g, e, bits, 256, True, 11)
    assert torch.equal(packed, K.quantize(v, bits, 256, True, 11))
    assert torch.equal(e, v - K.dequantize(packed, n, bits, 256))


def test_kernel_usage_errors_on_cuda():
    x = gen(100)
    with pytest.raises(TypeError, match="pycomm topk: x must be float32"):
        K.topk(x.double(), 0.1)
    with pytest.raises(ValueError, match="pycomm quantize_ef: e must be a CUDA tensor"):
        K.quantize_ef(x, torch.zeros(100))
    with pytest.raises(ValueError, match="pycomm quantize: out must be"):
        K.quantize(x, 8, 64, out=torch.empty(3, dtype=torch.uint8, device="cuda"))


# --------------------------------------------------------------------------- collectives

def _data(dtype, n, salt, rank):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 10).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def _expected_allreduce(dtype, n, salt, world, op):
    """Closed form over every rank's data with torch's own ops (for 2 ranks each
    element is one operation, rounded once, as in the kernels)."""
    parts = [_data(dtype, n, salt, r) for r in range(world)]
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            acc = acc + p
        elif op == dist.ReduceOp.MAX:
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    return acc / world if op == dist.ReduceOp.AVG else acc


def collectives_worker(ctx):
    """Each collective on CUDA tensors through pycomm; all-reduce against closed-form
    results, the others against gloo on CPU copies of the same data."""
    torch.cuda.set_device(0)  # both ranks share the one GPU
    rank, world = ctx.rank, ctx.world_size
    out = {}

    def data(dtype, n, salt):
        return _data(dtype, n, salt, rank)

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN) + (
                (dist.ReduceOp.AVG,) if dtype.is_floating_point else ()):
            for n in (1, 1000, 1_000_003):
                ctx.progress(f"allreduce {dtype} {op} {n}")
                y = data(dtype, n, n).cuda()
                dist.all_reduce(y, op=op)
                out[("allreduce", str(dtype), str(op), n)] = (
                    y.cpu(), _expected_allreduce(dtype, n, n, world, op))

    # Stream semantics: the input is written on a side stream behind a device sleep when
    # all_reduce is called (the copy to host must wait for it), and the result is used by
    # a kernel launched on that stream after wait() (which must wait for the copy back).
    x = data(torch.float32, 1 << 22, 7)
    ref = x.clone()
    dist.all_reduce(ref, group=ctx.ref)
    xs = x.cuda()
    y = torch.zeros_like(xs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        y.copy_(xs)
        work = dist.all_reduce(y, async_op=True)
        work.wait()
        z = y * 2
    side.synchronize()
    out["async_stream"] = (z.cpu(), ref * 2)
    fut = dist.all_reduce(x.cuda(), async_op=True).get_future()
    out["future"] = (fut.then(lambda f: f.value()[0] + 1).wait().cpu(), ref + 1)

    ctx.progress("broadcast")
    b = data(torch.float32, 100_001, 9)
    ref = b.clone()
    dist.broadcast(ref, src=1, group=ctx.ref)
    bc = b.cuda()
    dist.broadcast(bc, src=1)
    out["broadcast"] = (bc.cpu(), ref)

    ctx.progress("all_gather_into_tensor")
    a = data(torch.float32, 50_001, 10)
    ref = torch.empty(world * a.numel())
    dist.all_gather_into_tensor(ref, a, group=ctx.ref)
    got = torch.empty(world * a.numel(), device="cuda")
    dist.all_gather_into_tensor(got, a.cuda())
    out["all_gather_into_tensor"] = (got.cpu(), ref)

    ctx.progress("all_gather")
    refs = [torch.empty_like(a) for _ in range(world)]
    dist.all_gather(refs, a, group=ctx.ref)
    gots = [torch.empty_like(a, device="cuda") for _ in range(world)]
    dist.all_gather(gots, a.cuda())
    out["all_gather"] = (torch.cat([g.cpu() for g in gots]), torch.cat(refs))

    ctx.progress("reduce_scatter_tensor")
    r = data(torch.float32, world * 30_000, 11)
    ref = torch.empty(30_000)
    dist.reduce_scatter_tensor(ref, r, group=ctx.ref)
    got = torch.empty(30_000, device="cuda")
    dist.reduce_scatter_tensor(got, r.cuda())
    out["reduce_scatter_tensor"] = (got.cpu(), ref)

    ctx.progress("all_to_all_single")
    t = data(torch.float32, world * 1000, 12)
    ref = torch.empty_like(t)
    dist.all_to_all_single(ref, t, group=ctx.ref)
    got = torch.empty_like(t, device="cuda")
    dist.all_to_all_single(got, t.cuda())
    out["all_to_all_single"] = (got.cpu(), ref)

    ctx.progress("reduce")
    t = data(torch.float32, 10_001, 13)
    ref = t.clone()
    dist.reduce(ref, dst=0, group=ctx.ref)
    got = t.cuda()
    dist.reduce(got, dst=0)
    if rank == 0:
        out["reduce"] = (got.cpu(), ref)

    ctx.progress("send/recv")
    if rank == 0:
        dist.send(data(torch.float32, 10_001, 14).cuda(), dst=1)
    elif rank == 1:
        got = torch.empty(10_001, device="cuda")
        dist.recv(got, src=0)
        out["send_recv"] = (got.cpu(), _data(torch.float32, 10_001, 14, 0))
    # from any source: the staged Work passes the receive's source on
    if rank == 0:
        dist.send(data(torch.float32, 101, 15).cuda(), dst=1, tag=3)
    elif rank == 1:
        got = torch.empty(101, device="cuda")
        src = dist.recv(got, tag=3)
        out["recv_anysource"] = (got.cpu(), _data(torch.float32, 101, 15, 0))
        out["recv_anysource_rank"] = (torch.tensor([src]), torch.tensor([0]))
    # a message shorter than the tensor: the rest of the tensor stays as it was
    if rank == 0:
        dist.send(data(torch.float32, 12, 16).cuda(), dst=1, tag=4)
    elif rank == 1:
        got = torch.full((35,), -1.0, device="cuda")
        dist.recv(got, src=0, tag=4)
        want = torch.full((35,), -1.0)
        want[:12] = _data(torch.float32, 12, 16, 0)
        out["recv_shorter_message"] = (got.cpu(), want)

    ctx.progress("usage errors")
    try:
        dist.all_reduce(torch.ones(4, 4, device="cuda").t())
        out["noncontiguous"] = "no error"
    except ValueError as e:
        out["noncontiguous"] = str(e)
    return out


def test_collectives_on_cuda_tensors_match_gloo():
    rets = spawn_run(collectives_worker, 2, timeout_s=400, pg_timeout_s=120).check().returns
    for rank, out in sorted(rets.items()):
        for key, value in out.items():
            if key == "noncontiguous":
                assert "tensors must be contiguous" in value, value
                continue
            got, want = value
            if isinstance(key, tuple) and "AVG" in key[2]:
                assert torch.allclose(got.double(), want.double(), rtol=1e-6, atol=0, equal_nan=True), (rank, key)
            else:
                assert torch.equal(got, want), (rank, key, (got - want).abs().max() if got.is_floating_point() else None)


# --------------------------------------------------------------------------- DDP hooks

def ddp_cuda_worker(ctx, hook_name):
    """DDP on a CUDA model, the same hook on pycomm and on gloo. The compressed hooks
    use the all_gather exchange here (the same torch arithmetic on both backends); the
    pycomm compressed collectives on CUDA buckets are compared with CPU buckets in
    test_compressed_hooks_stage_cuda_buckets."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm import hooks

    torch.cuda.set_device(0)

    def run(group_backend):
        torch.manual_seed(100 + ctx.rank)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        ddp = DDP(model, device_ids=[0])
        if hook_name == "allreduce":
            ddp.register_comm_hook(None, hooks.allreduce_hook)
        elif hook_name == "topk":
            ddp.register_comm_hook(hooks.TopKState(None, density=0.1, seed=1, exchange="allgather"),
                                   hooks.topk_hook)
        elif hook_name == "quantize":
            ddp.register_comm_hook(hooks.QuantizeState(None, bits=8, seed=1, exchange="allgather"),
                                   hooks.quantize_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1000 + ctx.rank)
        for step in range(20):
            ctx.progress(f"{group_backend} {hook_name} step {step}")
            x = torch.randn(16, 32, generator=g).cuda()
            y = torch.randn(16, 8, generator=g).cuda()
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    result = {"pycomm": run("pycomm")}
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=ctx.init_method("gloo_ddp_cuda"), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.timeout())
    result["gloo"] = run("gloo")
    return result


@pytest.mark.parametrize("hook_name", ["none", "allreduce", "topk", "quantize"])
def test_ddp_on_cuda_model_matches_gloo(hook_name):
    rets = spawn_run(ddp_cuda_worker, 2, args=(hook_name,), make_ref=False, timeout_s=300,
                     pg_timeout_s=60).check().returns
    for rank, out in sorted(rets.items()):
        for name, value in out["pycomm"].items():
            assert torch.allclose(value, out["gloo"][name], rtol=1e-5, atol=1e-6), (rank, name)
            assert torch.allclose(value, rets[0]["pycomm"][name], rtol=0, atol=0), (rank, name, "ranks differ")


def staged_hooks_worker(ctx):
    """pycomm's compressed collectives (exchange="auto") on a CUDA bucket and on the same
    bucket on CPU, three steps each with error feedback: results and residuals. In step 1
    one parameter's slice is zero (DDP's unused parameter): the CPU finds it with
    kernels.zero_segments, CUDA with count_nonzero, and both keep its residual."""
    from pycomm import hooks as H
    from test_hooks import _Bucket

    torch.cuda.set_device(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3000, 17, 5000)]
    out = {}
    for name, make, hook in (("topk", lambda: H.TopKState(density=0.05, seed=3), H.topk_hook),
                             ("quantize", lambda: H.QuantizeState(bits=4, seed=3), H.quantize_hook)):
        states = {"cpu": make(), "cuda": make()}
        for step in range(3):
            grads = gen(sum(p.numel() for p in params), seed=10 * step + ctx.rank, device="cpu")
            if step == 1:  # the 17-element parameter unused on this rank: its residual is held
                grads[3000:3017] = 0  # out of the step (_hold_unused: count_nonzero on CUDA)
            for dev, state in states.items():
                ctx.progress(f"{name} {dev} step {step}")
                bucket = _Bucket(params, [grads.to(dev)], 0, True)
                result = hook(state, bucket).wait()
                assert result.device.type == dev, (name, dev, result.device)
                out[(name, dev, step)] = result.cpu()
        for dev, state in states.items():
            out[(name, dev, "residuals")] = {o: r.cpu() for o, r in H.rank_state(state.state_dict())["residuals"].items()}
    return out


def test_compressed_hooks_stage_cuda_buckets():
    rets = spawn_run(staged_hooks_worker, 2, make_ref=False, timeout_s=300, pg_timeout_s=60).check().returns
    for rank, out in sorted(rets.items()):
        for name in ("topk", "quantize"):
            for step in range(3):
                assert torch.equal(out[(name, "cuda", step)], out[(name, "cpu", step)]), (rank, name, step)
            cpu_res, cuda_res = out[(name, "cpu", "residuals")], out[(name, "cuda", "residuals")]
            assert sorted(cpu_res) == sorted(cuda_res) and cpu_res, (rank, name)
            for o in cpu_res:
                assert torch.equal(cuda_res[o], cpu_res[o]), (rank, name, o)
