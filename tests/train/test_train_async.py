"""pycomm.train's strategies with loops of their own: async_ps (parameter server, bounded
staleness) and cocoa (CoCoA+ on digits-logreg).

One 3-rank run (tests/mp_util.py, hard timeout) does all the multi-process work of the
module; the tests read its results. A second short run checks that a worker that
finishes long before the others is not caught by the process-group timeout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from mp_util import run_multiprocess

from pycomm.train import AsyncPSTrainer, CoCoATrainer, ConfigError, TrainConfig, cli, tasks
from pycomm.train.async_ps import lease_feasible
from pycomm.train.cocoa import solve_coordinate
from pycomm.train.strategies import flat_parameters

RUN_TIMEOUT_S = 150
PS = dict(task="digits-mlp", strategy="async_ps", batch_size=32, lr=0.05, momentum=0.9, schedule="constant",
          progress=False, seed=5)
COCOA = dict(task="digits-logreg", strategy="cocoa", cocoa_lambda=1e-2, steps=25, progress=False, seed=1)


def _ps(ctx, group=None, control=None, **changes):
    cfg = TrainConfig.from_dict({**PS, **{k: v for k, v in changes.items() if k not in ("worker_steps",
                                                                                       "worker_delay_s")}})
    trainer = AsyncPSTrainer(cfg, group, control if control is not None else ctx.ref,
                             worker_steps=changes.get("worker_steps"), worker_delay_s=changes.get("worker_delay_s"))
    result = trainer.fit()
    return {"params": result["params"], "losses": [loss for _, loss in result["losses"]],
            "acc": result["final"]["test_accuracy"], "staleness": result["staleness"], "step": result["step"],
            "evals": result["evals"], "slept_s": trainer.straggler.slept_s}


def _cocoa(ctx, **changes):
    trainer = CoCoATrainer(TrainConfig.from_dict({**COCOA, **changes}), control_group=ctx.ref)
    result = trainer.fit()
    return {"gap": result["duality_gap"], "w": result["weights"], "acc": result["final"]["test_accuracy"],
            "evals": result["evals"], "slept_s": trainer.straggler.slept_s}


def _worker(ctx):
    out = {}
    # 1 server + 1 worker on a sub-group of ranks 0 and 1 (rank 2 sits it out)
    ctx.progress("async_ps 1 server + 1 worker, S=0")
    pair = dist.new_group([0, 1])
    pair_control = dist.new_group([0, 1], backend="gloo")
    if ctx.rank < 2:
        out["one_one"] = _ps(ctx, pair, pair_control, servers=1, steps=30, eval_every=10)
    ctx.progress("async_ps 2 servers + 1 worker, S=0")
    out["two_one"] = _ps(ctx, servers=2, steps=30, optimizer="sgd", weight_decay=1e-3)
    ctx.progress("async_ps 2 servers + 1 worker, S=0, over gloo")
    out["two_one_gloo"] = _ps(ctx, ctx.ref, ctx.ref, servers=2, steps=30, optimizer="sgd", weight_decay=1e-3)
    ctx.progress("async_ps 1 server + 2 workers, S=0")
    out["s0"] = _ps(ctx, servers=1, steps=40)
    ctx.progress("async_ps 1 server + 2 workers, S=1, unequal steps, one slow worker")
    out["s1"] = _ps(ctx, servers=1, max_staleness=1, worker_steps=[70, 25], worker_delay_s=[0.0, 0.01],
                    straggler="2:3")
    ctx.progress("async_ps 1 server + 2 workers, S=3, AdamW")
    out["s3"] = _ps(ctx, servers=1, max_staleness=3, steps=40, optimizer="adamw", lr=0.003,
                    worker_delay_s=[0.005, 0.0])
    ctx.progress("async_ps with too many servers")
    try:
        AsyncPSTrainer(TrainConfig.from_dict({**PS, "servers": 3}), control_group=ctx.ref)
    except ValueError as exc:
        out["too_many_servers"] = str(exc)
    try:
        AsyncPSTrainer(TrainConfig.from_dict({**PS, "straggler": "0:2"}), control_group=ctx.ref)
    except ValueError as exc:
        out["straggler_server"] = str(exc)
    ctx.progress("cocoa gamma=1")
    out["cocoa_add"] = _cocoa(ctx)
    ctx.progress("cocoa gamma=1/3, evaluated every 5 rounds, rank 1 a straggler")
    out["cocoa_avg"] = _cocoa(ctx, cocoa_gamma=1 / 3, eval_every=5, straggler="1:2")
    return out


@pytest.fixture(scope="module")
def results():
    return run_multiprocess(_worker, 3, timeout_s=RUN_TIMEOUT_S)


def _reference_sgd(steps, weight_decay=0.0):
    """Plain single-process SGD on the batches one async_ps worker sees."""
    cfg = TrainConfig.from_dict({**PS, "steps": steps, "weight_decay": weight_decay})
    task = tasks.get_task(cfg.task)
    model = task.make_model(cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=weight_decay)
    sampler = DistributedSampler(range(task.x_train.shape[0]), num_replicas=1, rank=0, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    per_epoch = len(sampler) // cfg.batch_size
    epoch, micro, order = 0, 0, None
    for _ in range(steps):
        if micro + 1 > per_epoch:
            epoch, micro, order = epoch + 1, 0, None
        if order is None:
            sampler.set_epoch(epoch)
            order = list(iter(sampler))
        index = torch.tensor(order[micro * cfg.batch_size: (micro + 1) * cfg.batch_size])
        micro += 1
        optimizer.zero_grad()
        task.loss(model(task.x_train[index]), task.y_train[index]).backward()
        optimizer.step()
    return flat_parameters(model)


def test_async_ps_one_worker_is_plain_sgd(results):
    reference = _reference_sgd(30)
    for rank in (0, 1):
        params = results[rank]["one_one"]["params"]
        assert torch.allclose(params, reference, rtol=0, atol=1e-5), float((params - reference).abs().max())
    assert results[0]["one_one"]["staleness"]["histogram"] == {0: 30}
    # parameters sharded over two servers: the same numbers (weight decay applied per shard)
    reference = _reference_sgd(30, weight_decay=1e-3)
    params = results[2]["two_one"]["params"]
    assert torch.allclose(params, reference, rtol=0, atol=1e-5), float((params - reference).abs().max())
    for rank in range(3):  # every rank ends with the same model and summary
        assert torch.equal(results[rank]["two_one"]["params"], params)
        assert results[rank]["two_one"]["staleness"] == results[0]["two_one"]["staleness"]
    # the same protocol over gloo's send / recv (which does not buffer sends) gives the same numbers
    assert torch.equal(results[2]["two_one_gloo"]["params"], params)


def test_async_ps_evaluates_the_parameters_of_each_version(results):
    """--eval-every 10: the models the server held at versions 10 and 20 are evaluated after
    training, and score what plain SGD's models after 10 and 20 steps score."""
    task = tasks.get_task(PS["task"])
    evals = results[0]["one_one"]["evals"]
    assert [e["step"] for e in evals] == [10, 20, 30]
    for record in evals:
        model = task.make_model(PS["seed"])
        torch.nn.utils.vector_to_parameters(_reference_sgd(record["step"]), model.parameters())
        model.eval()
        with torch.no_grad():
            loss, correct, count = task.score(model(task.x_test), task.y_test)
        assert record["test_accuracy"] == pytest.approx(correct / count, abs=1.5 / count), record
        assert record["test_loss"] == pytest.approx(loss / count, rel=1e-4), record
    clocks = [e["elapsed_s"] for e in evals]
    assert 0 < clocks[0] < clocks[1] < clocks[2], clocks
    assert results[1]["one_one"]["evals"][:-1] == evals[:-1]  # the same records on every rank (the final
    # one carries each rank's own clock)


