"""Gradient compression: the reference codecs (pycomm.compression) and the DDP hooks
(pycomm.hooks) on 2 and 3 ranks.

Codec tests run in this process. Hook tests group many checks into one spawned run per
world size (spawning ranks that import torch costs seconds):

* the exchange: a hook called on hand-made buckets returns exactly the mean over ranks
  of every rank's decoded compression (all_gather exchange), bit-identical on every
  rank, and the same numbers whatever the bucket layout (DDP's bucket rebuild); on
  pycomm groups the compressed collectives (two-phase quantized, sparse all-reduce)
  match a reference computed here (quantized) and lose nothing to error feedback
  (result + residuals == inputs + old residuals);
* training: every hook lowers the loss of a small regression task; the dense
  allreduce_hook gives the same parameters as DDP without a hook; 8-bit quantization
  with error feedback ends close to dense; top-k 1% with error feedback ends within a
  stated factor of dense;
* bytes through pycomm.stats() against the dense all-reduce, for the compressed
  collectives (pycomm's default) and the all_gather exchange;
* no_sync() gradient accumulation with each hook;
* checkpoint mid-training (hook state + model + optimizer), a new model/DDP/state
  loaded from it: the following losses equal an uninterrupted run's exactly;
* DGC momentum correction (TopKState(momentum=0.9), plain SGD) ends below top-k with
  the optimizer's momentum, on both exchanges, and its momenta survive a checkpoint;
* the default owner step of the sparse all-reduce keeps 2 x density of every owned piece
  (on 2 ranks, evenly spread disjoint selections come through whole).
"""
from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import spawn_run
from pycomm import compression as C

# top-k 1% with error feedback must end within this factor of dense's final loss
TOPK_LOSS_FACTOR = 1.5
# 8-bit quantization with error feedback: final loss within this factor of dense
Q8_LOSS_FACTOR = 1.10
TRAIN_STEPS = 150
# Plain SGD: error feedback with heavy momentum (0.9) made top-k 1% diverge on this task
# (DGC's momentum correction is not implemented); see docs/compression.md.
TRAIN_LR = 0.2


# ---------------------------------------------------------------------------
# codecs (this process)
# ---------------------------------------------------------------------------

def _block_scales(x, block, reduce):
    n = x.numel()
    out = []
    for start in range(0, n, block):
        b = x[start: start + block].abs().float()
        out.append(b.max() if reduce == "max" else b.mean())
    return torch.stack(out) if out else torch.empty(0)


@pytest.mark.parametrize("n,block", [(1, 256), (255, 256), (256, 256), (257, 256), (1000, 64), (999, 7)])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_error_bound_and_sizes(n, block, bits):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[: n // 3] *= 100  # blocks of very different magnitude
    levels = 2 ** (bits - 1) - 1
    scales = _block_scales(x, block, "max")
    per_element = scales.repeat_interleave(block)[:n]
    for stochastic in (False, True):
        q = C.quantize_blockwise(x, bits, block, stochastic, torch.Generator().manual_seed(1))
        assert q.codes.dtype == torch.uint8 and q.codes.numel() == math.ceil(n * bits / 8)
        assert q.scales.dtype == torch.float32 and torch.equal(q.scales, scales)
        assert q.nbytes() == C.compressed_nbytes(n, "quantize", bits=bits, block=block)
        err = (C.dequantize_blockwise(q) - x).abs()
        bound = per_element / levels * (1.0 if stochastic else 0.5)
        assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), f"max err/bound {(err / bound).max():.4f}"


@pytest.mark.parametrize("n,block", [(1, 256), (9, 8), (1000, 256), (257, 256)])
def test_one_bit_sign_and_mean_scale(n, block):
    x = torch.randn(n, generator=torch.Generator().manual_seed(7))
    q = C.quantize_blockwise(x, 1, block)
    assert q.codes.numel() == math.ceil(n / 8)
    assert q.nbytes() == C.compressed_nbytes(n, "quantize", bits=1, block=block)
    scales = _block_scales(x, block, "mean")
    assert torch.allclose(q.scales, scales, rtol=1e-6)
    d = C.dequantize_blockwise(q)
    expected = torch.where(x >= 0, 1.0, -1.0) * scales.repeat_interleave(block)[:n]
    assert torch.allclose(d, expected, rtol=1e-6)


