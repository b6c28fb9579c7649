"""Which part of pycomm's top-k costs accuracy under the user's momentum SGD: an ablation.

    python benchmarks/topk_ablation.py --lr 0.2      # prints one line per variant (accuracy per seed)
    python benchmarks/topk_ablation.py --task lm --only 0,4,10,11,13,16,17   # tinylm (or --task cnn)

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

* which parameters are compressed: ``dense_params`` averages some exactly (``1d``: biases
  and norms; ``embed``: token and position embeddings; ``lt:N``: fewer than N entries);
  ``min_k``: at least that many entries of every parameter;
* schedule: ``warmup`` steps of DGC's sparsity warm-up (density falls exponentially from
  1 to ``density``); ``density``: another density for the row.

``--task`` picks the model and data: ``mlp`` (the issue's 0.56M MLP, default), ``cnn``
and ``lm`` (pycomm.train's digits-cnn and tinylm), the tasks of
benchmarks/compression_digits.py.

Selection is exact in every row: pycomm's hook selects exactly below 2^20 elements per
parameter (hooks.topk._APPROX_MIN_NUMEL), which covers every parameter of these models; the
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

    def __init__(self, sizes, world, density, scope="param", owner=None, momentum="ef-grad", beta=0.9,
                 dense_params=(), warmup=0, min_k=1):
        self.sizes, self.world, self.density = sizes, world, density
        self.dense_params = set(dense_params)  # parameter numbers averaged exactly (not compressed)
        self.min_k = min_k  # at least min(n, min_k) entries of every parameter
        self.warmup = warmup  # DGC's sparsity warm-up: density rises from 1 to `density` over these steps
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
        for i, s in enumerate(self.sizes):
            if i not in self.dense_params:
                out.append((at, s))
            at += s
        return out

    def _density(self):
        if self.steps >= self.warmup:
            return self.density
        # exponential: 1, ..., density over `warmup` steps (DGC's 75%, 93.75%, ... in steps)
        return self.density ** ((self.steps + 1) / (self.warmup + 1))

    def __call__(self, grads):
        total = torch.zeros_like(grads[0])
        dense_mask = torch.ones_like(grads[0], dtype=torch.bool)
        for off, n in self._segments():
            dense_mask[off: off + n] = False
        for g in grads:
            total[dense_mask] += g[dense_mask]
        density = self._density()
        dgc = self.momentum.startswith("dgc")
        for r, g in enumerate(grads):
            if dgc:
                self.u[r].mul_(self.beta).add_(g)
                x = self.e[r] + self.u[r]
            else:
                x = self.e[r] + g
            for off, n in self._segments():
                idx = _top(x[off: off + n], max(_count(n, density), min(n, self.min_k))) + off
                total[idx] += x[idx]
                self.sent_pairs += idx.numel()
                if dgc:
                    self.u[r][idx] = 0.0  # momentum factor masking
                x[idx] = 0.0
            self.e[r] = x
        if self.owner is not None:
            kept = total * dense_mask
            for off, n in self._segments():
                bounds = _balanced(n, self.world)
                for c in range(self.world):
                    lo, hi = off + bounds[c], off + bounds[c + 1]
                    if hi == lo:
                        continue
                    piece = total[lo:hi]
                    nz = int((piece != 0).sum())
                    owner = self.owner if self.owner == 0 or self.steps >= self.warmup else min(1.0, 2 * density)
                    k = nz if owner == 0 else min(nz, _count(hi - lo, owner))
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


def _make(args):
    """(model, task) of --task: mlp (the issue's 0.56M MLP on digits), cnn (pycomm.train
    digits-cnn), lm (pycomm.train tinylm, dropout 0.1); the benchmark's three tasks."""
    from pycomm.train.tasks import get_task

    if args.task == "mlp":
        return _mlp(args.seed), get_task("digits-mlp")
    task = get_task({"cnn": "digits-cnn", "lm": "tinylm"}[args.task])
    return task.make_model(args.seed), task


def _dense_params(rule, named, density=0.01):
    """Parameter numbers a variant averages exactly: "1d" (biases, norms), "embed"
    (token and position embeddings), "lt:N" (fewer than N entries), "rate:R" (dense float32
    bytes below R x the bytes of its top-k pairs, 4-byte index + 4-byte value: the rule of
    TopKState's min_compression_rate), combined with "+"."""
    out = set()
    for part in (rule or "").split("+"):
        for i, (name, p) in enumerate(named):
            if part == "1d" and p.dim() == 1:
                out.add(i)
            elif part == "embed" and ("token" in name or "position" in name):
                out.add(i)
            elif part.startswith("lt:") and p.numel() < int(part[3:]):
                out.add(i)
            elif part.startswith("rate:") and 4 * p.numel() < float(part[5:]) * 8 * _count(p.numel(), density):
                out.add(i)
    return out


