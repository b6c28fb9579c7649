"""Low-rank gradient compression: pycomm.hooks.powersgd_hook / PowerSGDState (PowerSGD,
Vogels et al. 2019) on the pycomm backend, 2 ranks.

One spawned run (PYCOMM_CHECK=1, so any two ranks issuing their collectives in a different
order fail the run) checks:

* rank r >= the smaller dimension: the hook returns the plain average (to float rounding),
  also on the warm-started second step;
* the min-compression-rate rule: 1-D and small parameters are averaged exactly, the others
  are not (the rule in PowerSGDState.compressed_shape);
* error feedback: step by step, the hook's output equals a float64 single-process
  simulation of the same arithmetic over both ranks' gradients; the sum of the applied
  updates tracks the sum of the mean gradients (the gap is the mean residual, which stays
  bounded), while without error feedback the gap grows;
* warm start: on a fixed gradient the approximation converges to the best rank-r one
  (power iteration carried across steps), and does not without warm start;
* checkpoints: state_dict (with the Q matrices and the residuals) through torch.save /
  torch.load(weights_only=True) into a fresh model/DDP/state: the resumed losses equal
  the uninterrupted run's exactly;
* DDP with several buckets trains digits to within a few points of dense, replicas identical,
  and the same hook over gloo (the harness's reference group) ends with the same parameters.
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import spawn_run
from test_hooks import _run_buckets, _steps, _student, _wrap


# ---------------------------------------------------------------------------
# in this process
# ---------------------------------------------------------------------------

def test_compressed_shape_rule_and_arguments():
    from pycomm import hooks as H

    s = H.PowerSGDState(rank=4)  # min_compression_rate 2
    assert s.compressed_shape((512,)) is None  # 1-D: never
    assert s.compressed_shape((512, 64)) == (512, 64, 4)  # 32768 >= 2 * 4 * 576
    assert s.compressed_shape((16, 8, 3, 3)) == (16, 72, 4)  # conv: shape[0] x the rest
    assert s.compressed_shape((10, 20)) is None  # 200 < 2 * 4 * 30
    assert s.compressed_shape((3, 100)) is None  # r clamped to 3: 300 < 2 * 3 * 103
    assert H.PowerSGDState(rank=4, min_compression_rate=0).compressed_shape((3, 100)) == (3, 100, 3)
    assert H.PowerSGDState(rank=1, min_compression_rate=0).compressed_shape((7,)) is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pycomm powersgd_hook: rank must be a positive integer"):
            H.PowerSGDState(rank=bad)
    with pytest.raises(ValueError, match="min_compression_rate"):
        H.PowerSGDState(min_compression_rate=-1)
    with pytest.raises(TypeError, match="state must be a PowerSGDState"):
        H.powersgd_hook(H.TopKState(), None)
    with pytest.raises(ValueError, match="not 'powersgd'"):
        s.load_state_dict(H.TopKState().state_dict())
    from pycomm.train.strategies import resolve_hook

    hook, state = resolve_hook("powersgd")
    assert hook is H.powersgd_hook and isinstance(state, H.PowerSGDState)
    hook, state = resolve_hook("torch_powersgd")
    assert hook.__name__ == "powerSGD_hook" and state.matrix_approximation_rank == 1


# ---------------------------------------------------------------------------
# reference: PowerSGD over all ranks' gradients in one process, float64
# ---------------------------------------------------------------------------

def _orthonormal(p):
    """Modified Gram-Schmidt (float64); an independent choice of basis from the hook's QR:
    the approximation P P^T M does not depend on the basis."""
    p = p.clone()
    for j in range(p.shape[1]):
        for i in range(j):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
        p[:, j] /= p[:, j].norm()
    return p


class _Reference:
    """One parameter (n x m) on `world` ranks: M_w = g_w + e_w; P = sum_w M_w Q;
    P_hat = orth(P); Q_w = M_w^T P_hat; result P_hat (sum_w Q_w / world)^T;
    e_w = M_w - P_hat Q_w^T (error feedback); Q <- sum_w Q_w / world (warm start)."""

    def __init__(self, q0, world, error_feedback=True, warm_start=True):
        self.q = q0.double()
        self.world, self.ef, self.warm = world, error_feedback, warm_start
        self.e = [None] * world

    def step(self, grads, fresh_q=None):
        if not self.warm and fresh_q is not None:
            self.q = fresh_q.double()
        ms = [g.double() + (self.e[w] if self.ef and self.e[w] is not None else 0) for w, g in enumerate(grads)]
        p_hat = _orthonormal(sum(m @ self.q for m in ms))
        qs = [m.t() @ p_hat for m in ms]
        q = sum(qs) / self.world
        if self.ef:
            self.e = [m - p_hat @ qw.t() for m, qw in zip(ms, qs)]
        self.q = q
        return p_hat @ q.t()

    def mean_residual(self):
        return sum(self.e) / self.world


# ---------------------------------------------------------------------------
# spawned checks
# ---------------------------------------------------------------------------

def _grads(shapes, rank, step, shared=0.0, drift=0.0):
    """Noise per rank and step, plus `shared` x noise common to the ranks, plus `drift` x a
    fixed full-rank direction (the part a biased compressor keeps missing without error feedback)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + 1)
    common = torch.Generator().manual_seed(10_000 * step + 99)
    fixed = torch.Generator().manual_seed(777)
    return [torch.randn(s, generator=g) + shared * torch.randn(s, generator=common)
            + drift * torch.randn(s, generator=fixed) for s in shapes]


