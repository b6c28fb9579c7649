"""Error feedback under DDP(find_unused_parameters=True).

A parameter a rank does not use in a step has a zero slice in the bucket. DDP copies the
averaged bucket into ``.grad`` only for parameters some rank used, so what a hook sends
for a parameter no rank used is lost. Before, the hooks sent such a parameter's residual
(its slice was zero, so they selected from the residual alone) and cleared it: the
residual vanished. Now a parameter whose local gradient is all zero keeps its residual
(and its DGC velocity) for a step in which it is used.

Checked by conservation, per parameter: summed over ranks, the local gradients of all
steps equal world x the applied (averaged) gradients plus the ranks' final residuals.
"""
import pytest
import torch

from mp_util import spawn_run

STEPS = 6


def _configs():
    from pycomm import hooks as H

    return {
        "topk": lambda: (H.TopKState(density=0.05, exact=True), H.topk_hook),
        "topk-step": lambda: (H.TopKState(density=0.05, exact=True, schedule="step"), H.topk_hook),
        # 3 ranks: hosts {0, 1} and {2}; the leaders (0 and 2) hold the residuals of their hosts' sums
        "topk-hosts": lambda: (H.TopKState(density=0.05, exact=True, hosts=[[0, 1], [2]]), H.topk_hook),
        "quantize-hosts": lambda: (H.QuantizeState(bits=4, block=32, hosts=[[0, 1], [2]]), H.quantize_hook),
        "topk-allgather": lambda: (H.TopKState(density=0.05, exact=True, exchange="allgather"), H.topk_hook),
        "quantize": lambda: (H.QuantizeState(bits=4, block=32), H.quantize_hook),
        "quantize-allgather": lambda: (H.QuantizeState(bits=4, block=32, exchange="allgather"), H.quantize_hook),
        "powersgd": lambda: (H.PowerSGDState(rank=1), H.powersgd_hook),
        "topk-momentum": lambda: (H.TopKState(density=0.05, exact=True, momentum=0.9), H.topk_hook),
    }


def _branch(step: int, rank: int) -> str:
    """Every rank uses a, every rank uses b, or rank 0 uses a and the others b (so each is
    unused on some rank and used by another)."""
    return ("a", "b", "a" if rank == 0 else "b")[step % 3]


def _net():
    import torch.nn as nn

    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.head = nn.Linear(16, 4)

        def forward(self, x, branch):
            return self.head(torch.tanh(getattr(self, branch)(x)))

    torch.manual_seed(0)
    return TwoBranches()


def _conservation_worker(ctx, name):
    if "hosts" in name:
        assert ctx.world_size == 3
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    state, hook = _configs()[name]()
    if "hosts" in name:
        assert state._hosts is not None, "the hosts exchange should run"
    net = _net()
    ddp = DDP(net, find_unused_parameters=True)
    names = {id(p): n for n, p in net.named_parameters()}
    local = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    applied = {n: torch.zeros_like(p) for n, p in net.named_parameters()}

    def recording(state, bucket):
        buffer, at = bucket.buffer(), 0
        for p in bucket.parameters():
            local[names[id(p)]] += buffer[at: at + p.numel()].view_as(p)
            at += p.numel()
        return hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    kept = []  # momentum / PowerSGD: b's velocity / warm-start Q before and after a step no rank used b in
    table = "_momenta" if getattr(state, "momentum", 0) else "_qs" if hasattr(state, "_qs") else None

    def keep():
        if table is not None and step % 3 == 0:
            kept.append(getattr(state, table).get(state._ordinal(net.b.weight), torch.zeros(0)).clone())

    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        net.zero_grad(set_to_none=True)
        keep()
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        F.mse_loss(ddp(x, _branch(step, ctx.rank)), y).backward()
        keep()
        for n, p in net.named_parameters():
            if p.grad is not None:
                applied[n] += p.grad
    residual = {}
    for n, p in net.named_parameters():
        r = state._residuals.get(state._ordinal(p))
        residual[n] = torch.zeros_like(p) if r is None else r.reshape(p.shape).clone()
    return {"local": local, "applied": applied, "residual": residual, "kept": kept}


def _conservation_problems(rets, world):
    problems = []
    for n in rets[0]["local"]:
        local = sum(r["local"][n] for r in rets)
        kept = world * rets[0]["applied"][n] + sum(r["residual"][n] for r in rets)
        if not all(torch.equal(rets[0]["applied"][n], r["applied"][n]) for r in rets):
            problems.append(f"{n}: the ranks applied different gradients")
        off = (local - kept).norm() / local.norm()
        if off > 1e-4:
            problems.append(f"{n}: conservation off by {off:.1%} of the local gradients' norm")
    return problems


@pytest.mark.parametrize("name", ["topk", "topk-step", "topk-hosts", "topk-allgather", "quantize",
                                  "quantize-hosts", "quantize-allgather", "powersgd"])
def test_error_feedback_keeps_the_residual_of_an_unused_parameter(name):
    world = 3 if "hosts" in name else 2
    rets = spawn_run(_conservation_worker, world, args=(name,), make_ref=False, timeout_s=120,
                     pg_timeout_s=60).check().returns
    rets = [rets[r] for r in sorted(rets)]
    problems = _conservation_problems(rets, world)
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", ["topk-momentum", "powersgd"])
def test_velocity_and_warm_start_of_a_parameter_no_rank_used_are_kept(name):
    """TopKState(momentum=...): a step in which no rank uses b leaves b's velocity as it was
    (before, it decayed by the momentum, and its selected entries were sent and lost).
    PowerSGD: b's warm-start Q stays (before, it became zero: M Q was zero on every rank)."""
    rets = spawn_run(_conservation_worker, 2, args=(name,), make_ref=False, timeout_s=120,
                     pg_timeout_s=60).check().returns
    for rank, r in rets.items():
        _, first, before, after = r["kept"]  # steps 0 and 3: only a is used, on both ranks
        if name == "powersgd":  # no Q for b before step 0: none, or a seeded one, but never zero
            assert first.numel() == 0 or first.any(), f"rank {rank}: b's Q became zero in step 0"
        assert before.abs().sum() > 0, f"rank {rank}: b's state should hold steps 1 and 2"
        assert torch.equal(before, after), f"rank {rank}: b's state changed by {(after - before).norm():.3g}"