def test_packed_formats():
    # 4 bits: q + 8 per nibble, element 2j low nibble of byte j
    q = C.quantize_blockwise(torch.tensor([2.0, -2.0, 0.0]), 4, 256)
    assert q.codes.tolist() == [15 | (1 << 4), 8]  # codes 7, -7, 0
    assert q.scales.tolist() == [2.0]
    # 8 bits: int8 two's complement
    q = C.quantize_blockwise(torch.tensor([1.0, -1.0, 0.5]), 8, 256)
    assert q.codes.view(torch.int8).tolist() == [127, -127, 64]
    # 1 bit: element 8j+b is bit b of byte j
    x = torch.tensor([1.0, -1, 1, 1, -1, -1, -1, -1, 1])
    q = C.quantize_blockwise(x, 1, 256)
    assert q.codes.tolist() == [1 | 4 | 8, 1]
    for bits in (8, 4, 1):
        v = torch.randint(0, 2 ** bits, (37,), dtype=torch.uint8)
        assert torch.equal(C.unpack_bits(C.pack_bits(v, bits), bits, 37), v)
    assert C.compressed_nbytes(1000, "topk", density=0.01) == 10 * 8
    assert C.compressed_nbytes(1000, "topk", k=3, value_bytes=2) == 18
    assert C.compressed_nbytes(1000, "dense") == 4000
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(300).to(dtype)
        d = C.dequantize_blockwise(C.quantize_blockwise(x, 8, 64), dtype)
        assert d.dtype == dtype and (d.float() - x.float()).abs().max() < 0.05
    with pytest.raises(ValueError, match="pycomm quantize: bits must be 8, 4 or 1"):
        C.quantize_blockwise(torch.randn(4), 2)
    with pytest.raises(ValueError, match="1-D"):
        C.quantize_blockwise(torch.randn(2, 2))


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    trials, n, block = 4000, 64, 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(11)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(trials):
        total += C.dequantize_blockwise(C.quantize_blockwise(x, bits, block, True, g)).double()
    mean = total / trials
    step = _block_scales(x, block, "max").repeat_interleave(block).double() / (2 ** (bits - 1) - 1)
    sd_of_mean = step / 2 / math.sqrt(trials)  # rounding error lies in (-step, step), variance <= step^2/4
    z = ((mean - x.double()).abs() / sd_of_mean).max().item()
    assert z < 5.0, f"stochastic rounding looks biased: max |mean - x| = {z:.2f} standard errors"
    # not vacuous: deterministic rounding is biased well beyond that
    det = C.dequantize_blockwise(C.quantize_blockwise(x, bits, block, False)).double()
    assert ((det - x.double()).abs() / sd_of_mean).max().item() > 20
    # seeded: the same generator state gives the same codes
    a = C.quantize_blockwise(x, bits, block, True, torch.Generator().manual_seed(5))
    b = C.quantize_blockwise(x, bits, block, True, torch.Generator().manual_seed(5))
    assert torch.equal(a.codes, b.codes)


def test_topk_exact_selects_the_largest_magnitudes():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    for k in (0, 1, 100, 9_999, 10_000, 20_000):
        idx, val = C.topk_exact(x, k)
        kk = min(k, x.numel())
        expected = set(torch.argsort(x.abs(), descending=True)[:kk].tolist())
        assert set(idx.tolist()) == expected and len(idx) == kk
        assert torch.equal(val, x[idx])
    idx, val = C.topk_exact(torch.tensor([0.5, -3.0, 2.0], dtype=torch.float16), 2)
    assert sorted(idx.tolist()) == [1, 2] and val.dtype == torch.float16


def test_topk_approx_density_band():
    n, k = 200_000, 2_000  # 1%
    # Data and samples are seeded: the estimate ranks 20 of 2,000 sampled elements, so
    # counts spread by about 1/sqrt(20) = 22%; over 400 (data, sample) seeds 1% of the
    # counts fell outside [0.5 k, 2 k] (lowest 0.38 k), so unseeded data made this flaky.
    x = (torch.randn(n, generator=torch.Generator().manual_seed(4))
         * torch.rand(n, generator=torch.Generator().manual_seed(5)) ** 2)
    counts = []
    for seed in range(10):
        idx, val = C.topk_approx(x, k, generator=torch.Generator().manual_seed(seed))
        counts.append(idx.numel())
        # one threshold: every kept |x| >= every dropped |x|
        kept = torch.zeros(n, dtype=torch.bool)
        kept[idx] = True
        assert x[kept].abs().min() >= x[~kept].abs().max()
        assert torch.equal(val, x[idx])
        capped, _ = C.topk_approx(x, k, generator=torch.Generator().manual_seed(seed), max_k=k)
        assert capped.numel() <= k
    assert all(0.5 * k <= c <= 2 * k for c in counts), counts
    assert 0.8 * k <= sum(counts) / len(counts) <= 1.25 * k, counts
    # small tensors: the sample is the whole tensor, so the selection is exact
    small = torch.randn(500)
    idx, _ = C.topk_approx(small, 25)
    assert set(idx.tolist()) == set(C.topk_exact(small, 25)[0].tolist())


@pytest.mark.parametrize("kind", ["TopKState", "QuantizeState"])
def test_a_parameter_at_a_dead_ones_id_gets_an_ordinal_of_its_own(kind):
    # One state over tensors that come and go (pycomm-bench's compressed columns: a new
    # buffer per message size; a model rebuilt under the same state): CPython gives a new
    # tensor the id() of one just freed. The state used to number a parameter by the size
    # of its table, which that tensor overwrote without growing, so the next new parameter
    # got the same number: two parameters of different sizes on one residual, a ValueError
    # on the ranks where the id came back while the others waited in the collective (CI:
    # test_calibrate_and_cache stalled 300 s).
    from pycomm import hooks as H

    state = getattr(H, kind)()
    kept, first = torch.zeros(3), torch.zeros(5)
    ordinals = [state._ordinal(kept), state._ordinal(first)]
    dead = id(first)
    del first
    reborn = None
    for _ in range(1000):
        candidate = torch.zeros(7)
        if id(candidate) == dead:
            reborn = candidate
            break
        del candidate
    assert reborn is not None, "CPython reused no id in 1000 tensors: this test no longer reaches its case"
    fresh = torch.zeros(9)
    ordinals += [state._ordinal(reborn), state._ordinal(fresh)]
    assert ordinals == [0, 1, 2, 3]
    assert (state._ordinal(kept), state._ordinal(reborn), state._ordinal(fresh)) == (0, 2, 3)  # stable


