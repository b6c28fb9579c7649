"""benchmarks/tp_inference.py's arrival split of the time inside the decode's all-reduces:
waiting for the last rank to arrive against the collective's own time after it
(arrival_split, split_summary on hand-made stamps; gather_split on 2 ranks that stamp real
all-reduces on CLOCK_MONOTONIC)."""
import importlib.util
import os
import time

import pytest

from mp_util import spawn_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("tp_inference", os.path.join(ROOT, "benchmarks", "tp_inference.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_rank_that_arrives_last_makes_the_others_wait():
    bench = _bench()
    # call 0: rank 1 enters 50 after rank 0; call 1: rank 0 enters 20 after rank 1
    entries = [[0, 200], [50, 180]]
    exits = [[80, 240], [81, 245]]
    r0, r1 = bench.arrival_split(entries, exits)
    assert r0["wait"] == [50, 0] and r1["wait"] == [0, 20]
    # own = exit - last entry
    assert r0["own"] == [30, 40] and r1["own"] == [31, 45]
    assert r0["last"] == [False, True] and r1["last"] == [True, False]
    # wait + own is the whole time in the call
    for r, split in enumerate((r0, r1)):
        assert [w + o for w, o in zip(split["wait"], split["own"])] == [x - e for e, x in zip(entries[r], exits[r])]


def test_equal_arrivals_wait_nothing():
    bench = _bench()
    split = bench.arrival_split([[10, 100], [10, 100], [10, 100]], [[15, 130], [17, 120], [16, 101]])
    assert [s["wait"] for s in split] == [[0, 0]] * 3
    assert [s["own"] for s in split] == [[5, 30], [7, 20], [6, 1]]
    assert all(s["last"] == [True, True] for s in split)


def test_mismatched_call_counts_raise():
    bench = _bench()
    with pytest.raises(ValueError, match=r"different numbers of calls.*rank 0 \(2, 2\), rank 1 \(1, 1\)"):
        bench.arrival_split([[0, 10], [0]], [[5, 15], [5]])
    # entries and exits of one rank disagree
    with pytest.raises(ValueError, match="different numbers of calls"):
        bench.arrival_split([[0, 10], [0, 10]], [[5, 15], [5]])
    with pytest.raises(ValueError, match="2 ranks of entries, 1 of exits"):
        bench.arrival_split([[0], [0]], [[5]])


def test_an_exit_before_the_last_arrival_means_no_shared_clock():
    bench = _bench()
    # rank 0 leaves at 40, before rank 1 entered at 50: no all-reduce can do that
    with pytest.raises(ValueError, match="rank 0 left call 0 at 40, before the last rank entered it at 50"):
        bench.arrival_split([[0], [50]], [[40], [60]])
    # within the tolerance it counts as no time of its own
    r0, r1 = bench.arrival_split([[0], [50]], [[48], [60]], tolerance=5)
    assert (r0["wait"], r0["own"], r1["wait"], r1["own"]) == ([50], [0], [0], [10])
    with pytest.raises(ValueError, match="exits .* before it enters"):
        bench.arrival_split([[10], [10]], [[5], [20]])


def test_split_summary_gives_shares_of_each_ranks_decode_and_medians_per_call():
    bench = _bench()
    us = 1000  # the stamps are nanoseconds
    reps = [
        # repetition 0: rank 1 arrives 100 us late to both calls; decode 10 ms on both ranks
        [([0, 1000 * us], [150 * us, 1150 * us], 0.010), ([100 * us, 1100 * us], [160 * us, 1160 * us], 0.010)],
        # repetition 1: equal arrivals, 20 us each on rank 0; decode 4 ms on rank 0, 5 ms on rank 1
        [([0, 500 * us], [20 * us, 520 * us], 0.004), ([0, 500 * us], [30 * us, 530 * us], 0.005)],
    ]
    r0, r1 = bench.split_summary(reps)
    assert r0["calls_per_decode"] == r1["calls_per_decode"] == 2
    # rank 0: waits 100 + 100 us of 10 ms (2%) and 0 of 4 ms; own 50 + 50 us (1%) and 40 us of 4 ms (1%)
    assert r0["wait_share_of_decode"] == pytest.approx((0.02 + 0.0) / 2)
    assert r0["own_share_of_decode"] == pytest.approx(0.01)
    assert r0["in_call_share_of_decode"] == pytest.approx((0.03 + 0.01) / 2)
    # per call: waits 100, 100, 0, 0 us; own 50, 50, 20, 20 us
    assert r0["wait_us_median"] == pytest.approx(50)
    assert r0["own_us_median"] == pytest.approx(35)
    assert r0["in_call_us_median"] == pytest.approx(85)
    assert r0["last_to_arrive"] == 0.5
    # rank 1 never waits and is last in every call (tied in repetition 1)
    assert r1["wait_share_of_decode"] == 0 and r1["wait_us_median"] == 0
    assert r1["own_us_median"] == pytest.approx(45)  # 60, 60, 30, 30
    assert r1["own_share_of_decode"] == pytest.approx((0.012 + 0.012) / 2)
    assert r1["last_to_arrive"] == 1.0
    with pytest.raises(ValueError, match="repetition 1: arrival_split: the ranks made different numbers"):
        bench.split_summary([reps[0], [([0], [5], 0.001), ([0, 1], [5, 6], 0.001)]])


def test_one_long_wait_shows_in_the_mean_not_the_median():
    bench = _bench()
    us = 1000
    # rank 1 arrives 900 us late to the last of 4 calls, on time to the others; 10 us each after the last arrival
    entries = [[0, 100 * us, 200 * us, 300 * us], [0, 100 * us, 200 * us, 1200 * us]]
    exits = [[e + 10 * us for e in entries[1]]] * 2
    r0, r1 = bench.split_summary([[(entries[0], exits[0], 0.01), (entries[1], exits[1], 0.01)]])
    assert r0["wait_us_median"] == 0 and r0["wait_us_mean"] == pytest.approx(225)
    assert r0["in_call_us_median"] == pytest.approx(10) and r0["in_call_us_mean"] == pytest.approx(235)
    assert r0["wait_share_of_decode"] == pytest.approx(0.09)
    assert r1["wait_us_mean"] == 0 and r1["own_us_mean"] == pytest.approx(10)


def _gather_worker(ctx, mismatch):
    """Two timed repetitions of 3 all-reduces; rank 1 enters each call at least 10 ms
    after rank 0 entered it (it waits for rank 0's file, then sleeps), so rank 0 waits."""
    import torch
    import torch.distributed as dist

    bench = _bench()
    x = torch.ones(256)
    stamps = []
    for rep in range(2):
        entries, exits = [], []
        d0 = time.perf_counter()
        for i in range(3):
            tag = f"in{rep}-{i}"
            if ctx.rank == 1:
                assert ctx.wait_done(0, 60, tag), "rank 0 never entered"
                time.sleep(0.01)
            t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            if ctx.rank == 0:
                ctx.mark_done(tag)
            dist.all_reduce(x)
            t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            entries.append(t)
            exits.append(t1)
        if mismatch and ctx.rank == 1 and rep == 1:
            entries, exits = entries[:2], exits[:2]
        stamps.append((entries, exits, time.perf_counter() - d0))
    try:
        return bench.gather_split(dist, stamps)
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_gather_split_on_two_ranks(backend):
    rows = spawn_run(_gather_worker, 2, backend=backend, args=(False,), make_ref=False, timeout_s=120).check().returns
    assert rows[0] == rows[1]  # every rank gets every rank's split
    r0, r1 = rows[0]
    assert r0["calls_per_decode"] == r1["calls_per_decode"] == 3
    # rank 1 is the last to arrive in every call, 10 ms or more after rank 0
    assert r1["last_to_arrive"] == 1.0 and r0["last_to_arrive"] == 0.0
    assert r1["wait_us_median"] == 0 and r1["wait_share_of_decode"] == 0
    assert r0["wait_us_median"] >= 10_000
    # rank 0's 3 calls of a repetition wait at least 30 ms of it: most of its time
    assert r0["wait_share_of_decode"] > 0.5
    assert r0["own_us_median"] >= 0 and r0["in_call_us_median"] >= r0["wait_us_median"]


def test_gather_split_fails_on_every_rank_when_the_call_counts_differ():
    msgs = spawn_run(_gather_worker, 2, backend="pycomm", args=(True,), make_ref=False, timeout_s=120).check().returns
    for msg in msgs.values():
        assert msg == ("tp_inference: the ranks made different numbers of timed all-reduce calls per repetition: "
                       "rank 0 [3, 3], rank 1 [3, 2]")
