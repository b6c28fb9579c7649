"""The all-reduce cost model and the planner (pycomm/plan/, allreduce_registry.cc).

* the C++ formulas, read through pycomm._C.allreduce_costs, against the closed forms;
* the built-in constants keep auto's choices (the table's known crossovers), and other
  constants change them;
* PYCOMM_COST_MODEL and the per-host cache reach a group, and every rank of a group
  uses rank 0's model (auto must agree everywhere);
* the planner's tables, break-even link speeds and calibration fit.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import pycomm
from mp_util import spawn_run
from pycomm import config as C
from pycomm import plan

K = pycomm._C
S = 1 << 20


def model(**changes):
    m = dict(plan.DEFAULT_MODEL)
    m.update(changes)
    return m


def cost_object(values):
    obj = K.CostModel()
    for name, value in values.items():
        setattr(obj, name, value)
    return obj


def costs(nbytes, ranks, one_host=False, hosts=0, values=None):
    return dict(K.allreduce_costs(nbytes, ranks, one_host, hosts, cost_object(values or plan.DEFAULT_MODEL)))


def test_formulas_match_closed_forms():
    # cpu_beta 0: a byte costs beta on the link; reduction (gamma) overlaps the link.
    m = model(alpha=10e-6, beta=1e-9, gamma=0.25e-9, delta=5e-6, shm_alpha=1e-6, shm_beta=0.1e-9, cpu_beta=0.0)
    a, b, g, d = m["alpha"], m["beta"], m["gamma"], m["delta"]
    c4 = costs(S, 4, values=m)
    assert set(c4) == {"ring", "sharded", "tree"}  # shm and hierarchical do not fit
    assert c4["ring"] == pytest.approx(6 * a + 2 * 0.75 * S * b)
    assert c4["sharded"] == pytest.approx(4 * a + 2 * 0.75 * S * b)
    # Real NICs (ingress limited): rank 0 takes 2 children's S, then sends S to each.
    assert c4["tree"] == pytest.approx(4 * a + 4 * S * b)
    c5 = costs(S, 5, values=m)
    assert c5["sharded"] == pytest.approx(2 * a + 4 * d + 2 * 0.8 * S * b)
    c2 = costs(S, 2, values=m)
    assert c2["ring"] == pytest.approx(2 * a + (S + 4097) * b)
    assert c2["sharded"] == math.inf
    shm = costs(S, 4, one_host=True, values=m)["shm"]
    assert shm == pytest.approx(2 * m["shm_alpha"] + 2 * 0.75 * S * m["shm_beta"] + 0.75 * S * g)
    # hierarchical, 2 hosts x 2 ranks: shm inside, the best of 2 leaders, a broadcast inside.
    h = costs(S, 4, hosts=2, values=m)["hierarchical"]
    inside = 2 * m["shm_alpha"] + 2 * 0.5 * S * m["shm_beta"] + 0.5 * S * g + m["shm_alpha"] + S * m["shm_beta"]
    assert h == pytest.approx(inside + c2["ring"])


def test_cpu_bound_tree_and_oversubscription():
    # TCP on one machine (no link limit, beta 0): the CPU copies (cpu_beta, half at each
    # end) bound every transfer. The 2-rank tree moves S up then S down, each a sender
    # and a receiver at once, as much CPU as the ring's two directions at once: it costs
    # about the ring, not twice (the old formula charged 2 S beta, 62-93% over).
    m = model(alpha=10e-6, beta=0.0, gamma=0.2e-9, cpu_beta=1e-9)
    a, g, cb = m["alpha"], m["gamma"], m["cpu_beta"]
    c2 = costs(S, 2, values=m)
    assert c2["ring"] == pytest.approx(2 * a + S * cb + 0.5 * S * g)
    assert c2["tree"] == pytest.approx(2 * a + S * cb + S * g)
    # 4 ranks on 2 cores (2 ranks per core): every rank's CPU work shares the cores.
    c4 = dict(K.allreduce_costs(S, 4, False, 4, cost_object(m), oversubscription=2.0))
    assert c4["ring"] == pytest.approx(6 * a + 2 * (1.5 * S * cb + 0.75 * S * g))
    assert c4["sharded"] == pytest.approx(4 * a + 2 * (1.5 * S * cb + 0.75 * S * g))
    assert c4["tree"] == pytest.approx(4 * a + 2 * 0.75 * S * (2 * cb + g))
    one = dict(K.allreduce_costs(S, 4, False, 4, cost_object(m)))
    assert one["ring"] < c4["ring"] and one["tree"] == pytest.approx(4 * a + 2 * S * cb + 2 * S * g)


def test_measured_one_way_transfers_cost_the_tree():
    # cpu_beta_oneway: a one-way transfer's time per byte, measured from the 2-rank tree
    # (on this VM's namespace path 1.06-1.14x half the two-way cpu_beta, which the model
    # assumed before). The ring and sharded do not use it.
    w = 0.8e-9
    m = model(alpha=10e-6, beta=0.0, gamma=0.2e-9, cpu_beta=1e-9, cpu_beta_oneway=w)
    a, g, cb = m["alpha"], m["gamma"], m["cpu_beta"]
    c2 = costs(S, 2, values=m)
    assert c2["tree"] == pytest.approx(2 * a + S * (2 * w + g))
    assert c2["ring"] == pytest.approx(2 * a + S * cb + 0.5 * S * g)
    # 4 ranks, one per core: two levels up (w + g each), two down (w each)
    one = dict(K.allreduce_costs(S, 4, False, 4, cost_object(m)))
    assert one["tree"] == pytest.approx(4 * a + 2 * S * (w + g) + 2 * S * w)
    # 2 ranks per core: each edge's two transfers keep both ends busy, 2 w each
    two = dict(K.allreduce_costs(S, 4, False, 4, cost_object(m), oversubscription=2.0))
    assert two["tree"] == pytest.approx(4 * a + 2 * 0.75 * S * (4 * w + g))
    assert two["ring"] == pytest.approx(6 * a + 2 * (1.5 * S * cb + 0.75 * S * g))
    # Not measured (0): half of cpu_beta, the model as it was
    for ranks, o in ((2, 1.0), (4, 1.0), (4, 2.0), (8, 4.0)):
        half = dict(K.allreduce_costs(S, ranks, False, ranks, cost_object(dict(m, cpu_beta_oneway=0.5 * cb)),
                                      oversubscription=o))
        unset = dict(K.allreduce_costs(S, ranks, False, ranks, cost_object(dict(m, cpu_beta_oneway=0.0)),
                                       oversubscription=o))
        assert half == pytest.approx(unset), (ranks, o)


def test_a_links_burst_spares_each_tree_phase_its_first_bytes():
    # link_burst: a token bucket's burst (tc tbf on the validation's namespace hosts).
    # Each of the tree's phases starts on idle links, so each sends its first B bytes
    # uncharged: 2 ranks, link-bound, two phases of S each -> 2 (S - B) beta. The ring
    # keeps its links busy and is unchanged; 0 (the default, a real NIC) changes nothing.
    b, B = 8e-9, 256 * 1024.0
    m = model(alpha=10e-6, beta=b, gamma=0.0, cpu_beta=0.0, cpu_beta_oneway=0.0)
    plain = dict(K.allreduce_costs(S, 2, False, 2, cost_object(m), ingress_limited=False))
    burst = dict(K.allreduce_costs(S, 2, False, 2, cost_object(dict(m, link_burst=B)), ingress_limited=False))
    assert plain["tree"] == pytest.approx(2 * m["alpha"] + 2 * S * b)
    assert burst["tree"] == pytest.approx(plain["tree"] - 2 * B * b)
    assert burst["ring"] == plain["ring"]
    # 4 hosts: the reduce's children each send S on their own link (S - B), rank 0
    # sends S to each of its 2 children on its own (2 S - B)
    four = dict(K.allreduce_costs(S, 4, False, 4, cost_object(dict(m, link_burst=B)), ingress_limited=False))
    assert four["tree"] == pytest.approx(4 * m["alpha"] + (S - B) * b + (2 * S - B) * b)
    # A message smaller than the burst costs no link time at all
    small = dict(K.allreduce_costs(4096, 2, False, 2, cost_object(dict(m, link_burst=B)), ingress_limited=False))
    assert small["tree"] == pytest.approx(2 * m["alpha"])
    # The validation's tbf link model sets it; without a rate there is no bucket
    assert plan.link_model(m, "1gbit")["link_burst"] == B
    assert plan.link_model(m, None)["link_burst"] == m["link_burst"] == 0.0


def test_one_way_fit_from_the_two_rank_tree():
    a, w, g = 80e-6, 0.9e-9, 0.1e-9
    tree = [(float(s), 2 * a + s * (2 * w + g)) for s in (1 << 20, 4 << 20, 16 << 20)]
    assert plan.calibration._one_way(tree, g) == pytest.approx(w)
    # A flat fit (noise) is "not measured" (half of cpu_beta), not a free tree
    assert plan.calibration._one_way([(float(1 << 20), 1e-6), (float(4 << 20), 1e-6)], g) == 0.0
    assert plan.calibration._one_way([(float(1 << 20), 1e-3)], g) == 0.0


def test_egress_only_link_tree():
    # tc tbf on each host's egress (pycomm/netns.py): rank 0's children send at once over
    # links of their own, so the reduce takes S beta; the broadcast still leaves through
    # rank 0's link, k S beta. A real NIC also limits rank 0's ingress: k S beta each.
    m = model(alpha=10e-6, beta=8e-9, gamma=0.2e-9, cpu_beta=1e-9)
    a, b = m["alpha"], m["beta"]
    egress = dict(K.allreduce_costs(S, 4, False, 4, cost_object(m), ingress_limited=False))
    nic = dict(K.allreduce_costs(S, 4, False, 4, cost_object(m), ingress_limited=True))
    assert egress["tree"] == pytest.approx(4 * a + 3 * S * b)
    assert nic["tree"] == pytest.approx(4 * a + 4 * S * b)
    # The link is slower than the copies: the symmetric algorithms are link-bound either way.
    assert egress["ring"] == nic["ring"] == pytest.approx(6 * a + 1.5 * S * b)
    # Link-bound, halving/doubling's steps cost it 5% of its link term (allreduce_registry.cc,
    # kShardedLinkShare): more than the ring's 2 extra messages here.
    assert egress["sharded"] == pytest.approx(4 * a + 1.05 * 1.5 * S * b)
    assert K._select_algorithm(S, 4, False, 4, cost_object(m), ingress_limited=False) == "ring"


def test_builtin_constants_keep_autos_choices():
    pick = K._select_algorithm
    assert pick(4096, 2) == "tree" and pick(4097 * 2, 2) == "ring"  # the 2-rank crossover
    assert pick(S, 4, True) == "shm" and pick(8, 8, True) == "shm"  # one host: shm everywhere
    assert pick(S, 4, False, 2) == "hierarchical" and pick(8, 6, False, 3) == "hierarchical"
    assert pick(S, 1, True) == "ring"  # one rank: nothing to share
    assert pick(S, 4) == "sharded" and pick(S, 3) in ("ring", "sharded")
    # The same with the constants passed explicitly.
    assert pick(S, 4, False, 0, cost_object(plan.DEFAULT_MODEL)) == "sharded"


def test_other_constants_change_autos_choice():
    pick = K._select_algorithm
    # 5 ranks: sharded pays 2 alpha + 4 delta, ring 8 alpha.
    assert pick(S, 5, False, 0, cost_object(model(alpha=1e-3, delta=1e-6))) == "sharded"
    assert pick(S, 5, False, 0, cost_object(model(alpha=1e-7, delta=1e-2))) == "ring"
    # The shared-memory family stays preferred wherever it fits, whatever the constants.
    assert pick(S, 4, True, 0, cost_object(model(shm_beta=1e-3))) == "shm"


def test_cost_model_config(tmp_path, monkeypatch):
    assert C.load_config({"PYCOMM_COST_MODEL": "default"}).cost_model is None
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"model": model(alpha=1e-3)}))
    assert C.load_config({"PYCOMM_COST_MODEL": str(path)}).cost_model["alpha"] == 1e-3
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json is not a pycomm cost-model calibration"):
        C.load_config({"PYCOMM_COST_MODEL": str(bad)})
    # A calibration from before cpu_beta existed: cpu_beta 0 (beta stood for it).
    old = {k: v for k, v in model(alpha=1e-3).items() if k != "cpu_beta"}
    path.write_text(json.dumps({"model": old}))
    assert C.load_config({"PYCOMM_COST_MODEL": str(path)}).cost_model["cpu_beta"] == 0.0
    # ... and before cpu_beta_oneway: 0, which the tree takes as half of cpu_beta.
    old = {k: v for k, v in model(alpha=1e-3, cpu_beta=1e-9).items() if k != "cpu_beta_oneway"}
    path.write_text(json.dumps({"model": old}))
    assert C.load_config({"PYCOMM_COST_MODEL": str(path)}).cost_model["cpu_beta_oneway"] == 0.0
    bad.write_text(json.dumps({"model": model(beta=-1.0)}))
    with pytest.raises(ValueError, match="beta out of range"):
        C.load_config({"PYCOMM_COST_MODEL": str(bad)})
    # Unset: this host's cache when there is one (a damaged cache is ignored).
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert C.load_config(env).cost_model is None
    cache = C.cost_cache_path(env)
    os.makedirs(os.path.dirname(cache))
    with open(cache, "w") as handle:
        json.dump({"model": model(delta=1e-2)}, handle)
    assert C.load_config(env).cost_model["delta"] == 1e-2
    with open(cache, "w") as handle:
        handle.write("not json")
    assert C.load_config(env).cost_model is None
    options = C.group_config(C.Config(cost_model=model(alpha=2e-3)), timeout=__import__("datetime").timedelta(1),
                             bind_address="127.0.0.1", global_ranks=[0], store_prefix="p/")
    assert options.cost.alpha == 2e-3 and options.cost.beta == plan.DEFAULT_MODEL["beta"]


def _rank0_model_worker(ctx, paths):
    # Each rank points PYCOMM_COST_MODEL at its own file before creating a group:
    # rank 0's ring-favouring model must win on every rank.
    os.environ["PYCOMM_COST_MODEL"] = paths[ctx.rank]
    group = dist.new_group(backend="pycomm")
    return pycomm.select_algorithm(S, group=group)


def test_every_rank_uses_rank0s_model(tmp_path):
    favour_ring = tmp_path / "ring.json"
    favour_ring.write_text(json.dumps({"model": model(alpha=1e-7, delta=1e-2)}))
    favour_sharded = tmp_path / "sharded.json"
    favour_sharded.write_text(json.dumps({"model": model(alpha=1e-3, delta=1e-6)}))
    paths = [str(favour_ring), str(favour_sharded), str(favour_sharded)]
    rets = spawn_run(_rank0_model_worker, 3, args=(paths,), env={"PYCOMM_TRANSPORT": "tcp"},
                     timeout_s=120, pg_timeout_s=30).check().returns
    assert [rets[r] for r in range(3)] == ["ring"] * 3, rets


def test_planner_tables_and_break_even():
    m = model(gamma=0.2e-9)
    codec = {"topk": 1e-9, "quantize": 0.5e-9}
    topo = plan.Topology(4, 2, gbps=1.0, latency_s=20e-6)
    c = plan.predict(m, topo, 64 << 20, codec)
    assert {"ring", "sharded", "tree", "hierarchical", "topk d=0.01", "quantize 8-bit"} <= set(c)
    assert plan.Topology(4, 2, 1.0).model(m)["beta"] == pytest.approx(8e-9)
    assert topo.model(m)["alpha"] == pytest.approx(20e-6 + m["alpha"])
    # Compression pays below some link speed, and less so at a higher density.
    slow = plan.break_even_gbps(m, topo, 64 << 20, "topk d=0.001", codec)
    assert slow is not None and 0 < slow < math.inf
    dense_at, comp_at = plan.winners(plan.predict(m, plan.Topology(4, 1, slow * 0.5), 64 << 20, codec))
    assert comp_at.startswith(("topk", "quantize")), (dense_at, comp_at)
    assert plan.break_even_gbps(m, topo, 64 << 20, "topk d=0.01", codec) < slow
    lines = plan.table(m, codec, topo, sizes=(1 << 10, 1 << 20))
    assert "hierarchical" in lines[-1] and len(lines) == 4
    with pytest.raises(ValueError, match="hosts and ranks per host must be >= 1"):
        plan.Topology(0, 2)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_topk_wire_bytes_match_the_sparse_allreduce(n, density):
    """The planner's bytes for top-k are what allreduce_sparse.cc sends: run it (threads
    as ranks, loopback transport) on every rank's top `density` at random positions,
    bfloat16 values, owners keeping 2 x density, and compare each rank's bytes sent."""
    import torch
    import loopback

    count = 1 << 20
    g = torch.Generator().manual_seed(n * 1000 + int(density * 1e4))
    k = int(density * count)
    indices = [torch.sort(torch.randperm(count, generator=g)[:k]).values for _ in range(n)]
    values = [torch.randn(k, generator=g) for _ in range(n)]
    _, sent, _ = loopback.allreduce_sparse(indices, values, count, value_dtype="bfloat16",
                                           keep_density=2 * density)
    predicted = plan.topk_wire_bytes(4 * count, density, n)
    for r in range(n):
        assert abs(predicted - sent[r]) <= 0.05 * sent[r], (r, predicted, sent[r])
    # The old charge, 8 bytes per kept element in each phase, was far above it.
    assert predicted < 0.75 * 2 * (n - 1) / n * 2 * density * 4 * count