def _went_down(losses, factor=0.5):
    return sum(losses[-8:]) / 8 < factor * sum(losses[:8]) / 8


def test_async_ps_converges_within_the_staleness_bound(results):
    r0 = results[0]
    for run, bound, updates in (("s0", 0, 80), ("s1", 1, 95), ("s3", 3, 80)):
        stale = r0[run]["staleness"]
        assert stale["bound"] == bound and stale["max"] <= bound, (run, stale)
        assert stale["updates"] == updates == sum(stale["histogram"].values()) == r0[run]["step"], (run, stale)
        assert len(r0[run]["losses"]) == updates
        assert _went_down(r0[run]["losses"]), (run, r0[run]["losses"])
        assert r0[run]["acc"] > 0.85, (run, r0[run]["acc"])
    # S=0 is sequential: no gradient is ever stale; with S>0 and a slow worker some are
    assert r0["s0"]["staleness"]["histogram"] == {0: 80}
    assert r0["s1"]["staleness"]["max"] == 1 and r0["s1"]["staleness"]["mean"] > 0
    # --straggler 2:3 slows worker rank 2 alone
    assert results[2]["s1"]["slept_s"] > 0 and results[0]["s1"]["slept_s"] == results[1]["s1"]["slept_s"] == 0


def test_async_ps_errors(results):
    assert results[0]["too_many_servers"].startswith(
        "pycomm train: strategy async_ps with 3 server(s) needs at least 4 ranks (got 3)")
    assert results[0]["straggler_server"].startswith(
        "pycomm train: strategy async_ps: the straggler must be a worker, one of ranks 1..2")


