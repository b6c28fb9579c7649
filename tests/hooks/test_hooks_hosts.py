"""hosts=...: the compressed hooks among host leaders (pycomm/hooks/exchange.py _hosts_exchange;
TopKState and QuantizeState).

4 ranks on this one host, told to act as 2 hosts of 2 ([[0, 1], [2, 3]]): each host's
bucket is summed on its leader (ranks 0 and 2), the leaders compress the host's sum (top-k
or 8-bit) and run the compressed all-reduce between them, and broadcast the result.

The reference is the flat hook on a 2-rank group of the leaders, fed each host's sum
(built locally from every rank's seeded gradients): with the same seeds, ordinals and
group ranks it must give the same selection or rounding, residuals and small-parameter
rounding, so the hierarchical result is exactly the reference's / 2 (4 ranks rather than
2; a power of two, so exact). Three steps of two buckets each, the second with
parameters small enough to go through top-k's 8-bit all-reduce, check error feedback on
the leader and the order of the broadcasts; every rank must end with the same numbers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run
from test_hooks import _Bucket

SHAPES = [(300, 40), (2000,), (64,), (5000,), (100,), (10,)]
LAYOUT = [[0, 1, 2], [3, 4, 5]]  # bucket 0: params 0-2, bucket 1: params 3-5 (last)
HOSTS = [[0, 1], [2, 3]]


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(*shape, generator=g) for shape in SHAPES]


class _LateWork:
    """A Work whose future completes ``delay`` seconds after the real one."""

    def __init__(self, work, delay):
        self.work, self.delay = work, delay

    def get_future(self):
        import threading
        import time

        inner, late = self.work.get_future(), torch.futures.Future()

        def complete():
            inner.wait()
            time.sleep(self.delay)
            late.set_result(inner.value())
        threading.Thread(target=complete, daemon=True).start()
        return late


def _delay_first_reduce_of_each_step(hooks_module):
    """On this rank, the first bucket's sum of every step completes after the second's:
    its leader reaches the second bucket's sparse all-reduce first, the other leader not."""
    real = hooks_module.dist.reduce
    calls = [0]

    def reduce(*args, **kwargs):
        work = real(*args, **kwargs)
        calls[0] += 1
        return _LateWork(work, 0.3) if calls[0] % len(LAYOUT) == 1 else work
    hooks_module.dist = type("dist", (), {name: getattr(dist, name) for name in dir(dist) if not name.startswith("__")})
    hooks_module.dist.reduce = staticmethod(reduce)


def _kind(kind):
    """(state factory, hook) of a compressed hook with hosts=..."""
    from pycomm import hooks

    if kind == "topk":
        return (lambda **kw: hooks.TopKState(density=0.01, **kw)), hooks.topk_hook
    return (lambda **kw: hooks.QuantizeState(bits=8, **kw)), hooks.quantize_hook


