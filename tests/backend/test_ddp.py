"""DistributedDataParallel on top of the backend, compared with gloo.

Ranks build the model from DIFFERENT seeds (DDP must broadcast rank 0's
parameters and buffers at construction), train 30 SGD steps on
rank-dependent data, once with the backend under test and once with gloo
(sequentially in the same processes: destroy_process_group + re-init), both
without and with a comm hook that uses work.get_future(). Final parameters
and buffers must agree between the two backends and across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import spawn_run

BACKEND = "pycomm"
STEPS = 30


def build_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def allreduce_then_divide_hook(state, bucket):
    """Comm hook: sum the bucket, then divide by the world size in a .then()."""
    world = dist.get_world_size(state)
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / world)


def _snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train(ctx, use_hook):
    model = build_model(100 + ctx.rank)  # different initial weights on every rank
    initial = _snapshot(model)
    ddp = DDP(model, broadcast_buffers=True)
    after_wrap = _snapshot(model)
    if use_hook:
        ddp.register_comm_hook(None, allreduce_then_divide_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + ctx.rank)  # rank-dependent data
    for step in range(STEPS):
        ctx.progress(f"DDP {dist.get_backend()} hook={use_hook} step {step}")
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # BatchNorm updated its running stats with this rank's last batch; one
    # eval-mode forward (grad enabled) makes DDP broadcast rank 0's buffers
    # again without changing them.
    ddp.eval()
    ddp(torch.zeros(2, 8))
    return {"initial": initial, "after_wrap": after_wrap, "final": _snapshot(model)}


def with_and_without_hook_then_on_gloo(ctx, train, store_name):
    """{(backend, use_hook): train(ctx, use_hook)} on the run's backend, then on gloo
    (re-initialised in the same processes, store file `store_name`)."""
    out = {}
    for use_hook in (False, True):
        out[(ctx.backend, use_hook)] = train(ctx, use_hook)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=ctx.init_method(store_name), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.timeout())
    for use_hook in (False, True):
        out[("gloo", use_hook)] = train(ctx, use_hook)
    return out


def ddp_worker(ctx):
    return with_and_without_hook_then_on_gloo(ctx, train, "gloo_ddp")


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_gloo(world):
    rets = spawn_run(ddp_worker, world, backend=BACKEND, make_ref=False, timeout_s=150, pg_timeout_s=30).check().returns
    r0 = rets[0][(BACKEND, False)]
    # not vacuous: the ranks really start from different weights
    for r in range(1, world):
        assert any(not torch.equal(r0["initial"][k], rets[r][(BACKEND, False)]["initial"][k])
                   for k in r0["initial"] if k.endswith("weight")), "ranks built identical models"
    problems = []
    for use_hook in (False, True):
        run = f"{BACKEND}{' + comm hook' if use_hook else ''}"
        for r in range(world):
            mine = rets[r][(BACKEND, use_hook)]
            ref = rets[r][("gloo", use_hook)]
            # DDP broadcast rank 0's parameters and buffers at construction
            for k, v in mine["after_wrap"].items():
                if not torch.equal(v, rets[0][(BACKEND, use_hook)]["initial"][k]):
                    problems.append(f"{run}: rank {r}: {k} after DDP construction is not rank 0's initial value")
            for k, v in mine["final"].items():
                e = ref["final"][k]
                if not torch.allclose(v.double(), e.double(), rtol=1e-5, atol=1e-6):
                    diff = (v.double() - e.double()).abs().max().item()
                    problems.append(f"{run}: rank {r}: final {k} differs from gloo's (max |diff| {diff:.3g})")
                if not torch.equal(v, rets[0][(BACKEND, use_hook)]["final"][k]):
                    diff = (v.double() - rets[0][(BACKEND, use_hook)]["final"][k].double()).abs().max().item()
                    problems.append(f"{run}: final {k} differs between rank 0 and rank {r} (max |diff| {diff:.3g})")
        # not vacuous: training moved the weights
        w0 = rets[0][(BACKEND, use_hook)]
        assert not torch.equal(w0["final"]["0.weight"], w0["after_wrap"]["0.weight"]), "training changed nothing"
    assert not problems, "\n".join(problems)