def _params(shapes):
    return [torch.nn.Parameter(torch.zeros(s)) for s in shapes]


def _exactness_checks(ctx):
    """Full rank: the plain average; small and 1-D parameters: exactly the average."""
    from pycomm import hooks as H

    problems, world = [], ctx.world_size
    shapes = [(6, 4), (5, 3, 2), (7,)]
    params = _params(shapes)
    state = H.PowerSGDState(rank=8, min_compression_rate=0)
    for step in range(2):  # the second step starts from the first step's Q (warm start)
        every = [_grads(shapes, r, step) for r in range(world)]
        out = _run_buckets(state, H.powersgd_hook, params, every[ctx.rank], [[0, 2], [1]])
        for i, shape in enumerate(shapes):
            mean = sum(g[i] for g in every).reshape(-1) / world
            if not torch.allclose(out[i], mean, rtol=1e-4, atol=1e-5):
                problems.append(f"full rank, step {step}, parameter {shape}: differs from the average "
                                f"(max |diff| {(out[i] - mean).abs().max():.3g})")
    # ordinals in the order the hook first saw the parameters: (6, 4) #0, (7,) #1, (5, 3, 2) #2
    if {o: tuple(q.shape) for o, q in state._qs.items()} != {0: (4, 4), 2: (6, 5)}:
        problems.append(f"full rank: warm-start Qs {({o: tuple(q.shape) for o, q in state._qs.items()})}")

    shapes = [(3, 3), (40, 30), (30,)]  # rank 1, rate 2: (3, 3) has 9 < 2 x 6 elements
    params = _params(shapes)
    state = H.PowerSGDState(rank=1)
    every = [_grads(shapes, r, 5) for r in range(world)]
    out = _run_buckets(state, H.powersgd_hook, params, every[ctx.rank], [[0, 1, 2]])
    for i, shape in enumerate(shapes):
        mean = sum(g[i] for g in every).reshape(-1) / world
        exact = torch.equal(out[i], mean)
        if exact != (shape != (40, 30)):
            problems.append(f"min compression rate: parameter {shape} averaged "
                            f"{'exactly' if exact else 'inexactly'} (max |diff| {(out[i] - mean).abs().max():.3g})")
    if set(state._residuals) != {1}:
        problems.append(f"residuals kept for parameters {sorted(state._residuals)}, expected only #1")
    return problems


