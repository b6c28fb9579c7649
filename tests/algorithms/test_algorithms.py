"""Algorithms over the in-process loopback transport: N threads as ranks.

Sweeps world sizes 1..9, counts {0, 1, n-1, n+1, 10007, 1<<20}, every dtype and
op, with expectations in closed form where one exists and otherwise a reduction
of the same inputs computed by torch. Small segment sizes force multi-segment
pipelines through every algorithm. With "shm" the threads share a node-local
shared-memory arena (slots of the segment size, rounded up to 4 KiB) and every
collective takes its shared-memory path.
"""
import functools

import pytest
import torch

from pycomm import _C

import loopback

ALGOS = ["ring", "tree", "sharded", "shm"]
# The other collectives: over the transport ("auto") or the shared-memory arena ("shm").
PATHS = ["auto", "shm"]
WORLDS = list(range(1, 10))
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]


def counts_for(n):
    return sorted({0, 1, max(n - 1, 0), n + 1, 10007, 1 << 20})


def supported(dtype, op):
    if op == "avg":
        return dtype in FLOATS
    if op in ("band", "bor", "bxor"):
        return dtype not in FLOATS
    return True


def run(collective, tensors, op="sum", algo="auto", root=0, segment=4096):
    return loopback.collective(collective, tensors, op, algo, root, segment, 60.0)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", WORLDS)
def test_allreduce_counts_closed_form(n, algo):
    """Rank r contributes (r+1)*(i%7+1); the sum is (i%7+1)*n(n+1)/2."""
    for count in counts_for(n):
        pattern = (torch.arange(count) % 7 + 1).to(torch.float32)
        tensors = [pattern * (r + 1) for r in range(n)]
        segment = 4096 if count < (1 << 20) else 256 * 1024
        outputs = run("allreduce", tensors, "sum", algo, segment=segment)
        expected = pattern * (n * (n + 1) / 2)
        for r, out in enumerate(outputs):
            assert torch.equal(out, expected), f"n={n} {algo} count={count} rank {r}"