def train(args, variant):
    model, task = _make(args)
    x, y = task.x_train, task.y_train
    named = list(model.named_parameters())
    params = [p for _, p in named]
    sizes = [p.numel() for p in params]
    optim_momentum = 0.0 if variant.get("momentum") == "dgc" else args.momentum
    opt = torch.optim.SGD(params, lr=args.lr, momentum=optim_momentum)
    exchange = None if variant.get("dense") else Exchange(sizes, args.world, variant.get("density", args.density),
                                                          scope=variant.get("scope", "param"),
                                                          owner=variant.get("owner"),
                                                          momentum=variant.get("momentum", "ef-grad"),
                                                          beta=args.momentum,
                                                          dense_params=_dense_params(variant.get("dense_params"), named,
                                                                                      variant.get("density", args.density)),
                                                          warmup=variant.get("warmup", 0),
                                                          min_k=variant.get("min_k", 1))
    per_rank = args.global_batch // args.world
    per_epoch = x.shape[0] // args.global_batch
    step = 0
    model.train()
    while step < args.steps:
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(args.seed * 1000 + step // per_epoch))
        for s in range(per_epoch):
            if step >= args.steps:
                break
            grads = []
            for r in range(args.world):
                idx = order[s * args.global_batch + r * per_rank: s * args.global_batch + (r + 1) * per_rank]
                model.zero_grad(set_to_none=True)
                task.loss(model(x[idx]), y[idx]).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]).double())
            avg = sum(grads) / args.world if exchange is None else exchange(grads)
            at = 0
            for p in params:
                p.grad = avg[at: at + p.numel()].view_as(p).to(p.dtype)
                at += p.numel()
            opt.step()
            step += 1
            if step in getattr(args, "eval_at", ()):
                args.curve.append((step, _accuracy(model, task)))
    return _accuracy(model, task)


def _accuracy(model, task):
    model.eval()
    with torch.no_grad():
        _, correct, count = task.score(model(task.x_test), task.y_test)
    model.train()
    return correct / count


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
    # rows 10..: which parameters and what schedule (owners keep 2%, pycomm's default)
    ("owner 2%, biases and norms (1-D) dense", {"owner": 0.02, "dense_params": "1d"}),
    ("owner 2%, embeddings dense", {"owner": 0.02, "dense_params": "embed"}),
    ("owner 2%, 1-D and embeddings dense", {"owner": 0.02, "dense_params": "1d+embed"}),
    ("owner 2%, sparsity warm-up 50 steps", {"owner": 0.02, "warmup": 50}),
    ("owner 2%, sparsity warm-up 100 steps", {"owner": 0.02, "warmup": 100}),
    ("owner 2%, 1-D dense, warm-up 100 steps", {"owner": 0.02, "dense_params": "1d", "warmup": 100}),
    ("owner 2%, density 10%", {"owner": 0.2, "density": 0.1}),
    ("no owner step, dgc (plain SGD in the optimizer)", {"momentum": "dgc"}),
    ("owner 2%, at least 8 entries of every parameter", {"owner": 0.02, "min_k": 8}),
    ("owner 2%, at least 16 entries of every parameter", {"owner": 0.02, "min_k": 16}),
    ("owner 2%, fewer than 100 entries dense (norms, some biases)", {"owner": 0.02, "dense_params": "lt:100"}),
    ("owner 2%, min_compression_rate 40 (dense below 40 x pair bytes)", {"owner": 0.02, "dense_params": "rate:40"}),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="mlp", choices=("mlp", "cnn", "lm"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--only", default="", help="comma-separated row numbers (0-based)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also print test accuracy every N steps (step:acc, per seed); 0: final only")
    args = parser.parse_args(argv)
    args.eval_at = set(range(args.eval_every, args.steps + 1, args.eval_every)) if args.eval_every > 0 else set()
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
            args.curve = []
            accs.append(train(args, variant))
            if args.curve:
                print(f"   seed {seed}: " + " ".join(f"{step}:{a * 100:.1f}" for step, a in args.curve), flush=True)
        rows.append({"variant": name, "accuracy": accs, "mean": sum(accs) / len(accs)})
        print(f"{i:2d} {name:<72} " + " ".join(f"{a * 100:6.2f}" for a in accs), flush=True)
    return rows, time.perf_counter() - started


if __name__ == "__main__":
    main()