def _ef_checks(ctx):
    """The hook against _Reference over 24 steps; the error-feedback gap; warm start."""
    from pycomm import hooks as H

    problems, world, steps = [], ctx.world_size, 32
    shapes = [(24, 16), (16, 8, 2), (16,)]
    params = _params(shapes)
    out = {}
    for ef in (True, False):
        state = H.PowerSGDState(rank=2, error_feedback=ef, min_compression_rate=0, seed=3)
        # parameter i has ordinal i + 1: the hook numbers parameters as it first sees them (bias first)
        refs = {i: _Reference(state._initial_q(i + 1, 0, 16, 2), world, error_feedback=ef) for i in (0, 1)}
        applied = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        true = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        worst_sim, gaps = 0.0, []
        for step in range(steps):
            every = [_grads(shapes, r, step, shared=1.0, drift=0.5) for r in range(world)]
            got = _run_buckets(state, H.powersgd_hook, params, every[ctx.rank], [[2], [0, 1]])
            for i, shape in enumerate(shapes):
                applied[i] += got[i].double().view(shape)
                true[i] += sum(g[i] for g in every).double() / world
                if i == 2:
                    continue
                want = refs[i].step([g[i].reshape(shape[0], -1) for g in every]).reshape(-1)
                worst_sim = max(worst_sim, ((got[i].double() - want).norm() / want.norm()).item())
            gaps.append(max((applied[i] - true[i]).norm().item() for i in (0, 1)))
        if worst_sim > 1e-3:  # float32 hook against a float64 simulation, 32 steps
            problems.append(f"EF={ef}: the hook's output differs from the simulation (worst relative "
                            f"error {worst_sim:.3g})")
        if ef:
            for i in (0, 1):  # the identity behind error feedback: applied - true = -mean residual
                mine = refs[i].mean_residual().reshape(shapes[i])
                if not torch.allclose(applied[i] - true[i], -mine, rtol=1e-4, atol=1e-3):  # 32 float32 steps
                    problems.append(f"EF: parameter {i}: sum of updates - sum of gradients is not the "
                                    f"mean residual (max |diff| {(applied[i] - true[i] + mine).abs().max():.3g})")
            if not torch.equal(applied[2], true[2]) and not torch.allclose(applied[2], true[2], atol=1e-5):
                problems.append("EF: the uncompressed bias did not get the plain average")
        out[ef] = gaps
    gradient = max(g.norm().item() for g in _grads(shapes[:2], 0, 0, shared=1.0, drift=0.5))
    # with error feedback the gap (the mean residual) levels off at a few gradients; without, the
    # fixed direction's missed part adds up every step
    half = steps // 2
    if max(out[True]) > 4 * gradient or max(out[True][half:]) > 1.5 * max(out[True][:half]):
        problems.append(f"EF: the gap kept growing: {max(out[True][:half]):.3g} in the first {half} steps, "
                        f"{max(out[True][half:]):.3g} after (one gradient: {gradient:.3g})")
    if not out[False][-1] > 3 * max(out[True]) or not out[False][-1] > 2 * out[False][steps // 4]:
        problems.append(f"no EF: the gap did not grow ({out[False][steps // 4]:.3g} -> {out[False][-1]:.3g}; "
                        f"with EF at most {max(out[True]):.3g})")
    gaps = f"gaps EF {max(out[True]):.3g}, no EF {out[False][steps // 4]:.3g} -> {out[False][-1]:.3g}, " \
           f"gradient {gradient:.3g}"
    ctx.progress(gaps)

    # warm start: a fixed gradient; the approximation error converges to the best rank-2 one
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))
    v, _ = torch.linalg.qr(torch.randn(24, 24, generator=torch.Generator().manual_seed(2)))
    sigma = torch.tensor([1.0, 0.8, 0.55, 0.5] + [0.3 / (k + 1) for k in range(20)])
    target = (u[:, :24] * sigma) @ v.t()  # the mean over ranks
    local = target + (0.1 if ctx.rank == 0 else -0.1) * torch.randn(32, 24, generator=torch.Generator().manual_seed(9))
    best = sigma[2:].norm().item()  # Eckart-Young
    param = _params([(32, 24)])
    errors = {}
    for warm in (True, False):
        state = H.PowerSGDState(rank=2, error_feedback=False, warm_start=warm)
        errors[warm] = []
        for step in range(12):
            got = _run_buckets(state, H.powersgd_hook, param, [local.clone()], [[0]])[0].view(32, 24)
            errors[warm].append((got - target).norm().item() / best)
        if warm and (set(state._qs) != {0} or tuple(state._qs[0].shape) != (24, 2)):
            problems.append(f"warm start: stored Qs {({o: tuple(q.shape) for o, q in state._qs.items()})}")
        if not warm and state._qs:
            problems.append("no warm start: Q matrices were stored")
    if not errors[True][-1] < 1.01 or not errors[True][0] > 1.05:
        problems.append(f"warm start: error / best {errors[True][0]:.4f} -> {errors[True][-1]:.4f}, expected "
                        f"to start above 1.05 and converge below 1.01")
    if not min(errors[False]) > 1.02:
        problems.append(f"no warm start: error / best reached {min(errors[False]):.4f} (power iteration "
                        f"should not carry over)")
    return problems, gaps