def make_inputs(n, count, dtype, op, seed):
    """Per-rank inputs small enough that no op overflows any dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.randint(0, 2, (count,), generator=g).bool() for _ in range(n)]
    if op == "product":
        # Exactly one rank holds a 2 (or -1 for signed types) per element: the product is known.
        holder = torch.randint(0, n, (count,), generator=g)
        factor = 2 if dtype == torch.uint8 else -1 if dtype != torch.float32 else 2
        return [torch.where(holder == r, factor, 1).to(dtype) for r in range(n)]
    if op in ("band", "bor", "bxor"):
        return [torch.randint(0, 100, (count,), generator=g).to(dtype) for _ in range(n)]
    low = 0 if dtype in (torch.uint8,) else -5
    return [torch.randint(low, 6, (count,), generator=g).to(dtype) for _ in range(n)]


def reference(inputs, op, dtype):
    wide = [t.to(torch.float64) if dtype in FLOATS else t.to(torch.int64) for t in inputs]
    n = len(inputs)
    if dtype == torch.bool:
        stack = torch.stack([t.to(torch.int64) for t in inputs])
        if op in ("sum", "max", "bor"):
            return stack.amax(0).bool()
        if op in ("product", "min", "band"):
            return stack.amin(0).bool()
        return (stack.sum(0) % 2).bool()  # bxor
    stack = torch.stack(wide)
    if op == "sum":
        result = stack.sum(0)
    elif op == "avg":
        result = stack.sum(0) / n
    elif op == "product":
        result = stack.prod(0)
    elif op == "min":
        result = stack.amin(0)
    elif op == "max":
        result = stack.amax(0)
    else:
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        result = functools.reduce(fn, wide)
    return result.to(dtype)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_allreduce_every_dtype_and_op(n, algo):
    failures = []
    for dtype in DTYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for count in (n + 1, 3001):
                inputs = make_inputs(n, count, dtype, op, seed=n * 1000 + count)
                expected = reference(inputs, op, dtype)
                outputs = run("allreduce", [t.clone() for t in inputs], op, algo, segment=512)
                for r, out in enumerate(outputs):
                    if dtype in FLOATS:
                        ok = torch.allclose(out.double(), expected.double(), rtol=1e-2, atol=1e-2)
                    else:
                        ok = torch.equal(out, expected)
                    if not ok:
                        failures.append(f"{dtype} {op} count={count} rank={r}")
                # Every rank must end with bit-identical results.
                for out in outputs[1:]:
                    if not torch.equal(out, outputs[0]):
                        failures.append(f"{dtype} {op} count={count}: ranks disagree")
    assert not failures, failures[:20]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_sum_rounds_like_torch(dtype):
    """Two ranks: each element is rounded once from the float32 sum, as torch does."""
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(50000, generator=g) * 100).to(dtype)
    b = (torch.randn(50000, generator=g) * 100).to(dtype)
    expected = (a.float() + b.float()).to(dtype)
    for algo in ALGOS:
        outputs = run("allreduce", [a.clone(), b.clone()], "sum", algo)
        assert torch.equal(outputs[0], expected), algo
        assert torch.equal(outputs[1], expected), algo


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLDS)
def test_broadcast_every_root(n, path):
    for count in counts_for(n)[:-1]:
        for root in range(n):
            tensors = [torch.full((count,), float(r)) if r != root else torch.arange(count, dtype=torch.float32)
                       for r in range(n)]
            outputs = run("broadcast", tensors, algo=path, root=root, segment=1024)
            for r, out in enumerate(outputs):
                assert torch.equal(out, torch.arange(count, dtype=torch.float32)), (n, count, root, r)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLDS)
def test_reduce_every_root(n, path):
    for count in (0, 1, n + 1, 10007):
        for root in range(n):
            tensors = [torch.full((count,), r + 1, dtype=torch.int64) for r in range(n)]
            outputs = run("reduce", tensors, "sum", path, root=root, segment=512)
            assert torch.equal(outputs[root], torch.full((count,), n * (n + 1) // 2, dtype=torch.int64))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLDS)
def test_allgather(n, path):
    for count in counts_for(n)[:-1]:
        tensors = [torch.arange(count, dtype=torch.int32) + 100000 * r for r in range(n)]
        outputs = run("allgather", tensors, algo=path, segment=2048)
        expected = torch.cat(tensors)
        for out in outputs:
            assert torch.equal(out, expected), (n, count)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLDS)
def test_reduce_scatter(n, path):
    for part in (0, 1, n + 1, 4099):
        tensors = [torch.arange(part * n, dtype=torch.float64) * (r + 1) for r in range(n)]
        outputs = run("reduce_scatter", tensors, "sum", path, segment=1024)
        full = torch.arange(part * n, dtype=torch.float64) * (n * (n + 1) / 2)
        for r, out in enumerate(outputs):
            assert torch.equal(out, full[r * part:(r + 1) * part]), (n, part, r)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLDS)
def test_alltoall(n, path):
    for part in (0, 1, 513):
        # rank r's block for rank j holds 1000*r + j
        tensors = [torch.cat([torch.full((part,), 1000 * r + j, dtype=torch.int64) for j in range(n)])
                   for r in range(n)]
        outputs = run("alltoall", tensors, algo=path, segment=4096)
        for j, out in enumerate(outputs):
            expected = torch.cat([torch.full((part,), 1000 * r + j, dtype=torch.int64) for r in range(n)])
            assert torch.equal(out, expected), (n, part, j)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLDS)
def test_barrier_completes(n, path):
    run("barrier", [torch.zeros(1) for _ in range(n)], algo=path)


def test_auto_selection_follows_size():
    # Latency-bound sizes never take the ring (2(n-1) sequential hops); bandwidth-bound
    # sizes never take the tree (its root link carries log2(n) copies).
    assert _C._select_algorithm(8, 2) == "tree"
    for n in (3, 4, 5, 8, 9):
        assert _C._select_algorithm(8, n) in ("tree", "sharded"), n
        assert _C._select_algorithm(64 << 20, n) in ("ring", "sharded"), n
    assert _C._select_algorithm(64 << 20, 2) == "ring"
    assert _C._select_algorithm(64 << 20, 8) == "sharded"  # halving/doubling: fewer hops, same bytes


def test_stats_count_ring_bytes_exactly():
    """A ring all-reduce moves 2(n-1)/n of the buffer per rank: 2(n-1)*S in all."""
    import pycomm

    n, count = 4, 4096
    pycomm.reset_stats()
    run("allreduce", [torch.ones(count) for _ in range(n)], "sum", "ring", segment=1024)
    stats = pycomm.stats()
    assert stats["bytes_sent"] == 2 * (n - 1) * count * 4
    assert stats["bytes_received"] == stats["bytes_sent"]
    pycomm.reset_stats()
    assert pycomm.stats()["bytes_sent"] == 0


def test_auto_selection_takes_shm_on_one_host():
    for n in (2, 3, 8):
        assert _C._select_algorithm(8, n, one_host=True) == "shm"
        assert _C._select_algorithm(64 << 20, n, one_host=True) == "shm"
    assert _C._select_algorithm(8, 1, one_host=True) != "shm"  # nothing to exchange


def test_auto_selection_takes_hierarchical_across_hosts_with_shared_ones():
    # 4 ranks on 2 hosts: hierarchical; every rank alone on its host: a network algorithm.
    for nbytes in (8, 64 << 20):
        assert _C._select_algorithm(nbytes, 4, hosts=2) == "hierarchical"
        assert _C._select_algorithm(nbytes, 4, hosts=4) in ("ring", "sharded", "tree")


def test_algorithm_names_come_from_one_table():
    """The C++ table is the only list: config.py accepts exactly its names (it
    rejected PYCOMM_ALGO=hierarchical, which the C++ accepted)."""
    from pycomm import config

    names = _C.allreduce_algorithms()
    assert names[0] == "auto"
    assert set(names) == {"auto", "ring", "tree", "sharded", "shm", "hierarchical"}
    assert config.ALGORITHMS == tuple(names)
    for name in names:
        assert config.load_config({"PYCOMM_ALGO": name}).algorithm == name
    with pytest.raises(ValueError, match="PYCOMM_ALGO='bogus' is not one of auto, ring"):
        config.load_config({"PYCOMM_ALGO": "bogus"})


def test_group_config_carries_every_knob():
    """config.py is the only reader of PYCOMM_*: the C++ core gets them in GroupConfig."""
    import datetime

    from pycomm import config

    cfg = config.load_config({"PYCOMM_ALGO": "tree", "PYCOMM_SEGMENT_BYTES": "4096", "PYCOMM_CHECK": "1",
                              "PYCOMM_TRANSPORT": "tcp", "PYCOMM_SHM_SPREAD": "0", "PYCOMM_DEBUG": "1"})
    options = config.group_config(cfg, timeout=datetime.timedelta(seconds=7), bind_address="10.0.0.1",
                                  global_ranks=[3, 5], store_prefix="p/")
    assert isinstance(options, _C.GroupConfig)
    assert (options.algorithm, options.segment_bytes, options.check_calls, options.transport) == \
        ("tree", 4096, True, "tcp")
    assert (options.shm_spread, options.debug) == (False, True)
    assert options.timeout == datetime.timedelta(seconds=7)
    assert (options.bind_address, list(options.global_ranks), options.store_prefix) == ("10.0.0.1", [3, 5], "p/")
    defaults = config.load_config({})
    assert (defaults.shm_spread, defaults.debug) == (True, False)


# Threads sharing an arena whose calls differ (ShmArena::Call, compared where a
# peer's post is waited for): every rank fails at once naming the difference;
# none finishes "successfully" while another waits. Slots of 4 KiB (1024 float32
# per step, 4 in flight), so the sizes below span one step against many.
ARENA_MISMATCHES = [
    ("allreduce", [2088, 512], ["float32"] * 2),      # 3 steps vs 1 (the review's repro)
    ("allreduce", [10000, 100], ["float32"] * 2),     # more steps than slots vs 1
    ("allreduce", [0, 5], ["float32"] * 2),           # an empty call vs one step
    ("allreduce", [3000, 3000, 700], ["float32"] * 3),  # split reduction, one rank differs
    ("allreduce", [3000] * 3, ["float32", "float32", "int32"]),  # same bytes, other dtype
    ("broadcast", [5000, 50], ["float32"] * 2),       # the root reads nobody's slot
    ("broadcast", [50, 5000, 5000], ["float32"] * 3),
    ("allgather", [2000, 100], ["float32"] * 2),
    (["allreduce", "broadcast"], [2000, 2000], ["float32"] * 2),  # same bytes, other collective
]


@pytest.mark.parametrize("collective,counts,dtypes", ARENA_MISMATCHES)
def test_shm_calls_that_differ_fail_on_every_rank(collective, counts, dtypes):
    import time

    module = loopback.build()  # built before the clock starts
    start = time.monotonic()
    collectives = collective if isinstance(collective, list) else [collective] * len(counts)
    errors = module.arena_calls(collectives, counts, dtypes, 4096, 20.0)
    seconds = time.monotonic() - start
    for rank, err in enumerate(errors):
        assert err, f"rank {rank} of {counts} {dtypes}: {collectives[rank]} succeeded"
        assert f"pycomm {collectives[rank]} (shm): rank" in err, err
        assert any(why in err for why in ("(tensor sizes differ between ranks?)", "(dtypes differ between ranks?)",
                                          "(ranks called different collectives, or in a different order?)")), err
        assert "timed out" not in err, err
    assert seconds < 10, f"{seconds:.1f} s: the ranks waited (timeout 20 s)"


def test_shm_calls_that_match_succeed():
    for collective in ("allreduce", "broadcast", "allgather"):
        for counts in ([0, 0], [2088] * 2, [10000] * 3):
            assert loopback.build().arena_calls([collective] * len(counts), counts, ["float32"] * len(counts), 4096, 20.0) \
                == [""] * len(counts), (collective, counts)