def test_compressed_messages_grow_with_the_ranks():
    """Both compressed all-reduces exchange directly with every other rank, so their
    per-message term grows with n (delta per message in flight), not with log2 n: on
    10 Gbit/s links top-k 1% of 64 MiB beats every dense algorithm at 64 ranks, and at
    4,096 its 2 x 8,189 messages cost more than hierarchical's whole all-reduce."""
    codec = {"topk": 0.2e-9, "quantize": 0.2e-9}
    m = model(cpu_beta=0.0)

    def costs_at(ranks):
        return plan.predict(m, plan.Topology(ranks // 8, 8, gbps=10.0, latency_s=20e-6), 64 << 20, codec)

    small, big = costs_at(64), costs_at(4096)
    assert plan.winners(small)[1] == "topk d=0.01" or plan.winners(small)[1] == "topk d=0.001"
    assert big["topk d=0.01"] >= 2 * (2 * 4095 - 1) * m["delta"]
    assert big["quantize 8-bit"] >= 2 * 4094 * m["delta"]
    assert big["topk d=0.01"] > big["hierarchical"], big
    # TopKState(hosts=...): the sparse exchange among the 512 leaders only
    assert big["topk d=0.01 hosts"] < min(big["topk d=0.01"], big["hierarchical"]), big
    assert big["quantize 8-bit hosts"] < min(big["quantize 8-bit"], big["hierarchical"]), big
    assert "topk d=0.01 hosts" not in plan.predict(m, plan.Topology(8, 1, gbps=10.0), 64 << 20, codec)


def test_fit_line_recovers_constants():
    a, b = 50e-6, 1e-9
    points = [(float(s), a + b * s) for s in (8, 1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    fa, fb = plan.calibration._fit_line(points)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)


def test_calibration_keeps_each_sizes_median_over_rounds():
    # One slow sweep (a neighbour's burst) must not move the fit: the median per size
    # ignores it, where the mean of the same three would be 40% off at 16 MiB.
    a, b = 60e-6, 1e-9
    sizes = (8.0, 1024.0, float(1 << 20), float(1 << 22), float(1 << 24))
    clean = [(s, a + b * s) for s in sizes]
    slow = [(s, 2.2 * t) for s, t in clean]
    fast = [(s, 0.95 * t) for s, t in clean]
    points = plan.calibration._median_points([clean, slow, fast[:-1]])  # a sweep may lack its last size
    assert [s for s, _ in points] == list(sizes)
    assert points[0][1] == pytest.approx(clean[0][1]) and points[-1][1] == pytest.approx(1.6 * clean[-1][1])
    points = plan.calibration._median_points([clean, slow, fast])
    assert points == [(s, t) for s, t in clean]
    fa, fb = plan.calibration._fit_regimes(points)  # alpha from the small sizes' median, 1024 B here
    assert fa == pytest.approx(a, rel=0.02) and fb == pytest.approx(b, rel=0.01)
    assert plan.calibration.CALIBRATION_ROUNDS >= 3


def test_cli_predicts_without_a_calibration(tmp_path, monkeypatch, capfd):
    # `python -m pycomm.plan ARGS`, its main() in this process (mp_util.run_main_here)
    from mp_util import run_main_here

    from pycomm.plan import cli

    def plan_cli(*args):
        return run_main_here(cli.main, args, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd, timeout_s=120,
                             env={"XDG_CACHE_HOME": str(tmp_path)}, name="pycomm.plan")

    proc = plan_cli("--hosts", "2", "--ranks-per-host", "2", "--bandwidth", "1gbit", "--latency", "50us",
                    "--extrapolate")
    assert proc.returncode == 0, proc.stderr
    assert "built-in constants" in proc.stdout and "4 ranks" in proc.stdout
    assert "link speed below which" in proc.stdout and "4096 ranks (512 hosts)" in proc.stdout
    # The TCP stream model: uncalibrated, one stream (per-stream throughput unknown).
    assert "TCP streams: per-stream throughput not measured" in proc.stdout, proc.stdout
    assert "auto: PYCOMM_SOCKETS_PER_PEER=1, PYCOMM_IO_THREADS=1" in proc.stdout, proc.stdout
    proc = plan_cli("--model", str(tmp_path / "none.json"), "--hosts", "0")
    assert proc.returncode == 1 and "hosts and ranks per host must be >= 1" in proc.stderr


@pytest.mark.slow
def test_calibrate_and_cache(tmp_path):
    calibration = plan.calibrate(max_bytes=1 << 18, iters=3, verbose=False)
    m = calibration["model"]
    assert all(m[name] > 0 for name in ("alpha", "cpu_beta", "gamma", "shm_alpha", "shm_beta")), m
    assert m["beta"] == 0.0  # loopback: no link, the TCP copies (cpu_beta) are the cost
    assert calibration["codec"]["topk"] > 0 and calibration["points"]["ring_tcp"]
    tree = calibration["points"]["tree_tcp"]
    assert [s for s, _ in tree] == [float(1 << 14), float(1 << 16), float(1 << 18)]
    assert m["cpu_beta_oneway"] == plan.calibration._one_way(tree, m["gamma"])  # the tree's points give it
    streams = calibration["streams"]
    assert streams["per_stream_gbps"] > 0 and sorted(streams["ring_seconds"]) == ["1", "2", "4"], streams
    assert all(t > 0 for t in streams["ring_seconds"].values()), streams
    path = plan.save_calibration(calibration, str(tmp_path / "c.json"))
    loaded, codec, source = plan.load_calibration(path)
    assert loaded == pytest.approx(m) and source == path and codec == calibration["codec"]


def _recorded(name):
    """{(algo, bytes): seconds} of a committed pycomm-bench --hosts run (benchmarks/results)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", name)
    with open(path) as handle:
        data = json.load(handle)
    return data["meta"], {(r["algo"], r["size_bytes"]): r["time_us"] * 1e-6 for r in data["rows"] if not r["peer"]}


def test_ranks_sharing_a_host_link():
    # 4 hosts x 4 ranks, laid out host by host. The ring puts one edge per host on the
    # link (2P); halving/doubling's steps between hosts put all 4 ranks of a host on it
    # at once (2 L S (H-1)/H); only rank 0's children off its host (distance 4, 8) load
    # the tree's link. Without hosts (every rank a host of its own) nothing is shared.
    m = model(alpha=10e-6, beta=1e-9, gamma=0.0, cpu_beta=0.0)
    a, b = m["alpha"], m["beta"]
    shared = costs(S, 16, hosts=4, values=m)
    assert shared["ring"] == pytest.approx(30 * a + 2 * 15 / 16 * S * b)
    assert shared["sharded"] == pytest.approx(8 * a + 2 * 4 * 3 / 4 * S * b)
    assert shared["tree"] == pytest.approx(8 * a + 4 * S * b)
    alone = costs(S, 16, values=m)
    assert alone["sharded"] == pytest.approx(8 * a + 2 * 15 / 16 * S * b)
    assert alone["tree"] == pytest.approx(8 * a + 8 * S * b)


@pytest.mark.parametrize("name", ["multihost_2hosts_1gbit.json", "multihost_4hosts_1gbit.json"])
def test_predicts_recorded_tbf_runs_within_25_percent(name):
    # Committed measurements across namespaces at 1 Gbit/s (tbf on each host's egress):
    # the link alone decides from 4 MiB, so the rate (its TCP payload) and the shapes of
    # the algorithms fix the prediction. The old tree formula (2 k S beta, both ways
    # limited) was 22-31% over on 4 hosts; with this rule (within 25%) it fails at 16
    # and 64 MiB.
    meta, measured = _recorded(name)
    hosts = meta["hosts"]
    m = plan.link_model(model(cpu_beta=1e-9, gamma=0.1e-9), meta["rate"])
    for size in (4 << 20, 16 << 20, 64 << 20):
        c = dict(K.allreduce_costs(size, hosts, False, hosts, cost_object(m), oversubscription=hosts / 2,
                                   ingress_limited=False))
        for algo in ("ring", "sharded", "tree"):
            if math.isinf(c[algo]):
                continue
            got = measured[(algo, size)]
            assert abs(c[algo] - got) / got <= 0.25, (algo, size, c[algo], got)


def test_validation_table():
    records = [
        {"hosts": 2, "rate": "1gbit", "size": 1 << 20, "algo": "ring", "oversubscription": 1.0,
         "predicted": 0.011, "measured": 0.010, "error": 0.1},
        {"hosts": 2, "rate": "1gbit", "size": 1 << 20, "algo": "tree", "oversubscription": 1.0,
         "predicted": 0.03, "measured": 0.02, "error": 0.5},
        {"hosts": 2, "rate": "1gbit", "size": 1 << 20, "algo": "auto", "picked": "ring", "predicted_best": "ring",
         "fastest": "ring", "auto_measured": 0.0101, "slowdown": 0.0},
    ]
    text = "\n".join(plan.validation_table(records))
    assert "1/2 within 25%, worst +50% (tree, 1 MiB)" in text
    assert "one within 5% of it at 1/1" in text
    assert plan.link_model(model(), "1gbit")["beta"] == pytest.approx(8e-9 * 1514 / 1448)
    assert plan.oversubscription(8, cores=2) == 4.0 and plan.oversubscription(1, cores=2) == 1.0


@pytest.mark.slow
def test_validate_across_namespaces(tmp_path):
    # The one command, smallest: calibrate the namespace path, 2 hosts at 1 Gbit/s, 4 MiB.
    from pycomm.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"--validate needs network namespaces: {reason}")
    out = tmp_path / "table.txt"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "pycomm.plan", "--validate", "--validate-hosts", "2",
                           "--rates", "1gbit", "--max-bytes", str(4 << 20), "--iters", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("2 ") and "MiB" in line]
    algos = {row[3] for row in rows if len(row) == 9}
    assert algos == {"ring", "tree"}, text  # sharded does not run on 2 ranks (inf)
    measured = {(row[3], row[4]): float(row[7]) for row in rows if len(row) == 9}
    # The link decides: the tree moves S up and S down one after the other, the ring S each way at once.
    assert measured[("tree", "4")] > 1.4 * measured[("ring", "4")], text
    assert "auto took" in text and "2 hosts, rate 1gbit" in text