def _hosts_worker(ctx, late=False, kind="topk"):
    from pycomm import hooks

    make_state, hook = _kind(kind)

    rank = ctx.rank
    problems = []
    if late and rank == 0:
        _delay_first_reduce_of_each_step(hooks.exchange)  # where _hosts_exchange calls dist.reduce
    params = [torch.nn.Parameter(torch.zeros(*shape)) for shape in SHAPES]
    state = make_state(hosts=HOSTS)
    if state._hosts is None or state._hosts.is_leader != (rank in (0, 2)):
        return ["hosts=[[0, 1], [2, 3]] did not build the hierarchical exchange"]
    ref_group = dist.new_group([0, 2])  # every rank creates it; the leaders use it
    ref_params = [torch.nn.Parameter(torch.zeros(*shape)) for shape in SHAPES]
    ref_state = make_state(process_group=ref_group) if rank in (0, 2) else None
    host = 0 if rank < 2 else 1
    for step in range(3):
        mine = _grads(rank, step)
        host_sum = [a + b for a, b in zip(*(_grads(r, step) for r in HOSTS[host]))]
        futures = []  # every bucket handed over before any is waited for, as DDP does
        for b, positions in enumerate(LAYOUT):
            last = b == len(LAYOUT) - 1
            bucket = _Bucket([params[i] for i in positions], [mine[i] for i in positions], b, last)
            futures.append(hook(state, bucket))
        for b, positions in enumerate(LAYOUT):
            last = b == len(LAYOUT) - 1
            got = futures[b].wait()
            gathered = [torch.empty_like(got) for _ in range(ctx.world_size)]
            dist.all_gather(gathered, got, group=ctx.ref)
            if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
                problems.append(f"step {step} bucket {b}: ranks hold different results")
            if ref_state is not None:
                ref_bucket = _Bucket([ref_params[i] for i in positions], [host_sum[i] for i in positions], b, last)
                expected = hook(ref_state, ref_bucket).wait() / 2
                if not torch.equal(got, expected):
                    diff = (got - expected).abs().max().item()
                    problems.append(f"step {step} bucket {b}: differs from the leaders' flat hook on the "
                                    f"host sums / 2 (max abs diff {diff:g})")
                if not got.abs().sum() > 0:
                    problems.append(f"step {step} bucket {b}: all zeros")
    if rank in (0, 2):
        if not state._residuals or not any(r.abs().sum() > 0 for r in state._residuals.values()):
            problems.append("the leader kept no residual")
    elif any(r.abs().sum() > 0 for r in state._residuals.values()):
        problems.append("a rank that is not a leader kept a residual")
    return problems


def _problems(run, world):
    rets = run.check().returns
    return [f"rank {r}: {p}" for r in range(world) for p in rets[r]]


@pytest.mark.parametrize("kind", ["topk", "quantize"])
@pytest.mark.parametrize("late", [False, True], ids=["in-order", "first-sum-late-on-one-leader"])
def test_hosts_match_the_leaders_flat_hook(late, kind):
    """``late``: rank 0's first bucket of each step finishes its sum after the second
    (its callback then runs after the second's): the leaders must still start their
    compressed all-reduces in bucket order, or they pair different buckets."""
    problems = _problems(spawn_run(_hosts_worker, 4, args=(late, kind), timeout_s=240, pg_timeout_s=30), 4)
    assert not problems, "\n".join(problems)


def _usage_worker(ctx):
    from pycomm.hooks import TopKState

    problems = []
    for hosts, match in (([[0, 1], [1, 2, 3]], "every rank of the group once"),
                         ([[0, 1], [2, 2]], "every rank of the group once"),
                         ([[0, 1, 2], []], "every rank of the group once"),
                         ("everywhere", "must be None, 'auto' or lists of ranks")):
        try:
            TopKState(hosts=hosts)
            problems.append(f"hosts={hosts!r}: no error")
        except ValueError as e:
            if match not in str(e):
                problems.append(f"hosts={hosts!r}: {e}")
    try:
        TopKState(hosts="auto", schedule="step")
        problems.append("schedule='step' with hosts: no error")
    except ValueError as e:
        if "schedule='bucket'" not in str(e):
            problems.append(str(e))
    # one host (every rank here): the flat exchange, no groups
    if TopKState(hosts="auto")._hosts is not None:
        problems.append("hosts='auto' on one host built the hierarchical exchange")
    if TopKState(hosts=[[0], [1], [2]])._hosts is not None:
        problems.append("one rank per host built the hierarchical exchange")
    return problems


def test_hosts_usage():
    problems = _problems(spawn_run(_usage_worker, 3, timeout_s=120), 3)
    assert not problems, "\n".join(problems)


def test_hosts_needs_an_initialised_group():
    from pycomm.hooks import TopKState

    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="initialised default process group"):
        TopKState(hosts="auto")


