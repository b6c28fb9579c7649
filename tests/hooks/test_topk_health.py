"""TopKState's density warm-up and its health accounting.

* ``density_warmup``: the density falls exponentially from ``start_density`` to
  ``density`` over the first steps; each step selects ``ceil(density_at(step) * n)``
  entries of every sparsified parameter; a checkpoint keeps the step counter and the
  schedule, so a resumed run continues it and ends where the uninterrupted one does.
* ``health()`` (and pycomm.stats()["hooks"]): the entries selected over the run (effective density), the residual /
  gradient norm ratio, and the bytes sent on the group from the hook's first step, the
  warm-up's included: the same count pycomm.stats() gives for the run.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mp_util import spawn_run

STEPS = 6


def test_density_schedule():
    from pycomm.hooks import TopKState

    s = TopKState(density=0.01, density_warmup=10, start_density=0.25)
    assert s.density_at(0) == pytest.approx(0.25)
    assert s.density_at(5) == pytest.approx(0.25 * (0.01 / 0.25) ** 0.5)
    assert all(s.density_at(t) > s.density_at(t + 1) for t in range(9))
    assert s.density_at(10) == s.density_at(1000) == 0.01
    assert TopKState(density=0.01).density_at(0) == 0.01  # no warm-up
    assert TopKState(density=0.3, density_warmup=10, start_density=0.25).density_at(0) == 0.3  # never below density
    with pytest.raises(ValueError, match="density_warmup"):
        TopKState(density_warmup=-1)
    with pytest.raises(ValueError, match="start_density"):
        TopKState(start_density=0.0)


def test_state_dict_keeps_the_step_and_the_schedule():
    from pycomm.hooks import TopKState

    s = TopKState(density=0.01, density_warmup=10, start_density=0.25)
    s.step = 4
    fresh = TopKState(density=0.01)
    fresh.load_state_dict(s.state_dict())
    assert fresh.step == 4
    assert fresh.density_at(fresh.step) == pytest.approx(s.density_at(4))
    assert fresh.health()["density"] == pytest.approx(s.density_at(4))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 60), nn.Tanh(), nn.Linear(60, 5))  # 2,400 / 300: sparsified at 5%


def _train(ctx, state, start, steps, model=None):
    import pycomm
    from pycomm import hooks as H
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model if model is not None else _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: a resumed run is the same run
    selected, sent = [], []
    pycomm.reset_stats()
    first_call = []

    def hook(s, bucket) -> torch.futures.Future[torch.Tensor]:
        if not first_call:  # the hook's first step starts its count
            first_call.append(pycomm.stats()["bytes_sent"])
        return H.topk_hook(s, bucket)

    ddp.register_comm_hook(state, hook)
    for step in range(start, start + steps):
        before = state._health.selected
        bytes_before = pycomm.stats()["bytes_sent"]
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        x = torch.randn(16, 40, generator=g)
        opt.zero_grad()
        F.mse_loss(ddp(x), torch.sin(x[:, :5])).backward()
        opt.step()
        selected.append(state._health.selected - before)
        sent.append(pycomm.stats()["bytes_sent"] - bytes_before)
    return model, selected, sent, pycomm.stats()["bytes_sent"] - first_call[0]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(ctx):
    from pycomm.compression import topk_count
    from pycomm.hooks import TopKState

    problems = []
    make = lambda: TopKState(density=0.05, density_warmup=4, start_density=0.5, exact=True)  # noqa: E731
    state = make()
    model, selected, sent, total = _train(ctx, state, 0, STEPS)
    sparsified = [p.numel() for p in model.parameters() if state.compressed(p.numel(), 4, 2)]
    if sorted(sparsified) != [60, 300, 2400]:  # the 5-entry bias: 0.25 entries at 5%, averaged apart
        problems.append(f"sparsified parameters {sparsified}, expected all but the last bias")
    expected = [sum(topk_count(n, state.density_at(t)) for n in sparsified) for t in range(STEPS)]
    if selected != expected:
        problems.append(f"entries selected per step {selected}, expected {expected}")
    h = state.health()
    if h["steps"] != STEPS:
        problems.append(f"health steps {h['steps']}")
    if h["effective_density"] != pytest.approx(sum(expected) / (STEPS * sum(sparsified))):
        problems.append(f"effective density {h['effective_density']}")
    # every byte of the run from the hook's first call, the warm-up's included: what
    # pycomm.stats() counted over the same span (nothing else ran on the group)
    if h["bytes_sent"] != total:
        problems.append(f"health bytes_sent {h['bytes_sent']}, pycomm.stats() {total}")
    if not sent[0] > sent[-1]:
        problems.append(f"bytes per step {sent}: the warm-up's first step should send the most")
    if not (h["residual_ratio"] is not None and h["residual_ratio"] > 0.0 and h["residual_ratio_mean"] > 0.0):
        problems.append(f"residual ratio {h['residual_ratio']} / {h['residual_ratio_mean']}")
    n = sum(p.numel() for p in model.parameters())
    if h["dense_bytes"] != pytest.approx(STEPS * n * 4.0):  # 2 ranks: 2 (2 - 1) / 2 x 4 bytes per element
        problems.append(f"dense_bytes {h['dense_bytes']}")
    if h["bytes_ratio"] != pytest.approx(h["dense_bytes"] / h["bytes_sent"]):
        problems.append(f"bytes_ratio {h['bytes_ratio']}")

    # pycomm.stats() lists it; reset_stats() loses none of its bytes
    import pycomm

    listed = [e for e in pycomm.stats()["hooks"] if e["kind"] == "topk" and e["steps"] == STEPS]
    if len(listed) != 1 or listed[0]["bytes_sent"] != h["bytes_sent"]:
        problems.append(f"pycomm.stats()['hooks']: {pycomm.stats()['hooks']}")
    pycomm.reset_stats()
    if state.health()["bytes_sent"] != h["bytes_sent"]:
        problems.append(f"after reset_stats(): bytes_sent {state.health()['bytes_sent']}, was {h['bytes_sent']}")

    # resumed from a checkpoint in the middle of the warm-up: the schedule continues
    first = make()
    m, sel_a, _, _ = _train(ctx, first, 0, 2)
    saved = first.state_dict()
    second = TopKState(density=0.05, exact=True)  # the schedule comes from the checkpoint
    second.load_state_dict(saved)
    m, sel_b, _, _ = _train(ctx, second, 2, STEPS - 2, model=m)
    if sel_a + sel_b != selected:
        problems.append(f"resumed run selected {sel_a + sel_b}, uninterrupted {selected}")
    if not torch.equal(_flat(m), _flat(model)):
        problems.append("resumed run ends with other parameters than the uninterrupted one")
    if second.health()["steps"] != STEPS or second._health.selected != sum(selected):
        problems.append(f"resumed health {second.health()} (counters not carried over)")
    return problems


@pytest.mark.slow
def test_warmup_counts_bytes_and_resume():
    rets = spawn_run(_worker, 2, timeout_s=180, make_ref=False, pg_timeout_s=60).check().returns
    for rank, problems in sorted(rets.items()):
        assert problems == [], f"rank {rank}: {problems}"