def _checkpoint_checks(ctx):
    """Interrupted (torch.save / load into a fresh model, DDP, state, optimizer) vs uninterrupted."""
    from pycomm import hooks as H

    problems, total, cut = [], 12, 5

    def factory():
        return H.PowerSGDState(rank=2, warmup_steps=2, min_compression_rate=1)

    def run(steps, start, model, state, opt_state=None):
        ddp = _wrap(model, state, H.powersgd_hook)  # several buckets (a 4 kB cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        return _steps(ctx, ddp, opt, start, steps, "powersgd checkpoint"), opt

    full, _ = run(total, 0, _student(), factory())
    model, state = _student(), factory()
    first, opt = run(cut, 0, model, state)
    blob = io.BytesIO()
    torch.save({"hook": state.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    ckpt = torch.load(blob, weights_only=True)
    hook_state = dict(ckpt["hook"], **H.rank_state(ckpt["hook"]))
    if not hook_state["q"] or not hook_state["residuals"] or hook_state["step"] != cut:
        problems.append(f"checkpoint: q {sorted(hook_state['q'])}, residuals {sorted(hook_state['residuals'])}, "
                        f"step {hook_state['step']}")
    if set(hook_state["q"]) != set(hook_state["residuals"]):
        problems.append("checkpoint: Qs and residuals are kept for different parameters")
    model2, state2 = _student(seed=99), factory()
    model2.load_state_dict(ckpt["model"])
    state2.load_state_dict(hook_state)
    second, _ = run(total - cut, cut, model2, state2, ckpt["opt"])
    if first + second != full:
        diffs = [abs(a - b) for a, b in zip(first + second, full)]
        problems.append(f"checkpoint: resumed losses differ from the uninterrupted run (max |diff| "
                        f"{max(diffs):.3g})")
    model3 = _student(seed=98)  # model and optimizer loaded, hook state not: must differ (not vacuous)
    model3.load_state_dict(ckpt["model"])
    state3 = factory()
    state3.step = cut
    third, _ = run(total - cut, cut, model3, state3, ckpt["opt"])
    if third == second:
        problems.append("checkpoint: resuming without the hook state gave the same losses")
    return problems


def _digits_checks(ctx):
    """DDP (several buckets) on digits: PowerSGD rank 2 against dense, 3 epochs."""
    from pycomm import hooks as H
    from pycomm.train.tasks import get_task

    task = get_task("digits-mlp")
    result = {}
    for name in ("dense", "powersgd", "powersgd_gloo"):
        model = task.make_model(0)
        group = ctx.ref if name == "powersgd_gloo" else None  # the same ranks on gloo
        ddp = DDP(model, bucket_cap_mb=0.02, process_group=group)
        buckets = set()
        if name != "dense":
            def counting(state, bucket):  # no return annotation: this module has postponed ones
                buckets.add(bucket.index())
                return H.powersgd_hook(state, bucket)

            ddp.register_comm_hook(H.PowerSGDState(group, rank=2), counting)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        per_rank = 32
        for epoch in range(3):
            order = torch.randperm(task.x_train.shape[0], generator=torch.Generator().manual_seed(epoch))
            for s in range(task.x_train.shape[0] // 64):
                ctx.progress(f"digits {name} epoch {epoch} step {s}")
                idx = order[s * 64 + ctx.rank * per_rank: s * 64 + (ctx.rank + 1) * per_rank]
                opt.zero_grad()
                F.cross_entropy(ddp(task.x_train[idx]), task.y_train[idx]).backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(task.x_test).argmax(1) == task.y_test).float().mean().item()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result[name] = (acc, flat, len(buckets))
    return result


def _worker(ctx):
    torch.set_num_threads(1)
    problems = []
    problems += _exactness_checks(ctx)
    ef_problems, gaps = _ef_checks(ctx)
    problems += ef_problems + _checkpoint_checks(ctx)
    return {"problems": problems, "gaps": gaps, "digits": _digits_checks(ctx)}


def test_powersgd_hook_pycomm():
    world = 2
    rets = spawn_run(_worker, world, backend="pycomm", make_ref=True, timeout_s=150, pg_timeout_s=60,
                     env={"PYCOMM_CHECK": "1"}).check().returns
    problems = []
    for r in range(world):
        problems += [f"rank {r}: {p}" for p in rets[r]["problems"]]
    dense_acc = rets[0]["digits"]["dense"][0]
    acc, flat, buckets = rets[0]["digits"]["powersgd"]
    if buckets < 2:
        problems.append(f"digits: DDP used {buckets} bucket(s); the test wants several")
    if not (acc > 0.8 and acc >= dense_acc - 0.05):
        problems.append(f"digits: PowerSGD rank 2 reached {acc:.3f} test accuracy, dense {dense_acc:.3f}")
    if not torch.equal(flat, rets[1]["digits"]["powersgd"][1]):
        problems.append("digits: replicas differ between the ranks")
    on_gloo = rets[0]["digits"]["powersgd_gloo"][1]  # the same hook over gloo's all-reduce
    if not torch.equal(on_gloo, rets[1]["digits"]["powersgd_gloo"][1]):
        problems.append("digits on gloo: replicas differ between the ranks")
    if not torch.allclose(on_gloo, flat, rtol=1e-4, atol=1e-5):
        problems.append(f"digits: the run on gloo differs from the run on pycomm (max |diff| "
                        f"{(on_gloo - flat).abs().max():.3g})")
    print(f"\n{rets[0]['gaps']}; digits test accuracy: dense {dense_acc:.3f}, PowerSGD rank 2 {acc:.3f}")
    assert not problems, "\n".join(problems)


def _find_unused_worker(ctx):
    """DDP(find_unused_parameters=True) all-reduces its used-parameter map on the group
    right after the last bucket's hook returns; the hook's own all-reduces, issued from
    future callbacks, must all be issued by then on every rank. Before, they raced it:
    "rank 1 called with 16 bytes where 576 were expected" within a few steps."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm import hooks as H

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = DDP(net, find_unused_parameters=True)  # every parameter used: the flag alone
    ddp.register_comm_hook(H.PowerSGDState(rank=1), H.powersgd_hook)
    for step in range(8):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        net.zero_grad()
        F.mse_loss(ddp(torch.randn(16, 32, generator=g)), torch.randn(16, 8, generator=g)).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_powersgd_hook_with_find_unused_parameters(backend):
    rets = spawn_run(_find_unused_worker, 2, backend=backend, make_ref=False, timeout_s=150,
                     pg_timeout_s=60).check().returns
    assert torch.equal(rets[0], rets[1]), "the ranks' averaged gradients differ"
