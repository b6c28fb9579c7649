"""Which part of pycomm's top-k costs accuracy under the user's momentum SGD: an ablation.

    python benchmarks/topk_ablation.py --lr 0.2      # prints one line per variant (accuracy per seed)

One process simulates `--world` data-parallel ranks (each computes the gradient of its
share of the global batch; the same data order and seed for every row) and combines the
gradients the way a variant of the top-k exchange would, in float64, before the user's
optimizer (SGD, momentum 0.9, unless the row says otherwise) steps. Only accuracy is
measured here (deterministic, load-independent); the real hook on the real backend is
in benchmarks/compression_digits.py. Variants (one factor at a time):

* selection scope: ``global`` (one top-k over the whole flat gradient) or ``param`` (top
  ``ceil(density n_p)`` of every parameter, as pycomm's hook does);
* owner re-sparsification: ``owner=None`` (every rank's selection summed exactly) or
  ``owner=d`` (rank c owns chunk c of every parameter and keeps the top
  ``ceil(d * chunk)`` of the reduced chunk; what it drops goes into its residual: the
  rule of csrc/algorithms/allreduce_sparse.cc; ``d = 0`` keeps every nonzero);
* momentum handling: ``ef-grad`` (error feedback on the gradient, the optimizer's momentum
  applies to the sparse average: the hook's behaviour before this change); ``dgc`` (DGC's
  momentum correction and factor masking in the hook, optimizer without momentum);
  ``dgc-compensated`` (DGC in the hook, the averaged sparse velocity handed to the
  optimizer as ``v_t - beta v_{t-1}`` so the user's momentum-``beta`` SGD steps by exactly
  ``v_t``: see docs/compression.md).

Selection is exact in every row: pycomm's hook selects exactly below 2^20 elements per
parameter (hooks._APPROX_MIN_NUMEL), which covers every parameter of these models; the
approximate band therefore plays no part here.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def _mlp(seed):
    torch.manual_seed(seed)
    # 64-1024-480-10: 563,370 parameters (the "~0.56M-parameter MLP")
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 480), nn.ReLU(), nn.Linear(480, 10))


def _balanced(n, world):
    base, extra = divmod(n, world)
    offsets = [0]
    for c in range(world):
        offsets.append(offsets[-1] + base + (1 if c < extra else 0))
    return offsets


def _count(n, density):
    return min(n, max(1, math.ceil(density * n - 1e-9)))


def _top(x, k):
    return torch.topk(x.abs(), k, sorted=False).indices


class Exchange:
    """One variant of the exchange: `__call__(grads) -> averaged update` (flat float64)."""

    def __init__(self, sizes, world, density, scope="param", owner=None, momentum="ef-grad", beta=0.9):
        self.sizes, self.world, self.density = sizes, world, density
        self.scope, self.owner, self.momentum, self.beta = scope, owner, momentum, beta
        n = sum(sizes)
        self.e = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
        self.u = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
        self.prev = torch.zeros(n, dtype=torch.float64)
        self.sent_pairs = 0
        self.steps = 0

    def _segments(self):
        if self.scope == "global":
            return [(0, sum(self.sizes))]
        out, at = [], 0
        for s in self.sizes:
            out.append((at, s))
            at += s
        return out

    def __call__(self, grads):
        total = torch.zeros_like(grads[0])
        dgc = self.momentum.startswith("dgc")
        for r, g in enumerate(grads):
            if dgc:
                self.u[r].mul_(self.beta).add_(g)
                x = self.e[r] + self.u[r]
            else:
                x = self.e[r] + g
            for off, n in self._segments():
                idx = _top(x[off: off + n], _count(n, self.density)) + off
                total[idx] += x[idx]
                self.sent_pairs += idx.numel()
                if dgc:
                    self.u[r][idx] = 0.0  # momentum factor masking
                x[idx] = 0.0
            self.e[r] = x
        if self.owner is not None:
            kept = torch.zeros_like(total)
            for off, n in self._segments():
                bounds = _balanced(n, self.world)
                for c in range(self.world):
                    lo, hi = off + bounds[c], off + bounds[c + 1]
                    if hi == lo:
                        continue
                    piece = total[lo:hi]
                    nz = int((piece != 0).sum())
                    k = nz if self.owner == 0 else min(nz, _count(hi - lo, self.owner))
                    idx = _top(piece, k) + lo if k else torch.zeros(0, dtype=torch.long)
                    kept[idx] = total[idx]
                    self.e[c][lo:hi] += total[lo:hi] - kept[lo:hi]  # the owner feeds back what it drops
            total = kept
        self.steps += 1
        avg = total / self.world
        if self.momentum == "dgc-compensated":
            out = avg - self.beta * self.prev
            self.prev = avg
            return out
        return avg


def train(args, variant, task_seed=0):
    from pycomm.train.tasks import get_task

    task = get_task("digits-mlp")
    x, y = task.x_train, task.y_train
    model = _mlp(args.seed)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    optim_momentum = 0.0 if variant.get("momentum") == "dgc" else args.momentum
    opt = torch.optim.SGD(params, lr=args.lr, momentum=optim_momentum)
    exchange = None if variant.get("dense") else Exchange(sizes, args.world, args.density,
                                                          scope=variant.get("scope", "param"),
                                                          owner=variant.get("owner"),
                                                          momentum=variant.get("momentum", "ef-grad"),
                                                          beta=args.momentum)
    per_rank = args.global_batch // args.world
    per_epoch = x.shape[0] // args.global_batch
    step = 0
    while step < args.steps:
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(args.seed * 1000 + step // per_epoch))
        for s in range(per_epoch):
            if step >= args.steps:
                break
            grads = []
            for r in range(args.world):
                idx = order[s * args.global_batch + r * per_rank: s * args.global_batch + (r + 1) * per_rank]
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]).double())
            avg = sum(grads) / args.world if exchange is None else exchange(grads)
            at = 0
            for p in params:
                p.grad = avg[at: at + p.numel()].view_as(p).to(p.dtype)
                at += p.numel()
            opt.step()
            step += 1
    with torch.no_grad():
        acc = (model(task.x_test).argmax(1) == task.y_test).float().mean().item()
    return acc


VARIANTS = [
    ("dense", {"dense": True}),
    ("ideal EF: global exact, no owner step (ef-grad)", {"scope": "global"}),
    ("per-parameter, no owner step (ef-grad)", {"scope": "param"}),
    ("per-parameter, owner keeps all nonzeros (owner 0) (ef-grad)", {"scope": "param", "owner": 0}),
    ("per-parameter, owner keeps 2% (ef-grad)", {"scope": "param", "owner": 0.02}),
    ("per-parameter, owner keeps 1% = pycomm default before (ef-grad)", {"scope": "param", "owner": 0.01}),
    ("global, owner keeps 1% (ef-grad)", {"scope": "global", "owner": 0.01}),
    ("per-parameter, owner 1%, DGC in hook + plain SGD", {"scope": "param", "owner": 0.01, "momentum": "dgc"}),
    ("per-parameter, owner 1%, DGC compensated for the user's momentum",
     {"scope": "param", "owner": 0.01, "momentum": "dgc-compensated"}),
    ("per-parameter, no owner step, DGC compensated", {"scope": "param", "momentum": "dgc-compensated"}),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--only", default="", help="comma-separated row numbers (0-based)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    only = {int(i) for i in args.only.split(",") if i}
    started = time.perf_counter()
    for i, (name, variant) in enumerate(VARIANTS):
        if only and i not in only:
            continue
        accs = []
        for seed in [int(s) for s in args.seeds.split(",")]:
            args.seed = seed
            accs.append(train(args, variant))
        rows.append({"variant": name, "accuracy": accs, "mean": sum(accs) / len(accs)})
        print(f"{i:2d} {name:<72} " + " ".join(f"{a * 100:6.2f}" for a in accs), flush=True)
    return rows, time.perf_counter() - started


if __name__ == "__main__":
    main()