# ---------------------------------------------------------------------------
# multi-process helpers
# ---------------------------------------------------------------------------

def _hook_configs():
    """name -> (state factory, hook); built inside the ranks."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper
    from pycomm import hooks as H

    return {
        "dense": (lambda: None, None),
        "allreduce": (lambda: H.AllreduceState(), H.allreduce_hook),
        "allreduce_ring": (lambda: H.AllreduceState(algorithm="ring"), H.allreduce_hook),
        "topk1%": (lambda: H.TopKState(density=0.01, exact=True), H.topk_hook),
        "topk1%_approx": (lambda: H.TopKState(density=0.01), H.topk_hook),
        "topk1%_fp16": (lambda: H.TopKState(density=0.01, exact=True), H.fp16_wrapper(H.topk_hook)),
        "q8": (lambda: H.QuantizeState(bits=8), H.quantize_hook),
        "q4": (lambda: H.QuantizeState(bits=4), H.quantize_hook),
        "q1": (lambda: H.QuantizeState(bits=1), H.quantize_hook),
        "q4_bf16": (lambda: H.QuantizeState(bits=4), H.bf16_wrapper(H.quantize_hook)),
        "q8_torch_fp16": (lambda: H.QuantizeState(bits=8), fp16_compress_wrapper(H.quantize_hook)),
        "topk1%_ag": (lambda: H.TopKState(density=0.01, exact=True, exchange="allgather"), H.topk_hook),
        "q4_ag": (lambda: H.QuantizeState(bits=4, exchange="allgather"), H.quantize_hook),
        "allreduce_fp16": (lambda: None, H.fp16_wrapper(H.allreduce_hook)),
    }


def _student(seed=0, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1))


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(100_000 * micro + 1000 * step + rank)
    x = torch.randn(32, 32, generator=g)
    torch.manual_seed(12345)
    w1 = torch.randn(32, 16) / math.sqrt(32)
    w2 = torch.randn(16, 1) / math.sqrt(16) * 2
    return x, torch.tanh(x @ w1) @ w2


def _wrap(model, state, hook, cap_mb=0.004):
    # a small bucket cap: several buckets, and DDP's rebuild after the first iteration
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def _steps(ctx, ddp, opt, start, steps, label):
    """Steps ``start`` .. ``start + steps - 1`` on this rank's batches; returns the losses."""
    losses = []
    for step in range(start, start + steps):
        ctx.progress(f"{label} step {step}")
        x, y = _batch(ctx.rank, step)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train(ctx, name, steps, *, lr=TRAIN_LR, momentum=0.0, start=0, model=None, state=None, opt=None):
    """Train ``steps`` SGD steps with hook ``name``; returns (model, losses)."""
    factory, hook = _hook_configs()[name]
    model = model if model is not None else _student()
    ddp = _wrap(model, state if state is not None else factory(), hook)
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return model, _steps(ctx, ddp, opt, start, steps, f"train {name}")


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _Bucket:
    """Stands in for dist.GradBucket: a flat buffer over some parameters."""

    def __init__(self, params, grads, index, last):
        self._params = params
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._index, self._last = index, last

    def buffer(self):
        return self._buffer

    def set_buffer(self, t):
        self._buffer = t

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def _run_buckets(state, hook, params, grads_by_param, layout):
    """One step over buckets given as lists of parameter positions; returns per-param results."""
    out = {}
    for b, positions in enumerate(layout):
        bucket = _Bucket([params[i] for i in positions], [grads_by_param[i] for i in positions], b,
                         b == len(layout) - 1)
        result = hook(state, bucket).wait()
        offset = 0
        for i in positions:
            out[i] = result[offset: offset + params[i].numel()].clone()
            offset += params[i].numel()
    return [out[i] for i in range(len(params))]


