"""topk_hook's scheduling and small-parameter rule on pycomm groups (one spawned 3-rank group).

* ``TopKState(schedule="step")`` (each bucket encoded as DDP hands it over, one sparse
  all-reduce per step from the last bucket) gives the same parameters, losses and
  residuals as the per-bucket schedule, bit for bit, through DDP's bucket rebuild after
  the first iteration, and issues one sparse all-reduce per step once the layout is known;
  a checkpoint taken under one schedule resumes under the other with the same numbers.
* ``min_compression_rate``: parameters below the rule (TopKState.compressed) are averaged
  exactly in one dense all-reduce and their residuals are zero; the other parameters get
  the same numbers as with the rule off, bit for bit.
* ``small_bits=8``: those parameters go through one quantized all-reduce per bucket (per
  step with ``schedule="step"``); what the 8-bit code loses lands in their residuals,
  so that summed over the ranks nothing is lost; the others are unchanged, bit for bit.
* replicas identical on every rank.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import spawn_run
from test_hooks import _Bucket

STEPS = 8
DENSITY = 0.05


def _model():
    torch.manual_seed(0)
    # biases of 48 / 48 / 3 elements and a 3 x 48 weight: small against the 48 x 48 one
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 24, generator=g)
    return x, torch.sin(x[:, :3] * 2)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(ctx, state, steps, start=0, model=None):
    import pycomm
    from pycomm import hooks as H

    model = model if model is not None else _model()
    ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets, and DDP's rebuild after step 0
    ddp.register_comm_hook(state, H.topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, sparse_calls = [], []
    for step in range(start, start + steps):
        ctx.progress(f"schedule={state.schedule} rate={state.min_compression_rate} step {step}")
        count = pycomm.stats()["ops"].get("allreduce_sparse", {}).get("count", 0)
        x, y = _batch(ctx.rank, step)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        sparse_calls.append(pycomm.stats()["ops"].get("allreduce_sparse", {}).get("count", 0) - count)
    return model, losses, sparse_calls


def _residuals(state):
    from pycomm import hooks as H

    return {o: r.clone() for o, r in H.rank_state(state.state_dict())["residuals"].items()}


def _schedule_checks(ctx):
    from pycomm import hooks as H

    problems, out = [], {}
    a_state = H.TopKState(density=DENSITY, exact=True)
    b_state = H.TopKState(density=DENSITY, exact=True, schedule="step")
    a, la, calls_a = _train(ctx, a_state, STEPS)
    b, lb, calls_b = _train(ctx, b_state, STEPS)
    if not torch.equal(_flat(a), _flat(b)):
        problems.append(f"schedule=step: parameters differ from schedule=bucket "
                        f"(max |diff| {(_flat(a) - _flat(b)).abs().max().item():.3g})")
    if la != lb:
        problems.append(f"schedule=step: losses differ ({la} vs {lb})")
    ra, rb = _residuals(a_state), _residuals(b_state)
    if ra.keys() != rb.keys() or any(not torch.equal(ra[o], rb[o]) for o in ra):
        problems.append("schedule=step: residuals differ from schedule=bucket")
    # the per-bucket schedule: one collective per bucket; the step schedule: one per step
    # once a step has shown the layout (step 0 and DDP's rebuilt step 1 run per bucket)
    if min(calls_a[1:]) < 2:
        problems.append(f"the test needs several buckets per step (sparse calls per step {calls_a})")
    if calls_b[2:] != [1] * (STEPS - 2):
        problems.append(f"schedule=step: sparse all-reduces per step {calls_b}, expected 1 from step 2")
    out["schedule"] = (_flat(a), _flat(b))

    # checkpoint under "bucket", resume under "step" (and the reverse): the same numbers
    half = STEPS // 2
    for first, second in (("bucket", "step"), ("step", "bucket")):
        s1 = H.TopKState(density=DENSITY, exact=True, schedule=first)
        m, l1, _ = _train(ctx, s1, half)
        s2 = H.TopKState(density=DENSITY, exact=True, schedule=second)
        s2.load_state_dict(s1.state_dict())
        m, l2, _ = _train(ctx, s2, STEPS - half, start=half, model=m)
        if not torch.equal(_flat(m), _flat(a)) or l1 + l2 != la:
            problems.append(f"checkpoint taken under schedule={first}, resumed under {second}: "
                            f"differs from the uninterrupted run")
    return problems, out


def _rule_checks(ctx):
    """min_compression_rate on hand-made buckets: small parameters exact, others unchanged."""
    import pycomm
    from pycomm import hooks as H

    problems, out = [], {}
    world = dist.get_world_size()
    shapes = [(48, 24), (48,), (48, 48), (48,), (3, 48), (3,)]
    params = [torch.zeros(s) for s in shapes]

    def grads(rank, step):
        g = torch.Generator().manual_seed(77 + 10 * step + rank)
        return [torch.randn(p.numel(), generator=g) for p in params]

    layout = [[5, 4, 3], [2, 1, 0]]

    def run(state, step):
        gs = grads(ctx.rank, step)
        results = {}
        futures = []
        for b, positions in enumerate(layout):
            bucket = _Bucket([params[i] for i in positions], [gs[i] for i in positions], b, b == len(layout) - 1)
            futures.append((positions, H.topk_hook(state, bucket)))
        for positions, fut in futures:
            result = fut.wait()
            at = 0
            for i in positions:
                results[i] = result[at: at + params[i].numel()].clone()
                at += params[i].numel()
        return [results[i] for i in range(len(params))]

    # dense bytes / top-k pair bytes at 5% (float32 values: 8-byte pairs): weights 9.9, 9.9,
    # 9.0; biases of 48: 8.0, of 3: 1.5
    rate = 8.5
    for schedule in ("bucket", "step"):
        plain = H.TopKState(density=DENSITY, exact=True, schedule=schedule, min_compression_rate=0,
                            value_dtype="float32")
        ruled = H.TopKState(density=DENSITY, exact=True, schedule=schedule, min_compression_rate=rate,
                            small_bits=None, value_dtype="float32")
        small = [not ruled.compressed(p.numel()) for p in params]
        if small != [False, True, False, True, False, True]:
            problems.append(f"rule: small parameters {small}, expected the three biases")
        for step in range(3):
            a = run(plain, step)
            b = run(ruled, step)
            mean = [sum(grads(r, step)[i] for r in range(world)) / world for i in range(len(params))]
            for i in range(len(params)):
                if small[i]:
                    if not torch.allclose(b[i], mean[i], rtol=1e-6, atol=1e-6):
                        problems.append(f"rule {schedule} step {step}: parameter {i} is not the exact mean")
                elif not torch.equal(a[i], b[i]):
                    problems.append(f"rule {schedule} step {step}: compressed parameter {i} changed "
                                    f"(max |diff| {(a[i] - b[i]).abs().max().item():.3g})")
            res = H.rank_state(ruled.state_dict())["residuals"]
            order = [i for positions in layout for i in positions]  # ordinals: the order first seen
            for o, i in enumerate(order):
                if small[i] and res[o].abs().max().item() != 0.0:
                    problems.append(f"rule {schedule} step {step}: small parameter {i} kept a residual")
                if not small[i] and res[o].abs().max().item() == 0.0:
                    problems.append(f"rule {schedule} step {step}: compressed parameter {i} has no residual")
        out[f"rule_{schedule}"] = torch.cat(b)
    # small_bits=8: the small parameters through the quantized all-reduce, with error feedback
    for schedule in ("bucket", "step"):
        plain = H.TopKState(density=DENSITY, exact=True, schedule=schedule, min_compression_rate=0,
                            value_dtype="float32")
        quant = H.TopKState(density=DENSITY, exact=True, schedule=schedule, min_compression_rate=rate,
                            small_bits=8, value_dtype="float32")
        order = [i for positions in layout for i in positions]
        before = {i: torch.zeros(params[i].numel()) for i in range(len(params))}
        for step in range(3):
            calls = pycomm.stats()["ops"].get("allreduce_quantized", {}).get("count", 0)
            a = run(plain, step)
            b = run(quant, step)
            calls = pycomm.stats()["ops"].get("allreduce_quantized", {}).get("count", 0) - calls
            # every bucket has a small parameter: one quantized all-reduce per bucket, one per step
            # once the step schedule knows the layout (from step 1: the hand-made buckets never change)
            expected = len(layout) if schedule == "bucket" or step == 0 else 1
            if calls != expected:
                problems.append(f"small_bits {schedule} step {step}: {calls} quantized all-reduces, "
                                f"expected {expected}")
            res = H.rank_state(quant.state_dict())["residuals"]
            after = {i: res[o] for o, i in enumerate(order)}
            gs = grads(ctx.rank, step)
            for i in range(len(params)):
                if not small[i]:
                    if not torch.equal(a[i], b[i]):
                        problems.append(f"small_bits {schedule} step {step}: compressed parameter {i} changed")
                    continue
                # the error of the 8-bit code went into the residual, none was lost: summed over
                # the ranks, gradient + old residual = world x mean + new residual
                kept = gs[i] + before[i] - after[i]
                dist.all_reduce(kept)
                if not torch.allclose(kept, world * b[i], rtol=1e-5, atol=1e-5):
                    problems.append(f"small_bits {schedule} step {step}: parameter {i} lost "
                                    f"{(kept - world * b[i]).abs().max().item():.3g} to quantization")
                mean = sum(grads(r, step)[i] for r in range(world)) / world
                scale = (gs[i] + before[i]).abs().max().item()
                if after[i].abs().max().item() == 0.0 or after[i].abs().max().item() > scale / 32:
                    problems.append(f"small_bits {schedule} step {step}: parameter {i}'s residual "
                                    f"{after[i].abs().max().item():.3g} is not an 8-bit rounding error "
                                    f"(inputs up to {scale:.3g})")
                if step == 0 and not torch.allclose(b[i], mean, atol=world * scale / 32):
                    problems.append(f"small_bits {schedule} step 0: parameter {i} is not near the mean")
            before = after
        out[f"small_bits_{schedule}"] = torch.cat(b)
    # the all_gather exchange has no dense side channel: the rule is refused there
    try:
        run(H.TopKState(density=DENSITY, exchange="allgather", min_compression_rate=rate), 0)
        problems.append("rule: the all_gather exchange accepted min_compression_rate")
    except ValueError as exc:
        if "min_compression_rate" not in str(exc):
            problems.append(f"rule: unexpected message {exc}")
    return problems, out


def _worker(ctx):
    torch.set_num_threads(1)
    schedule = _schedule_checks(ctx)
    rule = _rule_checks(ctx)
    gc.collect()  # before returning: a loaded machine can take seconds for it at interpreter exit
    return {"problems": schedule[0] + rule[0], "out": {**schedule[1], **rule[1]}}


def test_topk_schedule_and_small_parameter_rule():
    world = 3
    rets = spawn_run(_worker, world, backend="pycomm", make_ref=False, timeout_s=120,
                     pg_timeout_s=60, exit_timeout_s=30).check().returns
    problems = []
    for r in range(world):
        problems += [f"rank {r}: {p}" for p in rets[r]["problems"]]
        for name, value in rets[r]["out"].items():
            ref = rets[0]["out"][name]
            same = all(torch.equal(x, y) for x, y in zip(value, ref)) if isinstance(value, tuple) \
                else torch.equal(value, ref)
            if not same:
                problems.append(f"{name}: rank {r} differs from rank 0")
    assert not problems, "\n".join(problems)


def test_topk_state_options():
    from pycomm import hooks as H

    with pytest.raises(ValueError, match="schedule"):
        H.TopKState(schedule="later")
    with pytest.raises(ValueError, match="min_compression_rate"):
        H.TopKState(min_compression_rate=-1)
    s = H.TopKState(density=0.01, min_compression_rate=2.0)
    # dense bytes n * 4 against ceil(0.01 n) pairs of 8 bytes: about 50x for large n, n / 2 below 100
    assert s.compressed(1000) and s.compressed(4) and not s.compressed(3)
    assert H.TopKState(density=0.01, min_compression_rate=0).compressed(1)  # 0: everything sparsified
    # the default (None): sparsified from 1.5 entries per step, at 1% from 150 elements
    default = H.TopKState(density=0.01)
    assert [n for n in (1, 64, 128, 149, 150, 151, 4096) if default.compressed(n)] == [150, 151, 4096]
    assert default.small_bits == 8 and default.value_dtype == "bfloat16"
    assert H.TopKState(density=0.1).compressed(15) and not H.TopKState(density=0.1).compressed(14)
    assert s.state_dict()["config"]["min_compression_rate"] == 2.0
    with pytest.raises(ValueError, match="small_bits"):
        H.TopKState(small_bits=2)
    assert H.TopKState(small_bits=4).state_dict()["config"]["small_bits"] == 4

