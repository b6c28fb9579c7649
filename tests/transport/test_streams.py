"""Several TCP streams per peer and several I/O threads (PYCOMM_SOCKETS_PER_PEER,
PYCOMM_IO_THREADS), end to end: one spawned 3-rank group over TCP with 4 streams
per peer and 2 I/O threads runs every network all-reduce algorithm and every
other collective on sizes that do and do not split into stripes (tiny, odd,
9 MiB), send/recv with tags received out of order, and then loses a rank
(SIGKILL mid-transfer): the survivors fail, naming it, within the timeout. The
transport-level cases (ordering, parking, mismatches, a peer lost on every
stream) are in tests/cpp/transport_test.cc; the knobs and the auto choice below."""
import datetime
import os
import signal
import time

import pytest

from test_failures import _spawn

STREAMS, THREADS, WORLD = 4, 2, 3
TIMEOUT_S = 20
# Elements (float32): empty, tiny, odd below the striping threshold (128 KiB),
# odd just above it, odd 9 MiB.
COUNTS = (0, 1, 7, 32771, (9 << 20) // 4 + 3)


def _pattern(n, rank, salt=0):
    import torch

    return (torch.arange(n, dtype=torch.float32) % 97) + rank + salt


def _tcp_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _streams_worker(rank, world, q, rdzv):
    os.environ.update({"PYCOMM_TRANSPORT": "tcp", "PYCOMM_SOCKETS_PER_PEER": str(STREAMS),
                       "PYCOMM_IO_THREADS": str(THREADS)})
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    failures = []

    def check(what, ok):
        if not ok:
            failures.append(what)

    dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    # A second group over the same ranks opens STREAMS sockets to each peer.
    before = _tcp_sockets()
    sub = dist.new_group(list(range(world)), backend="pycomm")
    opened = _tcp_sockets() - before
    check(f"a group opens {STREAMS} sockets per peer: {opened} new sockets", opened == STREAMS * (world - 1))
    total = world * (world - 1) / 2  # sum of ranks
    for algo in ("ring", "sharded", "tree", "auto"):
        pycomm.set_algorithm(algo)
        for n in COUNTS:
            t = _pattern(n, rank)
            dist.all_reduce(t)
            check(f"all_reduce {algo} n={n}", torch.equal(t, _pattern(n, 0) * world + total))
    for n in COUNTS:
        t = _pattern(n, rank) if rank == 1 else torch.zeros(n)
        dist.broadcast(t, src=1)
        check(f"broadcast n={n}", torch.equal(t, _pattern(n, 1)))
        t = _pattern(n, rank)
        dist.reduce(t, dst=2)
        if rank == 2:
            check(f"reduce n={n}", torch.equal(t, _pattern(n, 0) * world + total))
        out = torch.empty(n * world)
        dist.all_gather_into_tensor(out, _pattern(n, rank))
        check(f"all_gather n={n}", torch.equal(out, torch.cat([_pattern(n, r) for r in range(world)])))
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, torch.cat([_pattern(n, rank, salt=r) for r in range(world)]))
        check(f"reduce_scatter n={n}", torch.equal(out, _pattern(n, 0, salt=rank) * world + total))
        out = torch.empty(n * world)
        dist.all_to_all_single(out, torch.cat([_pattern(n, rank, salt=10 * r) for r in range(world)]))
        check(f"all_to_all n={n}", torch.equal(out, torch.cat([_pattern(n, r, salt=10 * rank)
                                                               for r in range(world)])))
    dist.barrier(group=sub)
    # Tags received in another order than sent, over a striped, a tiny and an odd message.
    sizes = {1: COUNTS[-1], 2: 5, 3: 50001}
    if rank == 0:
        works = [dist.isend(_pattern(sizes[tag], 0, salt=tag), dst=1, tag=tag) for tag in (1, 2, 3)]
        for w in works:
            w.wait()
    elif rank == 1:
        got = {tag: torch.empty(sizes[tag]) for tag in sizes}
        works = [dist.irecv(got[tag], src=0, tag=tag) for tag in (3, 1, 2)]
        for w in works:
            w.wait()
        for tag in sizes:
            check(f"recv tag {tag}", torch.equal(got[tag], _pattern(sizes[tag], 0, salt=tag)))
    dist.barrier()
    # Rank 2 dies mid-transfer; the survivors fail, naming it, within the timeout.
    result = {"failures": failures}
    big = torch.ones(4 << 20)  # 16 MiB: striped over every stream
    for step in range(1000):
        if rank == world - 1 and step == 2:
            q.put((rank, result))
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            dist.all_reduce(big)
        except Exception as e:  # noqa: BLE001
            result.update(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
            break
    q.put((rank, result))


def test_every_collective_over_several_streams(tmp_path):
    results = _spawn(_streams_worker, WORLD, (f"file://{tmp_path}/rdzv",))
    assert sorted(results) == list(range(WORLD)), f"ranks reported: {results}"
    for rank in range(WORLD):
        assert results[rank]["failures"] == [], (rank, results[rank]["failures"])
    for rank in range(WORLD - 1):
        res = results[rank]
        assert res.get("error"), res
        assert "rank 2" in res["error"], res["error"]
        assert res["seconds"] < TIMEOUT_S + 5, res


def test_stream_knobs_reach_the_group_config():
    from pycomm import config

    cfg = config.load_config({"PYCOMM_SOCKETS_PER_PEER": "4", "PYCOMM_IO_THREADS": "3", "PYCOMM_COST_MODEL": "default"})
    options = config.group_config(cfg, timeout=datetime.timedelta(seconds=5), bind_address="127.0.0.1",
                                  global_ranks=[], store_prefix="p/")
    assert (options.sockets_per_peer, options.io_threads) == (4, 3)
    # auto on loopback (no link speed): one stream, one thread, as before the knobs existed.
    auto = config.load_config({"PYCOMM_COST_MODEL": "default"})
    assert (auto.sockets_per_peer, auto.io_threads) == ("auto", "auto")
    assert config.resolve_streams(auto, "127.0.0.1") == (1, 1)
    # Streams set, threads auto: one per stream up to half the CPUs.
    assert config.resolve_streams(config.load_config({"PYCOMM_SOCKETS_PER_PEER": "4"}), "127.0.0.1", cpus=16) == (4, 4)
    assert config.resolve_streams(config.load_config({"PYCOMM_SOCKETS_PER_PEER": "4"}), "127.0.0.1", cpus=2) == (4, 1)
    for name, bad in (("PYCOMM_SOCKETS_PER_PEER", "0"), ("PYCOMM_SOCKETS_PER_PEER", "17"),
                      ("PYCOMM_IO_THREADS", "many")):
        with pytest.raises(ValueError, match=name):
            config.load_config({name: bad})


def test_auto_fills_the_link_with_the_fewest_streams(tmp_path, monkeypatch):
    from pycomm import config, streams

    # min(B, s x per-stream): 100 Gbit/s at 12 Gbit/s per stream needs 9 streams.
    assert streams.choose_streams(100.0, 12.0, cpus=32) == (9, 9)
    assert streams.choose_streams(100.0, 12.0, cpus=4) == (9, 2)
    assert streams.choose_streams(10.0, 12.0, cpus=32) == (1, 1)
    assert streams.choose_streams(None, 12.0) == (1, 1) and streams.choose_streams(100.0, None) == (1, 1)
    assert streams.choose_streams(1000.0, 1.0, cpus=64) == (16, 16)
    assert streams.stream_gbps(2, 100.0, 12.0) == 24.0 and streams.stream_gbps(16, 100.0, 12.0) == 100.0
    # The per-stream figure comes from the calibration file.
    path = tmp_path / "cal.json"
    path.write_text('{"model": {"alpha": 1e-5, "beta": 1e-10, "gamma": 1e-10, "delta": 1e-6, '
                    '"shm_alpha": 1e-6, "shm_beta": 1e-11}, "streams": {"per_stream_gbps": 12.5}}')
    assert config.load_config({"PYCOMM_COST_MODEL": str(path)}).per_stream_gbps == 12.5
    assert config.load_config({"PYCOMM_COST_MODEL": "default"}).per_stream_gbps is None
    # ... whatever this host's cache holds (a developer who ran --calibrate has one): the
    # built-in constants measured nothing. Unset, the cache is what counts.
    cache = tmp_path / "cache"
    (cache / "pycomm").mkdir(parents=True)
    env = {"XDG_CACHE_HOME": str(cache)}
    with open(config.cost_cache_path(env), "w") as handle:
        handle.write(path.read_text())
    assert config.load_config(dict(env, PYCOMM_COST_MODEL="default")).per_stream_gbps is None
    assert config.load_config(env).per_stream_gbps == 12.5
    # A link's speed is the kernel's, in Mbit/s; loopback has none, nor has a virtual
    # interface (a veth reports 10000 whatever its tc limit).
    assert streams.link_gbps("127.0.0.1") is None
    fake = tmp_path / "net"
    (fake / "eth9").mkdir(parents=True)
    (fake / "eth9" / "speed").write_text("25000\n")
    monkeypatch.setattr(streams, "_interface_of", lambda address: "eth9")
    assert streams.link_gbps("10.0.0.1", str(fake)) is None  # no device: virtual
    (fake / "eth9" / "device").mkdir()
    assert streams.link_gbps("10.0.0.1", str(fake)) == 25.0
    (fake / "eth9" / "speed").write_text("-1\n")
    assert streams.link_gbps("10.0.0.1", str(fake)) is None
