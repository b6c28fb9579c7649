"""Multi-host runs on one machine: every host is a network namespace on a
private bridge (netns_util.py), so ranks on different hosts talk over real TCP
through veth interfaces, as on separate machines.

* all collectives (the sections of test_collectives.py, pycomm vs gloo in the
  same processes) plus a short DDP run compared with gloo, on 2 hosts x 2
  ranks (PYCOMM_SOCKET_IFNAME), 3 hosts x 1 rank (no PYCOMM_SOCKET_IFNAME:
  the default picks the address that routes to the tcp:// store host) and,
  marked slow, 4 hosts x 1 rank (env://, MASTER_ADDR);
* a rank's listener is bound to its interface's address: not reachable on
  127.0.0.1 of the same host (checked with `ss -ltnp` inside the namespace
  while the listener is open);
* torchrun --rdzv-backend c10d, one torchrun per namespace, 2 hosts x 2 ranks.

Skipped (with the reason) where namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mp_util import format_failures, free_port, spawn_run
from netns_util import IFNAME, NetnsHosts, netns_unavailable_reason
from test_collectives import collectives_worker

_UNAVAILABLE = None


@pytest.fixture
def make_hosts():
    """Factory: make_hosts(n) -> NetnsHosts; everything is removed afterwards."""
    global _UNAVAILABLE
    if _UNAVAILABLE is None:
        _UNAVAILABLE = netns_unavailable_reason() or ""
    if _UNAVAILABLE:
        pytest.skip(f"multi-host tests need network namespaces: {_UNAVAILABLE}")
    created = []

    def make(n, **kw):
        hosts = NetnsHosts(n, **kw)
        created.append(hosts)
        return hosts.create()

    try:
        yield make
    finally:
        left = []
        for hosts in created:
            hosts.close()
            left += hosts.leftovers()
        assert not left, f"namespaces/links left behind: {left}"


def _placement(hosts, per_host):
    """Rank -> namespace, ranks filled host by host."""
    return [hosts.names[r // per_host] for r in range(len(hosts.names) * per_host)]


def _own_tcp_connections():
    """(local, peer) of this process's established TCP sockets, from ss in our namespace."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True,
                         timeout=20).stdout
    conns = []
    for line in out.splitlines():
        if f"pid={os.getpid()}," in line:
            f = line.split()
            conns.append((f[2].rsplit(":", 1)[0], f[3].rsplit(":", 1)[0]))
    return conns


# ---------------------------------------------------------------------------
# workers (run inside the spawned ranks, each in its namespace)
# ---------------------------------------------------------------------------

def _ddp_train(ctx, group, steps=8):
    torch.manual_seed(100 + ctx.rank)  # different weights per rank: DDP broadcasts rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    for step in range(steps):
        ctx.progress(f"DDP step {step}")
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# enough traffic to prove a rendezvous and the addresses work: the tests of how ranks
# find each other run these; the 2 x 2 and 16-rank tests run every collective across hosts
CORE_SECTIONS = ["all_reduce", "broadcast", "all_gather_into_tensor", "p2p", "barrier"]


def multihost_worker(ctx, sections):
    out = {"ddp_pycomm": _ddp_train(ctx, None), "ddp_gloo": _ddp_train(ctx, ctx.ref)}
    out["connections"] = _own_tcp_connections()
    import pycomm

    x = torch.full((300001,), float(ctx.rank + 1))
    torch.distributed.all_reduce(x)
    out["algorithm"] = pycomm.last_algorithm()
    out["sum_ok"] = bool(torch.all(x == ctx.world_size * (ctx.world_size + 1) / 2))
    collectives_worker(ctx, sections, False)
    return out