def test_lease_feasible():
    assert lease_feasible([], 7, 0)
    assert lease_feasible([5], 5, 0) and not lease_feasible([5], 6, 0)
    assert lease_feasible([3, 4], 4, 1) and not lease_feasible([4, 4], 4, 0)
    assert lease_feasible([2, 4], 4, 2)      # version 2 applied at 4, version 4 at 5
    assert not lease_feasible([2, 2], 4, 2)  # the second lease of version 2 would be applied at 5


def _reference_logreg(lam):
    """min_w 1/n sum log(1 + exp(-y x.w)) + lambda/2 |w|^2 by full-batch L-BFGS in float64."""
    task = tasks.get_task("digits-logreg")
    x, y = task.x_train.double(), task.y_train.double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                                  history_size=20, line_search_fn="strong_wolfe")

    def objective():
        optimizer.zero_grad()
        value = torch.nn.functional.softplus(-y * (x @ w)).mean() + 0.5 * lam * (w @ w)
        value.backward()
        return value

    for _ in range(3):
        optimizer.step(objective)
    return float(objective().detach())


def test_cocoa_duality_gap_and_solution(results):
    reference = _reference_logreg(COCOA["cocoa_lambda"])
    for run in ("cocoa_add", "cocoa_avg"):
        gaps = results[0][run]["gap"]
        assert [g["round"] for g in gaps] == list(range(26))
        assert gaps[0]["gap"] == pytest.approx(math.log(2))  # w = 0, all dual variables 0
        duals = [g["dual"] for g in gaps]
        # sigma' = gamma K is safe: the dual objective never decreases
        assert all(b >= a - 1e-12 for a, b in zip(duals, duals[1:])), (run, duals)
        assert all(g["gap"] >= -1e-12 for g in gaps), run
        final = gaps[-1]
        # the gap certifies the primal: P(w) - P* <= gap
        assert -1e-9 <= final["primal"] - reference <= final["gap"] + 1e-9, (run, final, reference)
        for rank in (1, 2):  # w is replicated
            assert (results[rank][run]["w"] == results[0][run]["w"]).all()
        assert final["gap"] < 1e-2 * gaps[0]["gap"], (run, final)
        assert abs(final["primal"] - reference) < 2e-3, (run, final, reference)
    assert results[0]["cocoa_add"]["acc"] > 0.8
    # --eval-every 5 (rounds 5..20, then the final model at 25); --straggler 1:2 slows rank 1 alone
    evals = results[0]["cocoa_avg"]["evals"]
    assert [e["step"] for e in evals] == [5, 10, 15, 20, 25]
    assert evals[-1]["test_accuracy"] == results[0]["cocoa_avg"]["acc"]
    assert [e["elapsed_s"] for e in evals] == sorted(e["elapsed_s"] for e in evals)
    assert results[1]["cocoa_avg"]["slept_s"] > 0 and results[0]["cocoa_avg"]["slept_s"] == 0


