"""torch's own comm hooks and Future chains on pycomm, compared with gloo (issue:
drop-in where gloo works).

torch's PowerSGD calls ``all_reduce(..., async_op=True).get_future().wait()``
inside ``Future.then`` callbacks. Such a callback must not run on the thread that
runs the collective it waits for (pycomm completes Futures on its CompletionPool,
off the worker). Each run trains the same model on the same rank-dependent data on
pycomm, then on gloo (re-initialised in the same processes); the final parameters
must agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import spawn_run

STEPS = 6
HOOKS = [
    # (name, hook, error feedback, warm start)
    ("powerSGD", "powerSGD_hook", True, True),
    ("powerSGD-noef-nowarm", "powerSGD_hook", False, False),
]
# batched_powerSGD_hook is left out: in torch 2.13 it passes a 2-D matrix to
# _orthogonalize, which asserts on 3-D input, on every backend (gloo included).


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 4))


def _train(ctx, variant):
    ddp = DDP(_model())
    averager = None
    if variant == "post_localSGD":
        # subgroup=None would call new_subgroups(), which needs CUDA to size it.
        subgroup, _ = dist.new_subgroups(group_size=dist.get_world_size())
        state = post_local.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2)
        ddp.register_comm_hook(state, post_local.post_localSGD_hook)
        averager = PeriodicModelAverager(period=2, warmup_steps=2)
    else:
        _, hook, ef, warm = next(h for h in HOOKS if h[0] == variant)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       use_error_feedback=ef, warm_start=warm)
        ddp.register_comm_hook(state, getattr(powersgd, hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(500 + ctx.rank)
    for step in range(STEPS):
        ctx.progress(f"{dist.get_backend()} {variant} step {step}")
        x, y = torch.randn(32, 12, generator=g), torch.randn(32, 4, generator=g)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(ddp.parameters())
    return [p.detach().clone() for p in ddp.parameters()]


def _nested_chain():
    """Three nested `then` callbacks, each issuing an all-reduce and waiting on it."""
    t = torch.full((5,), float(dist.get_rank() + 1))

    def step(fut):
        out = fut.value()[0] * 2
        return dist.all_reduce(out, async_op=True).get_future().wait()  # [tensor], like the first

    fut = dist.all_reduce(t, async_op=True).get_future()
    for _ in range(3):
        fut = fut.then(step)
    return fut.wait()[0]


# The gloo reference groups, kept until the process exits. torch's PowerSGD callbacks
# capture the process group; gloo runs them on its own worker thread, and when such a
# callback drops the last reference after destroy_process_group(), ~ProcessGroupGloo
# runs on that thread and joins it: "terminate ... Resource deadlock avoided" (seen
# in CI; core dump: std::thread::join in ~ProcessGroupGloo from ProcessGroupGloo::
# runLoop -> Future::markCompleted -> the then-callback's function freed). pycomm runs
# callbacks on its completion pool, whose stop never joins the calling thread.
_KEEP_ALIVE = []


def hooks_worker(ctx, variants):
    out = {}
    for backend in ("pycomm", "gloo"):
        if backend == "gloo":
            import pycomm

            out["algorithm"] = pycomm.last_algorithm()  # what pycomm's last all-reduce ran
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=ctx.init_method("gloo_hooks"), rank=ctx.rank,
                                    world_size=ctx.world_size, timeout=ctx.timeout())
            _KEEP_ALIVE.append(dist.group.WORLD)
        ctx.progress(f"{backend}: nested then chain")
        out[(backend, "chain")] = _nested_chain()
        for variant in variants:
            out[(backend, variant)] = _train(ctx, variant)
    return out


@pytest.mark.parametrize(
    "variants,transport",
    [([h[0] for h in HOOKS], "shm"), (["post_localSGD"], "shm"), ([h[0] for h in HOOKS] + ["post_localSGD"], "tcp")],
    ids=["powerSGD-shm", "post_localSGD-shm", "all-tcp"])
def test_torch_hooks_match_gloo(variants, transport):
    # "shm": the ranks share the host, collectives go through shared memory;
    # "tcp": the same hooks over the TCP algorithms (every variant in one run, to keep it short).
    world = 2
    rets = spawn_run(hooks_worker, world, args=(variants,), backend="pycomm", make_ref=False, timeout_s=240,
                     pg_timeout_s=30, env={"PYCOMM_TRANSPORT": transport}).check().returns
    n = world
    # (r+1) summed, then three times: doubled and summed over n ranks.
    expected = torch.full((5,), n * (n + 1) / 2 * (2 * n) ** 3)
    problems = []
    for r in range(world):
        assert (rets[r]["algorithm"] == "shm") == (transport == "shm"), rets[r]["algorithm"]
        for backend in ("pycomm", "gloo"):
            if not torch.equal(rets[r][(backend, "chain")], expected):
                problems.append(f"{backend} rank {r}: nested chain gave {rets[r][(backend, 'chain')]}")
        for variant in variants:
            mine, ref = rets[r][("pycomm", variant)], rets[r][("gloo", variant)]
            for i, (a, b) in enumerate(zip(mine, ref)):
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    problems.append(f"{variant} rank {r}: parameter {i} differs from gloo's "
                                    f"(max |diff| {(a - b).abs().max().item():.3g})")
            # not vacuous: training moved the weights
            assert not torch.equal(mine[0], _model()[0].weight), variant
    assert not problems, "\n".join(problems)


def sequence_worker(ctx):
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    start = backend._get_sequence_number_for_group()
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    after = backend._get_sequence_number_for_group()
    sub = dist.new_group([0, 1], backend="pycomm")
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"rank": ctx.rank}, group=sub)
    sub_seq = sub._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    return {"start": start, "after": after, "gathered": gathered, "sub_seq": sub_seq}


def test_sequence_numbers_count_collectives_and_agree():
    rets = spawn_run(sequence_worker, 2, backend="pycomm", make_ref=False, timeout_s=120,
                     pg_timeout_s=30).check().returns
    for r in range(2):
        assert rets[r]["after"] - rets[r]["start"] == 4, rets[r]  # 3 all-reduces + a barrier
        assert rets[r]["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert rets[r]["sub_seq"] > 0
    assert rets[0]["after"] == rets[1]["after"] and rets[0]["sub_seq"] == rets[1]["sub_seq"]
