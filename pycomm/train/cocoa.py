"""CoCoA / CoCoA+ for L2-regularised logistic regression (``--task digits-logreg --strategy cocoa``).

The problem, with n samples (x_i, y_i), y_i in {-1, +1}, over K ranks that each hold a
fixed partition P_k of the samples (rank k takes samples k, k + K, ...)::

    primal  P(w) = 1/n sum_i log(1 + exp(-y_i x_i.w)) + lambda/2 ||w||^2
    dual    D(a) = 1/n sum_i H(b_i) - lambda/2 ||w(a)||^2,  a_i = y_i b_i, b_i in [0, 1],
            w(a) = 1/(lambda n) sum_i a_i x_i,               H(b) = -b log b - (1-b) log(1-b)

(Shalev-Shwartz and Zhang 2013 for the dual of the logistic loss). P(w(a)) - D(a) >= 0 is
the duality gap; it bounds the primal sub-optimality of w(a).

One round (Jaggi et al. 2014, CoCoA; Ma, Smith et al. 2015 and Smith et al. 2018, CoCoA+):

1. every rank runs ``local_passes`` passes of stochastic dual coordinate ascent (SDCA) over
   its own partition on the local subproblem G_k^{sigma'}: the dual objective restricted to
   its coordinates, with the coupling term ||A_[k] da_[k]||^2 scaled by sigma'. Each
   coordinate step solves its 1-D problem exactly (safeguarded Newton);
2. the primal updates dw_k = 1/(lambda n) A_[k] da_[k] are summed with one all-reduce and
   applied with the aggregation parameter gamma: w += gamma sum_k dw_k, a_[k] += gamma da_[k].

sigma' = gamma K is the safe choice of CoCoA+ for gamma in (0, 1]: gamma = 1 adds the updates
(CoCoA+), gamma = 1/K averages them (the original CoCoA). With it the dual objective never
decreases. The all-reduce carries d + 2 float64 values per round: dw_k, and the partial
sums of the loss and of the entropies for the duality gap.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from .base import _PREFIX, register_strategy, StrategySpec
from .config import TrainConfig, check_own_loop
from .trainer import join_groups
from .metrics import CommMeter, MetricsLogger
from .straggler import Straggler
from .tasks import get_task

__all__ = ["CoCoATrainer", "local_sdca", "primal_dual", "solve_coordinate"]


def solve_coordinate(m: float, q: float, b: float) -> float:
    """argmax over b' in (0, 1) of H(b') - m (b' - b) - q/2 (b' - b)^2, for q >= 0.

    With b' = sigmoid(z) the optimality condition is g(z) = z + m + q (sigmoid(z) - b) = 0;
    g is increasing (g' in [1, 1 + q/4]) with its root in [-m - q (1 - b), -m + q b]:
    Newton steps, bisection where a step would leave the bracket.
    """
    lo, hi = -m - q * (1.0 - b), -m + q * b
    z = min(max(math.log(b / (1.0 - b)) if 0.0 < b < 1.0 else -m, lo), hi)
    for _ in range(60):
        s = 1.0 / (1.0 + math.exp(-z)) if z > -700.0 else 0.0
        g = z + m + q * (s - b)
        if g > 0.0:
            hi = z
        else:
            lo = z
        step = g / (1.0 + q * s * (1.0 - s))
        new = z - step
        if not lo <= new <= hi:
            new = 0.5 * (lo + hi)
        if abs(new - z) <= 1e-12 * (1.0 + abs(z)):
            z = new
            break
        z = new
    return 1.0 / (1.0 + math.exp(-z)) if z > -700.0 else 0.0


def local_sdca(x: np.ndarray, y: np.ndarray, beta: np.ndarray, w: np.ndarray, lam: float, n: int,
               sigma: float, order: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
    """SDCA on one rank's subproblem G_k^sigma: coordinates ``order`` (indices into ``x``) in turn.

    Returns (d_beta, dw) with dw = 1/(lambda n) sum_i y_i d_beta_i x_i; ``beta`` and ``w`` are
    not changed.
    """
    d_beta = np.zeros_like(beta)
    dw = np.zeros_like(w)
    scale = 1.0 / (lam * n)
    sq_norms = np.einsum("ij,ij->i", x, x)
    for i in order.tolist():
        xi = x[i]
        yi = float(y[i])
        b = float(beta[i] + d_beta[i])
        m = yi * float(xi @ (w + sigma * dw))
        b_new = solve_coordinate(m, sigma * float(sq_norms[i]) * scale, b)
        delta = b_new - b
        if delta != 0.0:
            d_beta[i] += delta
            dw += (yi * delta * scale) * xi
    return d_beta, dw


def _entropy(b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(b * np.log(b) + (1.0 - b) * np.log1p(-b))
    return np.nan_to_num(h, nan=0.0)


def primal_dual(x: np.ndarray, y: np.ndarray, beta: np.ndarray, w: np.ndarray) -> "tuple[float, float]":
    """(sum of the logistic losses at w, sum of the entropies H(b_i)) over the given samples."""
    loss = float(np.logaddexp(0.0, -y * (x @ w)).sum())
    return loss, float(_entropy(np.clip(beta, 0.0, 1.0)).sum())


class CoCoATrainer:
    """CoCoA+ on ``digits-logreg``; ``fit()`` runs ``cfg.steps`` rounds (collective).

    Rank k holds the samples k, k + K, ... of the training set and their dual variables;
    w is replicated (identical on every rank after each round).
    """

    def __init__(self, cfg: TrainConfig, process_group=None, control_group=None):
        if cfg.strategy != "cocoa":
            raise ValueError(f"{_PREFIX} CoCoATrainer runs strategy cocoa (got {cfg.strategy!r})")
        join_groups(self, cfg, process_group, control_group)
        self.task = get_task(cfg.task)
        x = self.task.x_train.double().numpy()
        y = self.task.y_train.double().numpy()
        self.n = x.shape[0]
        self.x = np.ascontiguousarray(x[self.rank::self.world_size])
        self.y = np.ascontiguousarray(y[self.rank::self.world_size])
        self.lam = float(cfg.cocoa_lambda)
        self.gamma = float(cfg.cocoa_gamma)
        self.sigma = self.gamma * self.world_size
        self.beta = np.zeros(self.x.shape[0])
        self.w = np.zeros(x.shape[1])
        self.local_steps = max(1, int(round(cfg.cocoa_local_passes * self.x.shape[0])))
        self.rounds = cfg.steps
        self.round = 0
        self.elapsed_s = 0.0
        self.resumed_from: Optional[str] = None
        self.meter = CommMeter(self.backend == "pycomm")
        self.straggler = Straggler(cfg.straggler, self.rank, self.world_size)
        self.logger = MetricsLogger(cfg.log_file, self.rank == 0, cfg.progress, self.rounds)

    def _order(self) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, self.rank, self.round])
        count = self.x.shape[0]
        passes = -(-self.local_steps // count)
        return np.concatenate([rng.permutation(count) for _ in range(passes)])[: self.local_steps]

    def _gap(self, extra: Optional[np.ndarray] = None) -> "tuple[float, float, np.ndarray]":
        """Collective: (primal, dual); ``extra`` is all-reduced in the same call and returned summed."""
        loss, entropy = primal_dual(self.x, self.y, self.beta, self.w)
        extra = np.zeros(0) if extra is None else extra
        buffer = torch.from_numpy(np.concatenate([extra, [loss, entropy]]))
        dist.all_reduce(buffer, group=self.group)
        summed = buffer.numpy()
        return summed[-2], summed[-1], summed[:-2]

    def _objectives(self, loss_sum: float, entropy_sum: float) -> "tuple[float, float]":
        reg = 0.5 * self.lam * float(self.w @ self.w)
        return loss_sum / self.n + reg, entropy_sum / self.n - reg

    def fit(self) -> Dict[str, Any]:
        cfg = self.cfg
        self.logger.log({"event": "start", "config": cfg.to_dict(), "world_size": self.world_size,
                         "backend": self.backend, "total_steps": self.rounds, "run_name": cfg.run_name,
                         "train_samples": self.n, "sigma_prime": self.sigma,
                         "local_steps": self.local_steps})
        loss_sum, entropy_sum, _ = self._gap()
        primal, dual = self._objectives(loss_sum, entropy_sum)
        history: List[Dict[str, float]] = [{"round": 0, "primal": primal, "dual": dual, "gap": primal - dual}]
        bytes_sent = 0
        evals: List[Dict[str, Any]] = []
        self.meter.delta()
        try:
            while self.round < self.rounds:
                start = time.perf_counter()
                d_beta, dw = local_sdca(self.x, self.y, self.beta, self.w, self.lam, self.n, self.sigma,
                                        self._order())
                compute_s = time.perf_counter() - start
                self.straggler.delay(compute_s)
                # aggregate the primal updates: w += gamma sum_k dw_k (one all-reduce)
                buffer = torch.from_numpy(dw.copy())
                dist.all_reduce(buffer, group=self.group)
                self.w = self.w + self.gamma * buffer.numpy()
                self.beta = self.beta + self.gamma * d_beta
                self.round += 1
                loss_sum, entropy_sum, _ = self._gap()
                primal, dual = self._objectives(loss_sum, entropy_sum)
                step_s = time.perf_counter() - start
                self.elapsed_s += step_s
                comm = self.meter.delta()
                bytes_sent += comm["bytes_sent"]
                history.append({"round": self.round, "primal": primal, "dual": dual, "gap": primal - dual})
                self.logger.log({
                    "event": "step", "step": self.round, "epoch": 0, "loss": primal, "primal": primal,
                    "dual": dual, "duality_gap": primal - dual, "lr": 0.0,
                    "samples_per_s": self.local_steps * self.world_size / step_s, "step_s": step_s,
                    "comm_s": comm["comm_s"], "compute_s": compute_s, "bytes_sent": comm["bytes_sent"],
                    "elapsed_s": self.elapsed_s,
                })
                if cfg.eval_every and self.round % cfg.eval_every == 0 and self.round < self.rounds:
                    evals.append(self.evaluate())  # off the clock, and without communication
                    self.logger.log(evals[-1])
            final = self.evaluate()
            self.logger.log(final)
            evals.append(final)
            result: Dict[str, Any] = {
                "losses": [(h["round"], h["primal"]) for h in history[1:]], "evals": evals,
                "step": self.round, "bytes_sent": bytes_sent, "wall_s": self.elapsed_s, "final": final,
                "worker_distance": None, "params": torch.from_numpy(self.w.copy()).float(),
                "duality_gap": history, "weights": self.w.copy(),
            }
            self.logger.log({"event": "end", "step": self.round, "wall_s": self.elapsed_s,
                             "test_accuracy": final["test_accuracy"], "test_loss": final["test_loss"],
                             "bytes_sent_rank0": bytes_sent, "world_size": self.world_size,
                             "strategy": cfg.strategy, "hook": None, "run_name": cfg.run_name,
                             "primal": history[-1]["primal"], "dual": history[-1]["dual"],
                             "duality_gap": history[-1]["gap"], "initial_duality_gap": history[0]["gap"]})
            return result
        finally:
            self.logger.close()

    def evaluate(self) -> Dict[str, Any]:
        """Test loss / accuracy of w (every rank holds it; no communication)."""
        x = self.task.x_test.double().numpy()
        y = self.task.y_test.double().numpy()
        margin = y * (x @ self.w)
        return {"event": "eval", "step": self.round, "test_loss": float(np.logaddexp(0.0, -margin).mean()),
                "test_accuracy": float((margin > 0).mean()), "elapsed_s": self.elapsed_s}


def _validate(cfg, bad) -> None:
    check_own_loop(cfg, bad)
    if cfg.task != "digits-logreg":
        raise bad(f"strategy cocoa solves the convex task digits-logreg (got task {cfg.task!r})")
    if cfg.epochs is not None:
        raise bad("strategy cocoa counts communication rounds with steps, not epochs")


register_strategy(StrategySpec("cocoa", trainer=CoCoATrainer, validate=_validate))