def _exchange_checks(ctx):
    """Hooks on hand-made buckets: exact mean of decoded contributions; layout invariance."""
    from pycomm import hooks as H

    world, problems = ctx.world_size, []
    shapes = [(300,), (40, 25), (7,), (1,)]
    params = [torch.zeros(s) for s in shapes]

    def grads(rank, step):
        g = torch.Generator().manual_seed(50 + 7 * rank + 1000 * step)
        return [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]

    def ref_topk(x, density):
        idx, val = C.topk_exact(x, C.topk_count(x.numel(), density))
        out = torch.zeros_like(x)
        out[idx] = val
        return out

    ag = {"exchange": "allgather"}  # the reference exchange, on every backend
    cases = {
        "topk": (lambda: H.TopKState(density=0.05, exact=True, error_feedback=False, **ag), H.topk_hook,
                 lambda x: ref_topk(x, 0.05)),
        "q8": (lambda: H.QuantizeState(bits=8, block=32, stochastic=False, error_feedback=False, **ag),
               H.quantize_hook, lambda x: C.dequantize_blockwise(C.quantize_blockwise(x, 8, 32))),
        "q4": (lambda: H.QuantizeState(bits=4, block=32, stochastic=False, error_feedback=False, **ag),
               H.quantize_hook, lambda x: C.dequantize_blockwise(C.quantize_blockwise(x, 4, 32))),
        "q1": (lambda: H.QuantizeState(bits=1, block=32, error_feedback=False, **ag), H.quantize_hook,
               lambda x: C.dequantize_blockwise(C.quantize_blockwise(x, 1, 32))),
    }
    results = {}
    for name, (factory, hook, codec) in cases.items():
        ctx.progress(f"exchange {name}")
        got = _run_buckets(factory(), hook, params, grads(ctx.rank, 0), [[0, 1], [2, 3]])
        for i in range(len(shapes)):
            expected = sum(codec(grads(r, 0)[i].reshape(-1)) for r in range(world)) / world
            if not torch.allclose(got[i], expected, rtol=1e-6, atol=1e-7):
                problems.append(f"{name}: parameter {i}: result is not the mean of the ranks' decoded "
                                f"contributions (max diff {(got[i] - expected).abs().max():.3g})")
        results[name] = torch.cat(got)
    # error feedback: residual = input - what was sent
    state = H.TopKState(density=0.05, exact=True, **ag)
    _run_buckets(state, H.topk_hook, params, grads(ctx.rank, 0), [[0, 1, 2, 3]])
    for i in range(len(shapes)):
        g = grads(ctx.rank, 0)[i].reshape(-1)
        if not torch.equal(state._residuals[i], g - ref_topk(g, 0.05)):
            problems.append(f"topk: residual of parameter {i} is not input - sent")
    if H._common._is_pycomm(None):
        problems += _collective_checks(ctx, params, grads, results)
    # layout invariance with error feedback and stochastic rounding over three steps
    # (on pycomm groups through the compressed collectives, elsewhere all_gather)
    layouts = ([[0, 1, 2, 3]], [[3, 2], [1, 0]], [[1], [0, 3], [2]])
    for name, factory, hook in (("topk_ef", lambda: H.TopKState(density=0.05), H.topk_hook),
                                ("topk_ef_bf16", lambda: H.TopKState(density=0.05, value_dtype="bfloat16"),
                                 H.topk_hook),
                                ("q4_ef", lambda: H.QuantizeState(bits=4, block=32), H.quantize_hook),
                                ("q1_ef", lambda: H.QuantizeState(bits=1, block=32), H.quantize_hook)):
        runs = []
        for layout in layouts:
            state = factory()
            # the first step fixes parameter ordinals (the first DDP iteration); later steps vary
            steps = [_run_buckets(state, hook, params, grads(ctx.rank, s),
                                  layouts[0] if s == 0 else layout) for s in range(3)]
            runs.append(torch.cat([torch.cat(s) for s in steps]))
        if not all(torch.equal(runs[0], r) for r in runs[1:]):
            problems.append(f"{name}: results depend on the bucket layout")
        results[name] = runs[0]
    # usage errors
    for make in (lambda: H.TopKState(exchange="ring"), lambda: H.QuantizeState(exchange=None),
                 lambda: H.TopKState(value_dtype="int8")):
        try:
            make()
            problems.append("a bad exchange / value_dtype was accepted")
        except ValueError as exc:
            if "pycomm" not in str(exc):
                problems.append(f"unexpected message: {exc}")
    try:
        H.topk_hook(None, _Bucket(params, grads(0, 0), 0, True))
        problems.append("topk_hook accepted state=None")
    except TypeError as exc:
        if "pycomm topk_hook: state must be a TopKState" not in str(exc):
            problems.append(f"unexpected message: {exc}")
    return problems, results


