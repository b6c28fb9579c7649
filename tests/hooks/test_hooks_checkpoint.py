"""Checkpoints of the compressed hooks' state: each rank's residuals are its own.

Before, ``state_dict()`` put every rank's residuals under the same keys, so
``torch.distributed.checkpoint`` kept one rank's copy of each (after a load, the ranks held
a mix of both ranks' residuals, with no error), and a rank loading another rank's
``torch.save`` file was not told. Now the tensors sit under ``"rank<r>"`` and
``load_state_dict`` refuses another rank's state or another world size.
"""
import os

import pytest
import torch

from mp_util import spawn_run


def _configs():
    from pycomm import hooks as H

    return {
        "topk": lambda: (H.TopKState(density=0.1, exact=True, momentum=0.5), H.topk_hook),
        "quantize": lambda: (H.QuantizeState(bits=4, block=32), H.quantize_hook),
        "powersgd": lambda: (H.PowerSGDState(rank=1), H.powersgd_hook),
    }


def _trained_state(ctx, name):
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DDP(net)
    state, hook = _configs()[name]()
    ddp.register_comm_hook(state, hook)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + ctx.rank)
        net.zero_grad()
        F.mse_loss(ddp(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
    return state


def _tensors(state):
    """Every per-rank tensor of a state, by (table, ordinal)."""
    out = {}
    for table in ("_residuals", "_momenta", "_qs"):
        for ordinal, t in getattr(state, table, {}).items():
            out[(table, ordinal)] = t.detach().clone().reshape(-1)
    return out


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _dcp_worker(ctx, name, directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = _trained_state(ctx, name)
    saved = _tensors(state)
    dcp.save({"hook": state.state_dict()}, checkpoint_id=directory)
    dist.barrier()
    fresh, _ = _configs()[name]()  # as a new process: no residuals yet
    loaded = {"hook": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=directory)
    fresh.load_state_dict(loaded["hook"])
    others = [None] * ctx.world_size
    dist.all_gather_object(others, saved)
    return {"mine": _same(_tensors(fresh), saved), "count": len(saved), "step": fresh.step,
            "differs": not _same(others[0], others[1])}


@pytest.mark.parametrize("name", ["topk", "quantize", "powersgd"])
def test_distributed_checkpoint_keeps_every_ranks_residuals(name, tmp_path):
    rets = spawn_run(_dcp_worker, 2, args=(name, str(tmp_path / "ckpt")), make_ref=False, timeout_s=120,
                     pg_timeout_s=60).check().returns
    assert rets[0]["differs"], "the ranks' residuals should differ for this test to mean anything"
    for rank, r in rets.items():
        assert r["count"] > 0 and r["step"] == 3
        assert r["mine"], f"rank {rank} did not get its own residuals back from torch.distributed.checkpoint"


def _save_load_worker(ctx, name, directory):
    import torch.distributed as dist

    state = _trained_state(ctx, name)
    torch.save(state.state_dict(), os.path.join(directory, f"hook{ctx.rank}.pt"))
    dist.barrier()
    out = {}
    own, _ = _configs()[name]()
    own.load_state_dict(torch.load(os.path.join(directory, f"hook{ctx.rank}.pt"), weights_only=True))
    out["own"] = _same(_tensors(own), _tensors(state))
    other = torch.load(os.path.join(directory, f"hook{1 - ctx.rank}.pt"), weights_only=True)
    try:
        _configs()[name]()[0].load_state_dict(other)
        out["other"] = "accepted"
    except ValueError as e:
        out["other"] = str(e)
    mine = state.state_dict()
    entry = mine[f"rank{ctx.rank}"][0]
    entry["world_size"] = 4
    try:
        _configs()[name]()[0].load_state_dict(mine)
        out["world"] = "accepted"
    except ValueError as e:
        out["world"] = str(e)
    return out


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_a_rank_refuses_another_ranks_or_world_sizes_state(name, tmp_path):
    rets = spawn_run(_save_load_worker, 2, args=(name, str(tmp_path)), make_ref=False, timeout_s=120,
                     pg_timeout_s=60).check().returns
    for rank, r in rets.items():
        assert r["own"], f"rank {rank}: its own torch.save file did not restore its state"
        assert f"holds the state of rank{1 - rank}, not of rank {rank}" in r["other"], r["other"]
        assert "saved by rank" in r["world"] and "of 4 ranks" in r["world"], r["world"]


def test_state_dict_outside_a_process_group_round_trips():
    from pycomm import hooks as H

    s = H.TopKState()
    s._residuals[0] = torch.arange(5.0)
    sd = s.state_dict()
    assert sd["world_size"] == 1 and sd["rank0"][0]["rank"] == 0
    t = H.TopKState()
    t.load_state_dict(sd)
    assert torch.equal(t._residuals[0], torch.arange(5.0))


def test_a_state_saved_before_ranks_were_recorded_loads_with_a_warning():
    from pycomm import hooks as H

    legacy = {"kind": "topk", "version": 1, "step": 7, "seed": 0, "config": {},
              "residuals": {0: torch.ones(3)}, "momenta": {}}
    s = H.TopKState()
    with pytest.warns(UserWarning, match="did not record the rank"):
        s.load_state_dict(legacy)
    assert s.step == 7 and torch.equal(s._residuals[0], torch.ones(3))


def _raising_worker(ctx, name):
    """Rank 1's state holds a residual of the wrong size (loaded from another model, say):
    its hook raises before issuing its collective, while rank 0 issues its own. Rank 1 then
    stays (a training loop that handles the error, say) until rank 0 is done or 45 s pass:
    leaving would shut its group down and tell rank 0 anyway."""
    import time

    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DDP(net)
    state, hook = _configs()[name]()
    if ctx.rank == 1:
        state._residuals[state._ordinal(net[2].weight)] = torch.zeros(3)  # a matrix: PowerSGD compresses it
    ddp.register_comm_hook(state, hook)
    start = time.monotonic()
    try:
        F.mse_loss(ddp(torch.randn(8, 16)), torch.randn(8, 4)).backward()
        out = {"error": None}
    except Exception as e:  # noqa: BLE001
        out = {"error": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.monotonic() - start
    if ctx.rank == 0:
        ctx.mark_done()
    else:
        ctx.wait_done(0, limit_s=45)
    return out


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_a_hook_that_raises_on_one_rank_fails_the_others_at_once(name):
    """Before, rank 0 waited in its collective until rank 1 left or the group's timeout."""
    rets = spawn_run(_raising_worker, 2, args=(name,), make_ref=False, timeout_s=120,
                     pg_timeout_s=60).check().returns
    assert "has 3 elements" in rets[1]["error"], rets[1]
    assert rets[0]["error"] is not None and "rank 1 aborted the group" in rets[0]["error"], rets[0]
    assert "raised ValueError" in rets[0]["error"], rets[0]["error"]
    assert rets[0]["seconds"] < 20, f"rank 0 learnt of it after {rets[0]['seconds']:.1f} s"
