"""DistributedDataParallel with sparse gradients (nn.Embedding(sparse=True),
nn.EmbeddingBag(sparse=True), plus a dense head) on pycomm, against the same run on
gloo and against one process training on the concatenated batch.

Each rank looks up a different number of rows, drawn from a small range so ranks
overlap (and repeat rows within a batch); DDP hands each sparse gradient to
all_reduce on its own, after dividing it by the world size (no hook), or through a
comm hook that sums and divides in a .then() on the Future. After several SGD steps
the parameters must agree with gloo's, with the single-process reference, and across
ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import spawn_run

STEPS = 8
EMB_ROWS, EMB_DIM = 300, 12
BAG_ROWS, BAG_DIM = 200, 6


class Model(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(EMB_ROWS, EMB_DIM, sparse=True)
        self.bag = nn.EmbeddingBag(BAG_ROWS, BAG_DIM, mode="sum", sparse=True)
        self.head = nn.Linear(EMB_DIM + BAG_DIM, 3)

    def forward(self, ids, bag_ids, offsets):
        return self.head(torch.cat([self.emb(ids).mean(1), self.bag(bag_ids, offsets)], dim=1))


def batch(rank, step):
    """Rank `rank`'s batch at `step`: 3 + 2 * rank samples (uneven), rows from a small
    range (overlapping across ranks, repeated within one)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    b = 3 + 2 * rank
    ids = torch.randint(0, 40 + 10 * rank, (b, 4), generator=g)
    lengths = torch.randint(1, 5, (b,), generator=g)
    bag_ids = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    target = torch.randn(b, 3, generator=g)
    return ids, bag_ids, offsets, target


def global_batch(world, step):
    parts = [batch(r, step) for r in range(world)]
    ids = torch.cat([p[0] for p in parts])
    bag_ids = torch.cat([p[1] for p in parts])
    offsets, base = [], 0
    for p in parts:
        offsets.append(p[2] + base)
        base += p[1].numel()
    return ids, bag_ids, torch.cat(offsets), torch.cat([p[3] for p in parts])


def sample_losses(model, ids, bag_ids, offsets, target):
    return ((model(ids, bag_ids, offsets) - target) ** 2).sum(1)


def total_samples(world):
    return sum(3 + 2 * r for r in range(world))


def allreduce_then_divide_hook(state, bucket):
    world = dist.get_world_size(state)
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / world)


def train(ctx, use_hook):
    model = Model(100 + ctx.rank)  # DDP broadcasts rank 0's
    ddp = DDP(model)
    if use_hook:
        ddp.register_comm_hook(None, allreduce_then_divide_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    w = ctx.world_size
    for step in range(STEPS):
        ctx.progress(f"{dist.get_backend()} hook={use_hook} step {step}")
        ids, bag_ids, offsets, target = batch(ctx.rank, step)
        # DDP averages over ranks: scale so the average is the full batch's mean loss
        loss = sample_losses(ddp, ids, bag_ids, offsets, target).sum() * w / total_samples(w)
        opt.zero_grad()
        loss.backward()
        if step == 0 and not model.emb.weight.grad.is_sparse:
            raise AssertionError("the embedding gradient is not sparse")
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_sparse_worker(ctx):
    from test_ddp import with_and_without_hook_then_on_gloo

    return with_and_without_hook_then_on_gloo(ctx, train, "gloo_ddp_sparse")


def reference(world):
    model = Model(100)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(STEPS):
        loss = sample_losses(model, *global_batch(world, step)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_sparse_embeddings_match_gloo(world, transport):
    rets = spawn_run(ddp_sparse_worker, world, make_ref=False, env={"PYCOMM_TRANSPORT": transport},
                     timeout_s=180, pg_timeout_s=30).check().returns
    ref = reference(world)
    initial = Model(100).state_dict()
    problems = []
    for use_hook in (False, True):
        run = "pycomm" + (" + comm hook" if use_hook else "")
        for r in range(world):
            mine, gloo = rets[r][("pycomm", use_hook)], rets[r][("gloo", use_hook)]
            for k, v in mine.items():
                if not torch.allclose(v, gloo[k], rtol=1e-5, atol=1e-6):
                    problems.append(f"{run}: rank {r}: {k} differs from gloo's "
                                    f"(max |diff| {(v - gloo[k]).abs().max().item():.3g})")
                if not torch.allclose(v, ref[k], rtol=1e-4, atol=1e-5):
                    problems.append(f"{run}: rank {r}: {k} differs from the single-process reference "
                                    f"(max |diff| {(v - ref[k]).abs().max().item():.3g})")
                if not torch.equal(v, rets[0][("pycomm", use_hook)][k]):
                    problems.append(f"{run}: {k} differs between rank 0 and rank {r}")
        # not vacuous: training moved the embeddings
        for k in ("emb.weight", "bag.weight", "head.weight"):
            assert not torch.equal(rets[0][("pycomm", use_hook)][k], initial[k]), f"{k} did not change"
    assert not problems, "\n".join(problems)