def _check_run(res, sections, world, hosts, per_host):
    problems = []
    for name in sections:
        done = [r for r in range(world) if name in res.reports.get(r, {})]
        if len(done) < world:
            problems.append(f"section {name!r} did not complete on ranks {sorted(set(range(world)) - set(done))}")
            continue
        fails = [f for r in range(world) for f in res.reports[r][name]["failures"]]
        if fails:
            problems.append(f"{name}: " + format_failures(fails))
    msg = res.failure_message()
    if msg:
        problems.append(msg)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    rets = res.returns
    for r in range(world):
        assert rets[r]["sum_ok"], f"rank {r}: wrong all-reduce sum"
        # hosts with several ranks: reduce inside the host over shared memory first
        want = "hierarchical" if per_host > 1 else None
        if want:
            assert rets[r]["algorithm"] == want, f"rank {r}: all-reduce took {rets[r]['algorithm']}"
        else:
            assert rets[r]["algorithm"] not in ("hierarchical", "shm"), rets[r]["algorithm"]
        for k, v in rets[r]["ddp_pycomm"].items():
            e = rets[r]["ddp_gloo"][k]
            assert torch.allclose(v.double(), e.double(), rtol=1e-5, atol=1e-6), \
                f"rank {r}: DDP over pycomm: {k} differs from gloo's"
            assert torch.equal(v, rets[0]["ddp_pycomm"][k]), f"DDP: {k} differs between rank 0 and rank {r}"
        # real TCP across hosts: each rank has connections from its own host's
        # address to every other host's address
        mine = hosts.addrs[r // per_host]
        peers = {p for (l, p) in rets[r]["connections"] if l == mine}
        others = set(hosts.addrs) - {mine}
        assert others <= peers, f"rank {r} ({mine}): TCP peers {sorted(peers)}, expected all of {sorted(others)}"


def _env(ifname=True):
    env = {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "PYCOMM_SOCKET_IFNAME": ""}
    if ifname:
        env["PYCOMM_SOCKET_IFNAME"] = IFNAME
    return env


def test_two_hosts_two_ranks_ifname(make_hosts):
    """2 hosts x 2 ranks, PYCOMM_SOCKET_IFNAME names the interface, file:// rendezvous."""
    hosts = make_hosts(2)
    # the named interface, then reinit (file:// again, still on it); every collective across
    # hosts, 2 ranks each: test_sixteen_ranks_eight_hosts
    sections = CORE_SECTIONS + ["reinit"]
    res = spawn_run(multihost_worker, 4, args=(sections,), netns=_placement(hosts, 2), env=_env(True),
                    timeout_s=170, pg_timeout_s=30)
    _check_run(res, sections, 4, hosts, 2)


def test_three_hosts_default_route(make_hosts):
    """3 hosts x 1 rank, no PYCOMM_SOCKET_IFNAME: pycomm listens on the address that
    routes to the tcp:// store host (host 0). The root namespace's address (what the
    host name resolves to) does not exist in the namespaces, so only that choice works."""
    hosts = make_hosts(3)
    # what is new here is the address choice: a few collectives prove it (every collective across
    # hosts: the 2 x 2 and 16-rank tests); reinit uses file://, no store host to route to
    sections = CORE_SECTIONS
    res = spawn_run(multihost_worker, 3, args=(sections,), netns=_placement(hosts, 1), env=_env(False),
                    init="tcp", master_addr=hosts.addrs[0], timeout_s=150, pg_timeout_s=30)
    _check_run(res, sections, 3, hosts, 1)


@pytest.mark.slow
def test_four_hosts_env_master_addr(make_hosts):
    """4 hosts x 1 rank, env:// with MASTER_ADDR = host 0, default address selection."""
    hosts = make_hosts(4)
    sections = CORE_SECTIONS  # the env:// rendezvous is what is new here (see above)
    res = spawn_run(multihost_worker, 4, args=(sections,), netns=_placement(hosts, 1), env=_env(False),
                    init="env", master_addr=hosts.addrs[0], timeout_s=200, pg_timeout_s=30)
    _check_run(res, sections, 4, hosts, 1)


# ---------------------------------------------------------------------------
# the listener is bound to the interface address, not 0.0.0.0
# ---------------------------------------------------------------------------

# Runs as a child process of rank 0 (same namespace) while rank 0 sits in the
# setup of a new pycomm group with its listener open: lists rank 0's listening
# sockets and tries to reach each on 127.0.0.1.
PROBE = textwrap.dedent(
    r"""
    import json, socket, subprocess, sys, time
    pid = sys.argv[1]
    found, deadline = [], time.monotonic() + 8
    while not found and time.monotonic() < deadline:
        time.sleep(0.2)
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        found = [l.split()[3] for l in out.splitlines() if f"pid={pid}," in l]
    results = []
    for local in found:
        port = int(local.rsplit(":", 1)[1])
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            results.append([local, "connected"])
        except OSError as e:
            results.append([local, type(e).__name__])
        finally:
            s.close()
    print(json.dumps({"listeners": results, "ss": out}))
    """
)


def listener_worker(ctx, delay_s):
    if ctx.rank == 0:
        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(os.getpid())], stdout=subprocess.PIPE,
                                 text=True)
        ctx.progress("new_group(pycomm) with rank 1 late")
        sub = dist.new_group(backend="pycomm")
        t = torch.ones(10)
        dist.all_reduce(t, group=sub)  # in case the connections are made lazily
        out, _ = probe.communicate(timeout=30)
        probe_result = json.loads(out)
    else:
        time.sleep(delay_s)
        sub = dist.new_group(backend="pycomm")
        t = torch.ones(10)
        dist.all_reduce(t, group=sub)
        probe_result = None
    return {"sum": t.tolist(), "probe": probe_result}