def _collective_checks(ctx, params, grads, results):
    """pycomm groups: the hooks' compressed collectives against references computed here."""
    from pycomm import _C
    from pycomm import hooks as H

    K, world, problems = _C.kernels, ctx.world_size, []

    def kcodec(x, bits, block):  # the C++ codec over one parameter
        x = x.reshape(-1).contiguous()
        return K.dequantize(K.quantize(x, bits, block), x.numel(), bits, block)

    # deterministic quantization without error feedback: owners' chunks are whole blocks
    # of each parameter, so the result is codec(sum_r codec(g_r)) / world, bit for bit
    for bits in (8, 4, 1):
        state = H.QuantizeState(bits=bits, block=32, stochastic=False, error_feedback=False)
        got = _run_buckets(state, H.quantize_hook, params, grads(ctx.rank, 0), [[0, 1], [2, 3]])
        for i in range(len(params)):
            acc = None
            for r in range(world):
                d = kcodec(grads(r, 0)[i], bits, 32)
                acc = d if acc is None else acc + d
            expected = kcodec(acc, bits, 32) / world
            if not torch.equal(got[i], expected):
                problems.append(f"allreduce_quantized q{bits}: parameter {i} differs from "
                                f"codec(sum of codecs) / world (max diff {(got[i] - expected).abs().max():.3g})")
        results[f"pycomm_q{bits}"] = torch.cat(got)
    # the default owner step keeps 2 x density of every owned piece: with the ranks' top-k
    # entries disjoint and spread evenly (rank r: positions r, r + 20, r + 40, ...; k = 20 of
    # 400), every owner keeps min(union in its piece, ceil(0.1 piece)) entries; on 2 ranks that
    # is the whole union, so the result is the exact mean of the ranks' selections. (owner
    # keeping only `density`, the default before: half of the union dropped.)
    n, k = 400, 20
    owner_params = [torch.zeros(n)]

    def spread(rank):
        g = torch.full((n,), 1e-3)
        g[torch.arange(k) * (n // k) + rank] = 1.0 + rank
        return g

    got = _run_buckets(H.TopKState(density=0.05), H.topk_hook, owner_params, [spread(ctx.rank)], [[0]])[0]
    union = sum(torch.where(spread(r) >= 1.0, spread(r), torch.zeros(n)) for r in range(world)) / world
    bounds = [0]
    for c in range(world):  # balanced pieces, the first n % world one longer (comm.cc balancedOffsets)
        bounds.append(bounds[-1] + n // world + (1 if c < n % world else 0))
    want = sum(min(int((union[lo:hi] != 0).sum()), math.ceil(0.1 * (hi - lo) - 1e-9))
               for lo, hi in zip(bounds, bounds[1:]))
    if int((got != 0).sum()) != want:
        problems.append(f"default owner step: {int((got != 0).sum())} entries in the result, expected {want} "
                        f"(owners keep 2 x density of their pieces)")
    if world == 2 and not torch.allclose(got, union):
        problems.append(f"default owner step on 2 ranks: the result is not the mean of the ranks' selections "
                        f"(max diff {(got - union).abs().max():.3g})")
    # error feedback loses nothing: world * result + sum of new residuals == sum over ranks of
    # (gradient + old residual), for the sparse and the quantized all-reduce, over two steps
    for name, factory, hook in (
            ("topk", lambda: H.TopKState(density=0.05), H.topk_hook),
            ("topk_bf16", lambda: H.TopKState(density=0.05, value_dtype="bfloat16"), H.topk_hook),
            ("q4", lambda: H.QuantizeState(bits=4, block=32), H.quantize_hook),
            ("q1", lambda: H.QuantizeState(bits=1, block=32), H.quantize_hook)):
        state = factory()
        old = torch.zeros(sum(p.numel() for p in params))
        for step in range(2):
            got = torch.cat(_run_buckets(state, hook, params, grads(ctx.rank, step), [[0, 1], [2, 3]]))
            new = torch.cat([state._residuals[i].reshape(-1) for i in range(len(params))])
            both = torch.stack([old, new])
            gathered = [torch.empty_like(both) for _ in range(world)]
            dist.all_gather(gathered, both)
            inputs = sum(torch.cat([g.reshape(-1) for g in grads(r, step)]) for r in range(world))
            inputs = inputs + sum(t[0] for t in gathered)
            lost = (got * world + sum(t[1] for t in gathered) - inputs).abs().max().item()
            if lost > 1e-5 * inputs.abs().max().item() * world:
                problems.append(f"{name} step {step}: result + residuals differ from the inputs by {lost:.3g}")
            if (got - inputs / world).abs().max() == 0:
                problems.append(f"{name} step {step}: no compression happened")
            old = new.clone()
    return problems


def _bytes_checks(ctx):
    """Bytes sent per step through pycomm.stats(), each hook against dense."""
    import pycomm

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64))

    steps, sent = 3, {}
    for name in ("allreduce", "topk1%", "topk1%_fp16", "q8", "q4", "q1", "topk1%_ag", "q4_ag"):
        factory, hook = _hook_configs()[name]
        m = model()
        ddp = DDP(m)  # one bucket
        ddp.register_comm_hook(factory(), hook)
        x = torch.randn(8, 256)
        ddp(x).sum().backward()  # first iteration (bucket rebuild) not counted
        dist.barrier()
        pycomm.reset_stats()
        for _ in range(steps):
            ctx.progress(f"bytes {name}")
            ddp(x).sum().backward()
        sent[name] = pycomm.stats()["bytes_sent"] / steps
        dist.barrier()
    numels = [p.numel() for p in model().parameters()]
    return sent, numels


def _no_sync_checks(ctx):
    """Two micro-batches under no_sync(), then a synchronised one, with each hook."""
    from pycomm import hooks as H

    world, problems, out = ctx.world_size, [], {}
    configs = {
        "allreduce": (H.AllreduceState(), H.allreduce_hook, 1e-6),
        "topk_dense_fallback": (H.TopKState(density=1.0, exact=True, value_dtype="float32"), H.topk_hook, 1e-6),
        "topk1%": (H.TopKState(density=0.01), H.topk_hook, None),
        "q8_det": (H.QuantizeState(bits=8, stochastic=False), H.quantize_hook, 0.02),
        "q4": (H.QuantizeState(bits=4), H.quantize_hook, None),
        "q1": (H.QuantizeState(bits=1), H.quantize_hook, None),
    }
    for name, (state, hook, tol) in configs.items():
        calls = [0]

        def counting(state, bucket, hook=hook):  # DDP wants a parameter named "bucket"
            calls[0] += 1
            return hook(state, bucket)

        model = _student()
        ddp = _wrap(model, state, counting)
        twin = _student()  # a local copy to compute every rank's accumulated gradient
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(12):
            ctx.progress(f"no_sync {name} step {step}")
            opt.zero_grad()
            with ddp.no_sync():
                for micro in range(2):
                    x, y = _batch(ctx.rank, step, micro)
                    F.mse_loss(ddp(x), y).backward()
            calls_before = calls[0]
            x, y = _batch(ctx.rank, step, 2)
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            losses.append(loss.item())
            if calls[0] == calls_before:
                problems.append(f"{name}: the hook did not run on the synchronised step")
            if step == 0 and tol is not None:
                twin.load_state_dict(model.state_dict())
                ref = None
                for r in range(world):
                    twin.zero_grad()
                    for micro in range(3):
                        xb, yb = _batch(r, step, micro)
                        F.mse_loss(twin(xb), yb).backward()
                    g = torch.cat([p.grad.reshape(-1) for p in twin.parameters()])
                    ref = g if ref is None else ref + g
                ref /= world
                got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                rel = ((got - ref).norm() / ref.norm()).item()
                if rel > tol:
                    problems.append(f"{name}: accumulated gradient differs from the dense mean "
                                    f"(relative error {rel:.3g} > {tol})")
            opt.step()
        if getattr(state, "step", 12) != 12:
            problems.append(f"{name}: state counted {state.step} steps, expected 12 synchronised ones")
        out[name] = (losses, _flat(model))
    return problems, out


def _checkpoint_checks(ctx):
    """Interrupted (checkpoint, new model/DDP/state/optimizer, load) vs uninterrupted."""
    from pycomm import hooks as H

    problems, total, cut = [], 14, 6
    factories = {
        "topk_warmup": lambda: H.TopKState(density=0.01, warmup_steps=2),
        "q4_stochastic": lambda: H.QuantizeState(bits=4, block=64),
        "q1": lambda: H.QuantizeState(bits=1),
        "allreduce": lambda: H.AllreduceState(),
    }
    hooks = {"topk_warmup": H.topk_hook, "q4_stochastic": H.quantize_hook, "q1": H.quantize_hook,
             "allreduce": H.allreduce_hook}

    def run(name, steps, start, model, state, opt_state=None):
        ddp = _wrap(model, state, hooks[name])
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        return _steps(ctx, ddp, opt, start, steps, f"checkpoint {name}"), opt

    for name, factory in factories.items():
        full, _ = run(name, total, 0, _student(), factory())
        model, state = _student(), factory()
        first, opt = run(name, cut, 0, model, state)
        blob = io.BytesIO()
        torch.save({"hook": state.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, blob)
        del model, state, opt
        blob.seek(0)
        ckpt = torch.load(blob, weights_only=True)
        model2, state2 = _student(seed=99), factory()  # different weights until loaded
        model2.load_state_dict(ckpt["model"])
        state2.load_state_dict(ckpt["hook"])
        second, _ = run(name, total - cut, cut, model2, state2, ckpt["opt"])
        # A dense all-reduce's summation order follows the bucket layout (ring chunks), which
        # differs between a rebuilt DDP and a fresh one: bitwise only where a+b is all there is.
        exact = name != "allreduce" or ctx.world_size == 2
        if exact and first + second != full or not exact and not torch.allclose(
                torch.tensor(first + second), torch.tensor(full), rtol=1e-5):
            diffs = [abs(a - b) for a, b in zip(first + second, full)]
            problems.append(f"{name}: resumed losses differ from the uninterrupted run "
                            f"(max |diff| {max(diffs):.3g}; first differing step "
                            f"{next(i for i, d in enumerate(diffs) if d)})")
        if name != "allreduce" and not H.rank_state(ckpt["hook"])["residuals"] and name != "topk_warmup":
            problems.append(f"{name}: checkpoint holds no residuals")
        if name == "topk_warmup" and not H.rank_state(ckpt["hook"])["residuals"]:
            problems.append("topk_warmup: checkpoint holds no residuals after warm-up")
    return problems


def _momentum_checks(ctx):
    """DGC momentum correction (TopKState(momentum=0.9) with plain SGD) against top-k with the
    optimizer's momentum, on both exchanges; and a checkpoint round trip of the momenta."""
    from pycomm import hooks as H

    problems, out, lr = [], {}, 0.01
    runs = {
        # every parameter sparsified (min_compression_rate=0, as on the all_gather exchange):
        # with the small ones averaged apart (the default) the two end level on this task
        # (2 ranks: 0.1022 with DGC, 0.1010 without; docs/compression.md, DGC bullet)
        "topk_sgd_momentum": (lambda: H.TopKState(density=0.01, min_compression_rate=0), 0.9),
        "topk_dgc": (lambda: H.TopKState(density=0.01, momentum=0.9, min_compression_rate=0), 0.0),
        "topk_dgc_allgather": (lambda: H.TopKState(density=0.01, momentum=0.9, exchange="allgather"), 0.0),
    }
    for name, (factory, momentum) in runs.items():
        model = _student()
        ddp = _wrap(model, factory(), H.topk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        out[name] = (_steps(ctx, ddp, opt, 0, TRAIN_STEPS, f"momentum {name}"), _flat(model))
    plain = _tail(out["topk_sgd_momentum"][0])
    for name in ("topk_dgc", "topk_dgc_allgather"):
        losses = out[name][0]
        if not _tail(losses) < 0.5 * sum(losses[:10]) / 10:
            problems.append(f"{name}: loss went from {sum(losses[:10]) / 10:.4f} to only {_tail(losses):.4f}")
        # (0.75 x before the owners kept 2 x density by default: that default narrowed the gap
        # on 3 ranks, 0.23 -> 0.20, docs/compression.md)
        if not _tail(losses) < plain:
            problems.append(f"{name}: final loss {_tail(losses):.4f} not below top-k with SGD "
                            f"momentum ({plain:.4f})")
    # checkpoint: momenta travel in state_dict; a resumed run repeats the uninterrupted one
    def train(state, model, start, steps):
        ddp = _wrap(model, state, H.topk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        return _steps(ctx, ddp, opt, start, steps, "momentum checkpoint")

    full = train(H.TopKState(density=0.01, momentum=0.9), _student(), 0, 12)
    model, state = _student(), H.TopKState(density=0.01, momentum=0.9)
    first = train(state, model, 0, 5)
    blob = io.BytesIO()
    torch.save({"hook": state.state_dict(), "model": model.state_dict()}, blob)
    blob.seek(0)
    ckpt = torch.load(blob, weights_only=True)
    if len(H.rank_state(ckpt["hook"])["momenta"]) != len(list(model.parameters())):
        problems.append("topk_dgc: the checkpoint does not hold a momentum per parameter")
    model2, state2 = _student(seed=7), H.TopKState(density=0.01, momentum=0.9)
    model2.load_state_dict(ckpt["model"])
    state2.load_state_dict(ckpt["hook"])
    if first + train(state2, model2, 5, 7) != full:
        problems.append("topk_dgc: resumed losses differ from the uninterrupted run")
    try:
        H.TopKState(momentum=1.0)
        problems.append("TopKState accepted momentum=1.0")
    except ValueError:
        pass
    return problems, out


def _training_checks(ctx, names):
    out = {}
    for name in names:
        model, losses = _train(ctx, name, TRAIN_STEPS)
        out[name] = (losses, _flat(model))
    return out


def _plain_vs_hook(ctx):
    a, la = _train(ctx, "dense", 20)
    b, lb = _train(ctx, "allreduce", 20)
    return torch.equal(_flat(a), _flat(b)), (_flat(a) - _flat(b)).abs().max().item(), la == lb


def _worker(ctx, train_names):
    torch.set_num_threads(1)
    out = {}
    out["exchange"] = _exchange_checks(ctx)
    out["plain_vs_hook"] = _plain_vs_hook(ctx)
    out["train"] = _training_checks(ctx, train_names)
    out["bytes"] = _bytes_checks(ctx) if dist.get_backend() == "pycomm" else None
    out["no_sync"] = _no_sync_checks(ctx)
    out["checkpoint"] = _checkpoint_checks(ctx)
    out["momentum"] = _momentum_checks(ctx)
    return out


def _tail(losses, n=10):
    return sum(losses[-n:]) / n


def _check_run(rets, world, train_names, backend):
    problems = []
    r0 = rets[0]
    for r in range(world):
        problems += [f"rank {r}: {p}" for p in rets[r]["exchange"][0]]
        problems += [f"rank {r}: no_sync {p}" for p in rets[r]["no_sync"][0]]
        problems += [f"rank {r}: checkpoint {p}" for p in rets[r]["checkpoint"]]
        problems += [f"rank {r}: momentum {p}" for p in rets[r]["momentum"][0]]
    for r in range(1, world):
        for name, (_, params) in r0["momentum"][1].items():
            if not torch.equal(params, rets[r]["momentum"][1][name][1]):
                problems.append(f"momentum {name}: parameters differ between rank 0 and rank {r}")
        for name, t in r0["exchange"][1].items():
            if not torch.equal(t, rets[r]["exchange"][1][name]):
                problems.append(f"exchange {name}: result differs between rank 0 and rank {r}")
        for name in train_names:
            if not torch.equal(r0["train"][name][1], rets[r]["train"][name][1]):
                problems.append(f"train {name}: parameters differ between rank 0 and rank {r}")
        for name in r0["no_sync"][1]:
            if not torch.equal(r0["no_sync"][1][name][1], rets[r]["no_sync"][1][name][1]):
                problems.append(f"no_sync {name}: parameters differ between rank 0 and rank {r}")
    same, diff, same_losses = r0["plain_vs_hook"]
    if not same:
        problems.append(f"allreduce_hook differs from DDP without a hook (max |diff| {diff:.3g})")
    # every hook lowers the loss (mean over ranks of the first/last 10 steps)
    summary = {}
    for name in train_names:
        first = sum(sum(rets[r]["train"][name][0][:10]) for r in range(world)) / (10 * world)
        last = sum(_tail(rets[r]["train"][name][0]) for r in range(world)) / world
        summary[name] = last
        if not last < 0.5 * first:
            problems.append(f"train {name}: loss went from {first:.4f} to only {last:.4f}")
    for name in r0["no_sync"][1]:
        losses = r0["no_sync"][1][name][0]
        if not sum(losses[-3:]) < sum(losses[:3]):
            problems.append(f"no_sync {name}: loss did not go down ({losses[:3]} -> {losses[-3:]})")
    dense = summary["dense"]
    if summary["q8"] > Q8_LOSS_FACTOR * dense:
        problems.append(f"q8 final loss {summary['q8']:.4f} > {Q8_LOSS_FACTOR} x dense {dense:.4f}")
    if summary["topk1%"] > TOPK_LOSS_FACTOR * dense:
        problems.append(f"topk1% final loss {summary['topk1%']:.4f} > {TOPK_LOSS_FACTOR} x dense {dense:.4f}")
    print(f"\n[{backend}, {world} ranks] final loss (mean of last 10 steps): "
          + ", ".join(f"{k} {v:.4f}" for k, v in summary.items())
          + "; lr 0.01: " + ", ".join(f"{k} {_tail(v[0]):.4f}" for k, v in r0["momentum"][1].items()))
    if r0["bytes"] is not None:
        problems += _check_bytes(rets, world)
    return problems


def _pieces(numel, world, align):
    """Lengths of the chunks rank c owns of one parameter (csrc/algorithms/ownership.h)."""
    units = -(-numel // align)
    base, extra = divmod(units, world)
    out, lo = [], 0
    for c in range(world):
        hi = lo + base + (1 if c < extra else 0)
        out.append(min(numel, hi * align) - min(numel, lo * align))
        lo = hi
    return out


def _check_bytes(rets, world):
    from pycomm import _C

    K = _C.kernels
    problems = []
    sent = {name: sum(rets[r]["bytes"][0][name] for r in range(world)) for name in rets[0]["bytes"][0]}
    numels = rets[0]["bytes"][1]
    n = sum(numels)
    dense_total = 2 * (world - 1) * 4 * n  # ring / sharded / tree all move 2(n-1) S in total
    lines = [f"[{world} ranks] bytes sent per step, all ranks, {n} parameters: dense {sent['allreduce']:.0f}"]
    if abs(sent["allreduce"] - dense_total) > 0.02 * dense_total:
        problems.append(f"dense: {sent['allreduce']:.0f} bytes per step, expected {dense_total}")

    def report(name, expected, exact=True):
        ratio = sent["allreduce"] / sent[name]
        lines.append(f"{name} {sent[name]:.0f} (dense/{name} = {ratio:.2f}, "
                     f"{'expected' if exact else 'bound'} {dense_total / expected:.2f})")
        if exact and abs(sent[name] - expected) > 0.05 * expected:
            problems.append(f"{name}: {sent[name]:.0f} bytes per step, expected {expected}")
        if not exact and sent[name] > expected:
            problems.append(f"{name}: {sent[name]:.0f} bytes per step, above the bound {expected}")

    # all_gather exchange: every rank's payload to every other rank
    report("topk1%_ag", world * (world - 1) * sum(C.compressed_nbytes(m, "topk", density=0.01) for m in numels))
    report("q4_ag", world * (world - 1) * sum(C.compressed_nbytes(m, bits=4) for m in numels))
    # two-phase quantized all-reduce: every owner's packed pieces cross (n-1) links twice
    for bits in (8, 4, 1):
        packed = sum(K.packed_size(p, bits, 256) for m in numels for p in _pieces(m, world, 256))
        report(f"q{bits}", 2 * (world - 1) * packed)
    # sparse all-reduce: at most k pairs per rank in phase 1 and the owners' kept entries to
    # (n-1) ranks in phase 2; an index costs at most 3 bytes (gaps < 2^21), a header 16 bytes
    k = sum(K.topk_count(m, 0.01) for m in numels)
    kept = sum(K.topk_count(p, 0.02) for m in numels for p in _pieces(m, world, 1) if p)  # owners keep 2 x density
    headers = 2 * world * (world - 1) * 2 * 16
    for name, value_bytes in (("topk1%", 4), ("topk1%_fp16", 2)):
        report(name, (world * k + (world - 1) * kept) * (3 + value_bytes) + headers, exact=False)
        # the target is >= 50x for top-k 1% (8-byte pairs would give 50x at best)
        if sent["allreduce"] / sent[name] < {4: 60, 2: 90}[value_bytes]:
            problems.append(f"{name}: only {sent['allreduce'] / sent[name]:.1f}x fewer bytes than dense")
    print("\n" + "; ".join(lines))
    return problems


TRAIN_NAMES = ["dense", "allreduce_ring", "topk1%", "topk1%_approx", "topk1%_fp16", "q8", "q4", "q1",
               "q4_bf16", "q8_torch_fp16", "allreduce_fp16"]


# 3 ranks: the hooks whose arithmetic depends on how the ranks split the bucket (sharded
# top-k selection, quantized chunks); the wire-dtype variants behave as on 2 ranks
TRAIN_NAMES_W3 = ["dense", "topk1%", "topk1%_approx", "q8", "q4", "q1"]


# 3 ranks: the same checks with an odd world size; the longest test of `make test-fast`
# (about 45 s next to the other workers), so it runs in `make test` only.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_hooks_pycomm(world):
    names = TRAIN_NAMES if world == 2 else TRAIN_NAMES_W3
    rets = spawn_run(_worker, world, backend="pycomm", args=(names,), make_ref=False,
                     timeout_s=150, pg_timeout_s=60).check().returns
    problems = _check_run(rets, world, names, "pycomm")
    assert not problems, "\n".join(problems)


def _gloo_worker(ctx, train_names):
    torch.set_num_threads(1)
    return {"exchange": _exchange_checks(ctx), "train": _training_checks(ctx, train_names),
            "checkpoint": _checkpoint_checks(ctx)}


def test_hooks_on_gloo():
    """The same hooks on another backend (all_gather exchange, no pycomm collective)."""
    names = ["dense", "topk1%", "q4", "q1"]
    world = 2
    rets = spawn_run(_gloo_worker, world, backend="gloo", args=(names,), make_ref=False,
                     timeout_s=120, pg_timeout_s=60).check().returns
    problems = []
    for r in range(world):
        problems += [f"rank {r}: {p}" for p in rets[r]["exchange"][0] + rets[r]["checkpoint"]]
        for name in names:
            losses = rets[r]["train"][name][0]
            if not _tail(losses) < 0.5 * sum(losses[:10]) / 10:
                problems.append(f"rank {r}: train {name}: loss did not go down")
            if not torch.equal(rets[r]["train"][name][1], rets[0]["train"][name][1]):
                problems.append(f"train {name}: parameters differ between rank 0 and rank {r}")
    assert not problems, "\n".join(problems)