def _ddp_worker(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.hooks import TopKState, topk_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 4))
    start = [p.detach().clone() for p in model.parameters()]
    # small buckets: several per step, so broadcasts of different buckets overlap
    ddp = DDP(model, bucket_cap_mb=0.004)
    ddp.register_comm_hook(TopKState(density=0.05, hosts=HOSTS), topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(6):
        x = torch.randn(16, 32, generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat, group=ctx.ref)
    problems = []
    if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
        problems.append("replicas differ after 6 steps")
    if all(torch.equal(p.detach(), s) for p, s in zip(model.parameters(), start)):
        problems.append("the model did not change")
    return problems


def test_hosts_under_ddp_keeps_replicas_identical():
    problems = _problems(spawn_run(_ddp_worker, 4, timeout_s=240), 4)
    assert not problems, "\n".join(problems)


def _leader_dies_worker(ctx):
    import os
    import signal
    import time

    from pycomm.hooks import TopKState, topk_hook

    params = [torch.nn.Parameter(torch.zeros(*shape)) for shape in SHAPES]
    state = TopKState(density=0.01, hosts=HOSTS)
    for step in range(3):
        grads = _grads(ctx.rank, step)
        if step == 2 and ctx.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # host 1's leader, before its step-2 buckets
        started = time.monotonic()
        try:
            for b, positions in enumerate(LAYOUT):
                bucket = _Bucket([params[i] for i in positions], [grads[i] for i in positions], b,
                                 b == len(LAYOUT) - 1)
                topk_hook(state, bucket).wait()
        except Exception as e:  # noqa: BLE001 - the failure is the point
            return ("raised", step, time.monotonic() - started, str(e)[:300])
    return ("finished", None, None, None)


def test_a_dead_leader_fails_every_rank_not_hangs():
    """Host 1's leader is killed: its host's other rank (waiting for the broadcast) and
    the other host's ranks (the leaders' exchange, then its broadcast) must raise, well
    before the groups' 60 s timeout."""
    run = spawn_run(_leader_dies_worker, 4, timeout_s=150, pg_timeout_s=60)
    assert not run.hung, run.failure_message()
    for rank in (0, 1, 3):
        assert rank in run.returns, run.failure_message()
        what, step, seconds, message = run.returns[rank]
        assert (what, step) == ("raised", 2), (rank, run.returns[rank])
        assert seconds < 30, (rank, run.returns[rank])


def _resume_worker(ctx):
    import copy

    from pycomm.hooks import TopKState, rank_state, topk_hook

    params = [torch.nn.Parameter(torch.zeros(*shape)) for shape in SHAPES]

    def step(state, k):
        grads = _grads(ctx.rank, k)
        futures = [topk_hook(state, _Bucket([params[i] for i in positions], [grads[i] for i in positions], b,
                                            b == len(LAYOUT) - 1))
                   for b, positions in enumerate(LAYOUT)]
        return [f.wait().clone() for f in futures]

    state = TopKState(density=0.01, hosts=HOSTS)
    for k in range(3):
        step(state, k)
    saved = copy.deepcopy(state.state_dict())
    straight = [step(state, k) for k in (3, 4)]
    resumed_state = TopKState(density=0.01, hosts=HOSTS)
    resumed_state.load_state_dict(saved)
    resumed = [step(resumed_state, k) for k in (3, 4)]
    problems = []
    if saved["config"]["hosts"] != HOSTS:
        problems.append(f"state_dict config hosts: {saved['config']['hosts']!r}")
    if (ctx.rank in (0, 2)) != bool(rank_state(saved)["residuals"]):
        problems.append(f"residuals saved: {len(rank_state(saved)['residuals'])} (leaders keep them, the others none)")
    for k, (a, b) in enumerate(zip(straight, resumed)):
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            problems.append(f"step {3 + k}: the resumed state differs from the uninterrupted one")
    return problems


def test_hosts_state_survives_a_checkpoint():
    problems = _problems(spawn_run(_resume_worker, 4, timeout_s=240), 4)
    assert not problems, "\n".join(problems)
