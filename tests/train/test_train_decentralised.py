"""Decentralised and federated strategies of pycomm.train: gossip (D-PSGD), fedavg,
hogwild, and straggler injection.

References where one exists (gossip on 2 ranks and fedavg with full participation and
one full-batch step per round are synchronous SGD; one Hogwild! worker is plain SGD),
convergence against sync in the same steps otherwise. Multi-process checks run
through tests/mp_util.py (hard timeouts), several trainings per spawned run.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import threading

import pytest
import torch

from mp_util import run_multiprocess

from pycomm.train import ConfigError, TrainConfig, Trainer, cli
from pycomm.train import fedavg, gossip, hogwild, straggler

from test_train import BASE, RUN_TIMEOUT_S, _cfg  # the same small digits runs


def _fit(ctx, **changes):
    trainer = Trainer(_cfg(**changes), control_group=ctx.ref)
    result = trainer.fit()
    return {"losses": [loss for _, loss in result["losses"]], "acc": result["final"]["test_accuracy"],
            "params": result["params"], "local": result["local_params"], "wall_s": result["wall_s"],
            "summary": result["strategy_summary"], "slept_s": trainer.straggler.slept_s,
            "straggler_compute_s": trainer.straggler.compute_s}


def _close(a, b, atol=1e-5):
    return torch.allclose(a, b, rtol=0, atol=atol), float((a - b).abs().max())


# ---------------------------------------------------------------------------
# 2 ranks: references, partial participation, non-IID, straggler
# ---------------------------------------------------------------------------

FULL_BATCH = dict(batch_size=750, steps=8, momentum=0.0, lr=0.2)  # 1500 samples / 2 ranks


def _two_ranks_worker(ctx):
    out = {}
    ctx.progress("sync")
    out["sync"] = _fit(ctx, steps=60)
    ctx.progress("gossip ring")
    out["gossip"] = _fit(ctx, steps=60, strategy="gossip", consensus_every=20)
    ctx.progress("sync full batch")
    out["sync_gd"] = _fit(ctx, **FULL_BATCH)
    ctx.progress("fedavg full batch")
    out["fedavg_gd"] = _fit(ctx, strategy="fedavg", **FULL_BATCH)
    ctx.progress("fedavg non-IID")
    out["fedavg_noniid"] = _fit(ctx, steps=60, strategy="fedavg", noniid=0.5, batch_size=64)  # 11-step rounds
    ctx.progress("fedavg half participation")
    out["fedavg_half"] = _fit(ctx, steps=60, strategy="fedavg", participation=0.5, batch_size=125)
    ctx.progress("straggler")
    out["straggler"] = _fit(ctx, steps=30, straggler="1:5")
    # fedavg stopped mid-round (step 10 of 6-step rounds), checkpointed, resumed by a new trainer
    ctx.progress("fedavg resume")
    run = dict(steps=20, strategy="fedavg", participation=0.5, noniid=0.5, batch_size=125)
    directory = os.path.join(ctx.tmpdir, "fedavg_ckpt")
    first = Trainer(_cfg(checkpoint_dir=directory, **run), control_group=ctx.ref)
    head = first.fit(max_steps=10)
    first.save_checkpoint()
    tail = Trainer(_cfg(checkpoint_dir=directory, resume="auto", **run), control_group=ctx.ref).fit()
    out["fedavg_resumed"] = {"losses": [l for _, l in head["losses"] + tail["losses"]], "local": tail["local_params"],
                             "params": tail["params"], "summary": tail["strategy_summary"]}
    out["fedavg_straight"] = _fit(ctx, **run)
    return out


def test_decentralised_two_ranks():
    results = run_multiprocess(_two_ranks_worker, 2, timeout_s=RUN_TIMEOUT_S)
    r0, r1 = results

    # gossip on 2 ranks mixes with weights 1/2, 1/2: model averaging after every local step,
    # which is synchronous SGD (parameters are linear in the averaged gradients)
    ok, err = _close(r0["gossip"]["params"], r0["sync"]["params"])
    assert ok, err
    assert torch.allclose(torch.tensor(r0["gossip"]["losses"]), torch.tensor(r0["sync"]["losses"]), atol=1e-5)
    summary = r0["gossip"]["summary"]
    assert [step for step, _ in summary["consensus_distance"]] == [20, 40, 60]
    assert summary["neighbours"] == 1 and summary["consensus_distance_max"] < 1e-5, summary

    # fedavg, participation 1, one full-batch step per round == synchronous full-batch GD
    assert r0["fedavg_gd"]["summary"]["round_steps"] == 1 and r0["fedavg_gd"]["summary"]["rounds"] == 8
    ok, err = _close(r0["fedavg_gd"]["params"], r0["sync_gd"]["params"])
    assert ok, err
    ok, err = _close(r0["fedavg_gd"]["local"], r1["fedavg_gd"]["local"], atol=0)
    assert ok, err  # every rank continues from the same global model

    # non-IID (Dirichlet 0.5): unequal shards that cover the training set; within a few
    # points of sync in the same steps (5 rounds of 11 steps and a shorter one)
    noniid = r0["fedavg_noniid"]["summary"]
    assert sum(noniid["shard_sizes"]) == 1500 and len(set(noniid["shard_sizes"])) == 2, noniid
    assert noniid["rounds"] == 6 and noniid["round_steps"] == 11, noniid
    assert r0["fedavg_noniid"]["acc"] > r0["sync"]["acc"] - 0.05, (r0["fedavg_noniid"]["acc"], r0["sync"]["acc"])

    # participation 0.5 on 2 ranks: one seeded participant per round, the same on both ranks;
    # the non-participant takes the new global model
    half = r0["fedavg_half"]["summary"]
    assert half["participants"] == r1["fedavg_half"]["summary"]["participants"]
    assert half["rounds"] == 10 and all(len(p) == 1 for p in half["participants"]), half
    assert {p[0] for p in half["participants"]} == {0, 1}, half
    assert torch.equal(r0["fedavg_half"]["local"], r1["fedavg_half"]["local"])
    assert r0["fedavg_half"]["acc"] > 0.8, r0["fedavg_half"]["acc"]

    # straggler 1:5: rank 1 slept 4x its own compute; rank 0 did not sleep but waited for it
    assert r0["straggler"]["slept_s"] == 0.0
    slept, compute = r1["straggler"]["slept_s"], r1["straggler"]["straggler_compute_s"]
    assert 3.99 * compute <= slept <= 4.0 * compute + 30 * 0.1, (slept, compute)  # sleep overshoots a little
    # rank 0 waited out rank 1's sleeps (each delays rank 1's next all-reduce; the last one
    # is not waited for, hence 0.9): figures of the same run (comparing with the sync
    # run's wall time added that run's noise)
    assert r0["straggler"]["wall_s"] >= 0.9 * slept, (r0["straggler"]["wall_s"], slept)
    assert r0["straggler"]["losses"] == r0["sync"]["losses"][:30]  # slower, not different

    # fedavg resumed mid-round continues exactly (shards, participants, global model, RNG)
    for r in results:
        assert r["fedavg_resumed"]["losses"] == r["fedavg_straight"]["losses"]
        assert torch.equal(r["fedavg_resumed"]["local"], r["fedavg_straight"]["local"])
        assert torch.equal(r["fedavg_resumed"]["params"], r["fedavg_straight"]["params"])
        assert r["fedavg_resumed"]["summary"] == r["fedavg_straight"]["summary"]


# ---------------------------------------------------------------------------
# 4 ranks: gossip on a ring (not complete) and on the exponential graph (complete on 4)
# ---------------------------------------------------------------------------

def _four_ranks_worker(ctx):
    out = {}
    # exp on 4 ranks is the complete graph: model averaging every step, i.e. sync SGD
    for name, changes in (("ring", dict(strategy="gossip", topology="ring")),
                          ("exp", dict(strategy="gossip", topology="exp"))):
        ctx.progress(name)
        out[name] = _fit(ctx, steps=60, consensus_every=10, **changes)
    return out


def test_gossip_four_ranks():
    results = run_multiprocess(_four_ranks_worker, 4, timeout_s=RUN_TIMEOUT_S)
    r0 = results[0]
    ring, exp = r0["ring"]["summary"], r0["exp"]["summary"]
    assert ring["neighbours"] == 2 and exp["neighbours"] == 3
    # the ring leaves the replicas apart (but close); the complete graph averages them exactly
    assert min(d for _, d in ring["consensus_distance"]) > 1e-4, ring
    assert exp["consensus_distance_max"] < 1e-4, exp
    assert ring["consensus_distance_max"] < 0.05 * float(r0["ring"]["params"].norm()), ring
    for rank in range(4):  # every rank reports the same figures
        assert results[rank]["ring"]["summary"]["consensus_distance"] == ring["consensus_distance"]
    # convergence: the ring within a few points of sync (= exp here) in the same steps
    assert r0["exp"]["acc"] > 0.85, r0["exp"]["acc"]
    assert r0["ring"]["acc"] > r0["exp"]["acc"] - 0.05, (r0["ring"]["acc"], r0["exp"]["acc"])


# ---------------------------------------------------------------------------
# Hogwild!
# ---------------------------------------------------------------------------

def test_hogwild_one_worker_is_sgd():
    """The worker loop, run here on one worker: plain SGD on the shared model, same data order;
    with --eval-every 10 it keeps the shared model of steps 10 and 20 for evaluation."""
    cfg = _cfg(strategy="hogwild", steps=30, eval_every=10)
    task = hogwild.get_task(cfg.task)
    shared = task.make_model(cfg.seed)
    shared.share_memory()
    reader, writer = multiprocessing.Pipe(duplex=False)
    threads = torch.get_num_threads()
    received = []  # read while the worker writes: its report (with model copies) outgrows the pipe
    thread = threading.Thread(target=lambda: received.append(reader.recv()), daemon=True)
    thread.start()
    try:
        hogwild._worker(0, 1, cfg, shared, threads, writer)
    finally:
        torch.set_num_threads(threads)
    thread.join(timeout=60)
    kind, _, payload = received[0]
    assert kind == "ok", payload

    reference = task.make_model(cfg.seed)
    optimizer = torch.optim.SGD(reference.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    steps_per_epoch = task.x_train.shape[0] // cfg.batch_size
    kept = {}
    for step in range(cfg.steps):
        epoch, position = divmod(step, steps_per_epoch)
        order = hogwild.hogwild_order(task.x_train.shape[0], 0, 1, cfg.seed, epoch)
        index = torch.tensor(order[position * cfg.batch_size: (position + 1) * cfg.batch_size])
        optimizer.zero_grad()
        task.loss(reference(task.x_train[index]), task.y_train[index]).backward()
        optimizer.step()
        kept[step + 1] = [p.detach().clone() for p in reference.parameters()]
    for mine, theirs in zip(shared.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    assert len(payload["records"]) == 30
    assert [step for step, _, _ in payload["snapshots"]] == [10, 20]
    for step, elapsed, params in payload["snapshots"]:
        assert elapsed == payload["records"][step - 1]["elapsed_s"]
        assert all(torch.equal(torch.from_numpy(mine), theirs) for mine, theirs in zip(params, kept[step]))


def test_hogwild_two_workers():
    summary = hogwild.run_hogwild(_cfg(strategy="hogwild", steps=60, eval_every=20), nprocs=2,
                                  timeout_s=RUN_TIMEOUT_S)
    assert summary["strategy_summary"]["updates"] == 120 and summary["steps"] == 60
    # worker 0's copies of the shared model at its steps 20 and 40 came back from its process
    assert [e["step"] for e in summary["evals"]] == [20, 40, 60]
    assert summary["evals"][0]["test_accuracy"] > 0.3 and summary["evals"][-1] == summary["final"]
    assert summary["final"]["test_accuracy"] > 0.85, summary["final"]
    # both workers trained the one shared model, starting together from the untrained one
    for worker in (0, 1):
        losses = summary["workers"][worker]["losses"]
        assert losses[0] > 1.5, (worker, losses[:5])
        assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), (worker, losses)


# ---------------------------------------------------------------------------
# in-process pieces
# ---------------------------------------------------------------------------

def test_dirichlet_split_is_deterministic_and_exact():
    labels = hogwild.get_task("digits-mlp").y_train
    for world in (2, 3, 4):
        for alpha in (0.1, 1.0, 100.0):
            parts = fedavg.dirichlet_split(labels, world, alpha, seed=5)
            again = fedavg.dirichlet_split(labels, world, alpha, seed=5)
            assert all(torch.equal(a, b) for a, b in zip(parts, again))
            merged = torch.cat(parts)
            assert merged.numel() == labels.numel() and torch.equal(merged.sort().values,
                                                                    torch.arange(labels.numel()))
            assert min(p.numel() for p in parts) >= 1
    other = fedavg.dirichlet_split(labels, 2, 0.1, seed=6)
    assert not torch.equal(other[0], fedavg.dirichlet_split(labels, 2, 0.1, seed=5)[0])

    def skew(alpha):  # mean over ranks of the share of the rank's most frequent label
        parts = fedavg.dirichlet_split(labels, 4, alpha, seed=1)
        return sum(collections.Counter(labels[p].tolist()).most_common(1)[0][1] / p.numel()
                   for p in parts) / 4
    assert skew(0.1) > 0.4 > 0.15 > skew(100.0)
    with pytest.raises(ValueError, match="^pycomm train: noniid needs one label per sample"):
        fedavg.dirichlet_split(torch.zeros(10, 3, dtype=torch.int64), 2, 1.0, 0)
    iid = fedavg.iid_split(1500, 4, seed=2)
    assert [p.numel() for p in iid] == [375] * 4 and torch.cat(iid).unique().numel() == 1500


def test_participants_and_sampler():
    for world in (2, 5, 8):
        for fraction in (0.01, 0.3, 0.5, 1.0):
            chosen = fedavg.participants(7, world, fraction, seed=1)
            assert chosen == fedavg.participants(7, world, fraction, seed=1) == sorted(set(chosen))
            assert len(chosen) == max(1, round(fraction * world)) and set(chosen) <= set(range(world))
    assert len({tuple(fedavg.participants(r, 8, 0.25, 0)) for r in range(20)}) > 5  # varies by round
    sampler = fedavg.ShardSampler(torch.tensor([3, 9, 11]), length=8, seed=0, rank=1)
    sampler.set_epoch(2)
    drawn = list(sampler)
    assert len(drawn) == len(sampler) == 8 and set(drawn) == {3, 9, 11} and sorted(drawn[:3]) == [3, 9, 11]
    assert drawn == list(sampler)


def test_gossip_topologies():
    assert gossip.neighbours(0, 2, "ring") == gossip.neighbours(0, 2, "exp") == [1]
    assert gossip.neighbours(0, 8, "exp") == [1, 2, 4, 6, 7] and gossip.neighbours(3, 8, "ring") == [2, 4]
    assert gossip.neighbours(0, 1, "ring") == []
    for world in range(2, 10):
        for topology in ("ring", "exp"):
            graph = {r: gossip.neighbours(r, world, topology) for r in range(world)}
            assert len({len(p) for p in graph.values()}) == 1, (world, topology)  # regular
            assert all(i in graph[j] for i in graph for j in graph[i]), (world, topology)  # symmetric
            # uniform weights 1/(d+1): symmetric and rows sum to 1, so doubly stochastic
            mixing = torch.zeros(world, world, dtype=torch.float64)
            for i, peers in graph.items():
                for j in [i, *peers]:
                    mixing[i, j] = 1.0 / (len(peers) + 1)
            assert torch.allclose(mixing, mixing.T)
            assert torch.allclose(mixing.sum(0), torch.ones(world, dtype=torch.float64))


def test_straggler_parsing():
    assert straggler.parse_straggler("1:3") == (1, 3.0) and straggler.parse_straggler(" 0:1.5 ") == (0, 1.5)
    for spec, match in (("x", "must be RANK:FACTOR"), ("1", "must be RANK:FACTOR"), ("1:0.5", "factor must be"),
                        ("-1:2", "rank must be >= 0"), ("1:inf", "factor must be"), ("1:nan", "factor must be")):
        with pytest.raises(ValueError, match="^pycomm train: straggler " + match):
            straggler.parse_straggler(spec)
    with pytest.raises(ValueError, match="^pycomm train: straggler rank 5 does not exist: the job has 2"):
        straggler.Straggler("5:3", 0, 2)
    slow = straggler.Straggler("1:3", 1, 2)
    assert slow.active and 0.02 <= slow.delay(0.01) < 0.5 and not straggler.Straggler("1:3", 0, 2).active


@pytest.mark.parametrize("values, match", [
    ({"strategy": "fedavg", "participation": 0}, "participation must be in"),
    ({"strategy": "fedavg", "participation": 1.5}, "participation must be in"),
    ({"strategy": "fedavg", "noniid": 0}, "noniid"),
    ({"strategy": "fedavg", "local_epochs": 0}, "local_epochs must be at least 1"),
    ({"strategy": "sync", "noniid": 0.5}, "apply to strategy fedavg"),
    ({"strategy": "gossip", "topology": "torus"}, "topology must be one of ring, exp"),
    ({"strategy": "gossip", "consensus_every": -1}, "consensus_every must be >= 0"),
    ({"straggler": "1:x"}, "straggler must be RANK:FACTOR"),
])
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match="^pycomm train: .*" + match):
        TrainConfig.from_dict(values)


def test_cli_usage_errors(capsys):
    assert cli.main(["-n", "2", "--straggler", "5:3"]) == 2
    assert "pycomm train: straggler rank 5 does not exist: the job has 2 rank(s)" in capsys.readouterr().err
    assert cli.main(["--strategy", "fedavg", "--participation", "0"]) == 2
    assert "participation must be in (0, 1]" in capsys.readouterr().err
    assert cli.main(["--strategy", "hogwild", "--checkpoint-dir", "x"]) == 2
    assert "hogwild does not support checkpoint_dir" in capsys.readouterr().err
    cfg, _ = cli.parse_config(["--strategy", "gossip", "--topology", "exp", "--consensus-every", "5",
                               "--straggler", "1:2.5"])
    assert (cfg.topology, cfg.consensus_every, cfg.straggler) == ("exp", 5, "1:2.5")


def test_hogwild_is_not_a_process_group_strategy():
    from pycomm.train import strategies

    with pytest.raises(ValueError, match="^pycomm train: hogwild is not a process-group strategy"):
        strategies.build_strategy(_cfg(strategy="hogwild"))