def test_listener_bound_to_interface_address(make_hosts):
    hosts = make_hosts(2)
    res = spawn_run(listener_worker, 2, args=(5.0,), netns=_placement(hosts, 1), env=_env(True),
                    make_ref=False, timeout_s=90, pg_timeout_s=30).check()
    assert res.returns[1]["sum"] == [2.0] * 10
    probe = res.returns[0]["probe"]
    listeners = probe["listeners"]
    assert listeners, f"no listening socket of rank 0 seen while it waited for rank 1; ss:\n{probe['ss']}"
    for local, outcome in listeners:
        assert local.rsplit(":", 1)[0] == hosts.addrs[0], \
            f"rank 0 listens on {local}, expected {hosts.addrs[0]}:* (not a wildcard); ss:\n{probe['ss']}"
        assert outcome == "ConnectionRefusedError", \
            f"connecting to 127.0.0.1:{local.rsplit(':', 1)[1]} on rank 0's host gave {outcome}, expected refused"


# ---------------------------------------------------------------------------
# torchrun, one per namespace, c10d rendezvous on host 0
# ---------------------------------------------------------------------------

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os, socket, subprocess, torch, torch.distributed as dist
    import pycomm
    dist.init_process_group("pycomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((100003,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == world * (world + 1) / 2), t[:4]
    parts = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, torch.full((3,), rank, dtype=torch.int64))
    assert [int(p[0]) for p in parts] == list(range(world))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(3, 4, generator=g)).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(every, grads)
    assert all(torch.equal(e, every[0]) for e in every), "DDP gradients differ between ranks"
    addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", os.environ["HOST_IF"]],
                          capture_output=True, text=True).stdout.split()[3].split("/")[0]
    dist.destroy_process_group()
    print(f"rank {rank} of {world} on {addr} (master {os.environ['MASTER_ADDR']}): ok", flush=True)
    """
)


def test_torchrun_across_namespaces(make_hosts, tmp_path):
    nhosts, per_host = 2, 2
    hosts = make_hosts(nhosts)
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    port = free_port()
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS="1", HOST_IF=IFNAME)
    env.pop("PYCOMM_SOCKET_IFNAME", None)
    try:
        for k in range(nhosts):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nhosts),
                    "--nproc_per_node", str(per_host), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}", "--rdzv-id", "multihost",
                    "--rdzv-conf", f"is_host={1 if k == 0 else 0},join_timeout=60",
                    "--local-addr", hosts.addrs[k], "--max-restarts", "0", str(script)]
            procs.append(hosts.popen(k, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=tmp_path))
        outs = []
        deadline = time.monotonic() + 150
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out = "TIMED OUT\n" + out
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(f"--- torchrun on host {k} (exit {p.returncode}):\n{o[-3000:]}"
                       for k, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    world = nhosts * per_host
    text = "".join(outs)
    seen = re.findall(r"rank (\d+) of (\d+) on (\S+) \(master (\S+)\): ok", text)
    assert sorted(int(r) for r, *_ in seen) == list(range(world)), report
    assert all(int(w) == world for _, w, _, _ in seen)
    # every host ran per_host ranks
    on = {a: sum(1 for s in seen if s[2] == a) for a in hosts.addrs}
    assert on == {a: per_host for a in hosts.addrs}, (on, report)


# ---------------------------------------------------------------------------
# 16 ranks on 8 hosts (2 per host): every collective, exact closed forms
# ---------------------------------------------------------------------------

# all-reduce algorithms that fit 8 hosts x 2 ranks; shm (every rank on one host) does not
FITTING_ALGOS = ("auto", "ring", "tree", "sharded", "hierarchical")


def _weights(n, dtype=torch.float32):
    return (torch.arange(n) % 5 + 1).to(dtype)


def sixteen_worker(ctx, sizes):
    """Every collective once per size on the default (pycomm) group; returns the failures,
    each naming the collective, the size and what differed."""
    import pycomm

    r, w = ctx.rank, ctx.world_size
    fails, algos = [], {}

    def expect(what, got, want):
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            first = int(bad[0][0]) if bad.numel() else -1
            fails.append(f"rank {r}: {what}: {bad.shape[0]} element(s) differ, first at {first}: "
                         f"got {got.reshape(-1)[first].item()}, want {want.reshape(-1)[first].item()}")

    tri = w * (w + 1) // 2  # sum of rank + 1 over the ranks
    for algo in FITTING_ALGOS:
        ctx.progress(f"all_reduce {algo}")
        pycomm.set_algorithm(algo)
        for n in sizes + (65537,):
            x = _weights(n) * (r + 1)
            dist.all_reduce(x)
            expect(f"all_reduce sum {algo} n={n}", x, _weights(n) * tri)
            algos[(algo, n)] = pycomm.last_algorithm()
    pycomm.set_algorithm("auto")
    try:
        pycomm.set_algorithm("shm")
        fails.append(f"rank {r}: set_algorithm('shm') accepted on 8 hosts")
    except Exception as exc:  # a usage error, the same on every rank
        if "shm" not in str(exc):
            fails.append(f"rank {r}: set_algorithm('shm') raised {exc!r}")
    pycomm.set_algorithm("auto")
    for n in sizes:
        ctx.progress(f"collectives n={n}")
        ar = torch.arange(n, dtype=torch.int64)
        x = (r * 1000 + ar).to(torch.int32)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        expect(f"all_reduce max n={n}", x, ((w - 1) * 1000 + ar).to(torch.int32))
        x = torch.full((n,), 2 if r % 4 == 0 else 1, dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
        expect(f"all_reduce product n={n}", x, torch.full((n,), 2 ** (w // 4), dtype=torch.int64))

        for src in (0, 5):  # 5: the second rank of host 2
            x = torch.full((n,), r, dtype=torch.int64) + ar
            dist.broadcast(x, src=src)
            expect(f"broadcast src={src} n={n}", x, src + ar)

        x = _weights(n) * (r + 1)
        dist.reduce(x, dst=3)
        if r == 3:
            expect(f"reduce dst=3 n={n}", x, _weights(n) * tri)

        outs = [torch.empty(n, dtype=torch.int64) for _ in range(w)]
        dist.all_gather(outs, r * 10 + ar)
        for j in range(w):
            expect(f"all_gather n={n} part {j}", outs[j], j * 10 + ar)
        flat = torch.empty(w * n, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, r * 10 + ar)
        expect(f"all_gather_into_tensor n={n}", flat,
               torch.cat([j * 10 + ar for j in range(w)]))

        outs = [torch.empty(n, dtype=torch.int64) for _ in range(w)] if r == 7 else None
        dist.gather(r * 10 + ar, outs, dst=7)
        if r == 7:
            for j in range(w):
                expect(f"gather dst=7 n={n} part {j}", outs[j], j * 10 + ar)

        got = torch.empty(n, dtype=torch.int64)
        parts = [j * 3 + ar for j in range(w)] if r == 9 else None
        dist.scatter(got, parts, src=9)
        expect(f"scatter src=9 n={n}", got, r * 3 + ar)

        ins = [_weights(n) * (r + 1) * (j + 1) for j in range(w)]
        got = torch.empty(n)
        dist.reduce_scatter(got, ins)
        expect(f"reduce_scatter n={n}", got, _weights(n) * tri * (r + 1))
        got = torch.empty(n)
        dist.reduce_scatter_tensor(got, torch.cat(ins))
        expect(f"reduce_scatter_tensor n={n}", got, _weights(n) * tri * (r + 1))

        # all-to-all: rank a sends rank b (a + b) % 3 + n values a * 100 + b
        def count(a, b):
            return (a + b) % 3 + n

        ins = [torch.full((count(r, j),), r * 100 + j, dtype=torch.int64) for j in range(w)]
        outs = [torch.empty(count(j, r), dtype=torch.int64) for j in range(w)]
        dist.all_to_all(outs, ins)
        for j in range(w):
            expect(f"all_to_all n={n} from {j}", outs[j], torch.full((count(j, r),), j * 100 + r))
        out = torch.empty(sum(count(j, r) for j in range(w)), dtype=torch.int64)
        dist.all_to_all_single(out, torch.cat(ins), [count(j, r) for j in range(w)],
                               [count(r, j) for j in range(w)])
        expect(f"all_to_all_single uneven n={n}", out,
               torch.cat([torch.full((count(j, r),), j * 100 + r) for j in range(w)]))

        # a ring of isend/irecv: every other link stays on a host, the rest cross hosts
        got = torch.empty(n, dtype=torch.int64)
        works = [dist.isend(r * 7 + ar, dst=(r + 1) % w, tag=n), dist.irecv(got, src=(r - 1) % w, tag=n)]
        for work in works:
            work.wait()
        expect(f"isend/irecv ring n={n}", got, (r - 1) % w * 7 + ar)
        # blocking send/recv across hosts: host k's first rank to host k+1's second rank
        if r % 2 == 0:
            dist.send(r + ar, dst=(r + 3) % w)
        else:
            got = torch.empty(n, dtype=torch.int64)
            dist.recv(got, src=(r - 3) % w)
            expect(f"send/recv n={n}", got, (r - 3) % w + ar)

    # barrier: nobody passes before everyone has arrived (a marker file per rank and round)
    for round_index in range(3):
        ctx.progress(f"barrier round {round_index}")
        open(os.path.join(ctx.tmpdir, f"arrived_{round_index}_{r}"), "w").close()
        dist.barrier()
        missing = [j for j in range(w) if not os.path.exists(os.path.join(ctx.tmpdir, f"arrived_{round_index}_{j}"))]
        if missing:
            fails.append(f"rank {r}: passed barrier round {round_index} before ranks {missing} arrived")
    return {"failures": fails, "algorithms": algos}


@pytest.mark.slow
def test_sixteen_ranks_eight_hosts(make_hosts):
    """16 ranks, 2 on each of 8 hosts (shared memory within a host, TCP across): every
    collective on one group, results against closed forms."""
    hosts = make_hosts(8)
    world = 16
    sizes = (1, 37, 4099)  # one element, fewer than the ranks, not divisible by 16
    res = spawn_run(sixteen_worker, world, args=(sizes,), netns=_placement(hosts, 2), env=_env(True),
                    make_ref=False, timeout_s=240, pg_timeout_s=60,
                    exit_timeout_s=60).check()  # 16 interpreters leaving on 2 cores
    fails = [f for r in range(world) for f in res.returns[r]["failures"]]
    assert not fails, format_failures(fails)
    for r in range(world):
        algos = res.returns[r]["algorithms"]
        for (algo, n), used in algos.items():
            if algo != "auto":
                assert used == algo, f"rank {r}: all_reduce with {algo} fixed ran {used} (n={n})"
        # the big size, left to auto: reduced inside each host first
        assert algos[("auto", 65537)] == "hierarchical", algos