def test_solve_coordinate():
    for m, q, b in ((0.0, 0.0, 0.5), (3.0, 10.0, 0.2), (-40.0, 500.0, 0.999), (12.0, 0.0, 0.0), (-2.0, 1e4, 1.0)):
        best = solve_coordinate(m, q, b)
        assert 0.0 <= best <= 1.0

        def value(t):
            h = -sum(v * math.log(v) for v in (t, 1 - t) if v > 0)
            return h - m * (t - b) - 0.5 * q * (t - b) ** 2

        for other in (best * 0.999, best + (1 - best) * 0.001, 1e-9, 1 - 1e-9, 0.5):
            assert value(best) >= value(other) - 1e-9, (m, q, b, best, other)
    assert solve_coordinate(0.0, 0.0, 0.3) == pytest.approx(0.5)


@pytest.mark.parametrize("values, match", [
    ({"strategy": "async_ps", "servers": 0}, "servers must be at least 1"),
    ({"strategy": "async_ps", "max_staleness": -1}, "max_staleness must be >= 0"),
    ({"strategy": "async_ps", "checkpoint_dir": "ckpt"}, "async_ps does not support checkpoint_dir"),
    ({"strategy": "async_ps", "fail_at_step": 5}, "async_ps does not support fail_at_step"),
    ({"strategy": "cocoa"}, "cocoa solves the convex task digits-logreg"),
    ({"strategy": "cocoa", "task": "digits-logreg", "cocoa_gamma": 0}, r"cocoa_gamma must be in \(0, 1\]"),
    ({"strategy": "cocoa", "task": "digits-logreg", "cocoa_gamma": 1.5}, "cocoa_gamma"),
    ({"strategy": "cocoa", "task": "digits-logreg", "cocoa_lambda": 0}, "cocoa_lambda must be positive"),
    ({"strategy": "cocoa", "task": "digits-logreg", "epochs": 2}, "counts communication rounds with steps"),
])
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match="^pycomm train: .*" + match):
        TrainConfig.from_dict(values)


def test_cli_usage_errors(capsys):
    assert cli.main(["--strategy", "cocoa", "--task", "digits-mlp"]) == 2
    assert "pycomm train: strategy cocoa solves the convex task digits-logreg" in capsys.readouterr().err
    assert cli.main(["--strategy", "async_ps", "--max-staleness", "-2"]) == 2
    assert "max_staleness must be >= 0" in capsys.readouterr().err


def _early_finisher(ctx):
    # worker 1 does 2 steps and then waits ~10 s for worker 0, longer than the 6 s process-group
    # timeout: it must wait without a timed receive
    return _ps(ctx, servers=1, max_staleness=1, worker_steps=[50, 2], worker_delay_s=[0.2, 0.0])["staleness"]


def test_async_ps_early_finisher_outlives_the_timeout():
    results = run_multiprocess(_early_finisher, 3, timeout_s=90, pg_timeout_s=6.0)
    assert results[2]["updates"] == 52 and results[2]["max"] <= 1


def test_cli_runs_both(tmp_path, monkeypatch, capfd):
    """pycomm-train end to end: the summary lines and the JSON-lines records of both strategies.
    Its main() runs here (mp_util.run_main_here); the ranks fork from pycomm.launch's server."""
    import json

    from mp_util import run_main_here

    from pycomm.train import cli

    runs = {
        "ps": ["-n", "3", "--strategy", "async_ps", "--max-staleness", "1", "--steps", "20"],
        "cocoa": ["-n", "2", "--task", "digits-logreg", "--strategy", "cocoa", "--steps", "8"],
    }
    for name, args in runs.items():
        log = tmp_path / f"{name}.jsonl"
        proc = run_main_here(cli.main, [*args, "--no-progress", "--log-file", str(log)], cwd=tmp_path,
                             monkeypatch=monkeypatch, capfd=capfd, timeout_s=120, name="pycomm.train")
        assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
        records = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [r for r in records if r["event"] == "step"]
        end = records[-1]
        assert end["event"] == "end"
        if name == "ps":
            assert "staleness (bound 1): mean" in proc.stdout, proc.stdout
            assert [r["step"] for r in steps] == list(range(1, 41))
            assert all(0 <= r["staleness"] <= 1 for r in steps) and end["staleness"]["updates"] == 40
        else:
            assert "duality gap: 6.931e-01 at round 0" in proc.stdout, proc.stdout
            assert [r["step"] for r in steps] == list(range(1, 9))
            assert steps[-1]["duality_gap"] < steps[0]["duality_gap"] and end["duality_gap"] == steps[-1]["duality_gap"]
