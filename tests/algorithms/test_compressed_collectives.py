"""Compressed collectives (csrc/algorithms/allreduce_quantized.cc, allreduce_sparse.cc) over
the loopback transport, threads as ranks, worlds 1..9.

References are computed here with the kernels (pycomm._C.kernels) and torch:

* quantized, deterministic rounding: the owners' chunks are whole blocks, so phase 1 equals
  quantizing each rank's whole buffer, the owner sums the decoded buffers in rank order, and
  phase 2 equals quantizing that sum: the result is ``dequantize(quantize(sum_r
  dequantize(quantize(x_r))))``, bit for bit;
* sparse, float32 values, owners keeping every entry: the dense sum of all pairs, added in
  rank order, bit for bit;
* with error feedback: nothing is lost -- sum_r (input_r + old residual_r) equals the result
  plus sum_r new residual_r, to float rounding.
"""
import pytest
import torch

from pycomm import _C

import loopback

K = _C.kernels
WORLDS = list(range(1, 10))


def counts_for(n):
    return sorted({0, 1, max(n - 1, 0), n + 1, 1001, 10007})


def quantized(tensors, residuals=None, bits=8, block=256, stochastic=False, seed=0, segments=()):
    outs = [t.clone() for t in tensors]
    loopback.allreduce_quantized(outs, residuals, bits, block, stochastic, seed, list(segments), 60.0)
    return outs


def codec(x, bits, block, segments=()):
    """Quantize + dequantize with blocks restarting at every segment."""
    parts = x.split(list(segments)) if segments else [x]
    return torch.cat([K.dequantize(K.quantize(p.contiguous(), bits, block), p.numel(), bits, block)
                      for p in parts]) if x.numel() else x.clone()


def split_segments(count, parts, seed):
    """`parts` random segment lengths summing to count (some may be 0)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, count + 1, (parts - 1,), generator=g).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [count])]


def ownership(segments, count, n, align=1):
    """Python mirror of csrc/algorithms/ownership.h: per owner, [(global, length)]."""
    pieces, at = [[] for _ in range(n)], 0
    for length in (segments or [count]):
        units = -(-length // align)
        base, extra = divmod(units, n)
        lo = 0
        for c in range(n):
            hi = lo + base + (1 if c < extra else 0)
            a, b = min(length, lo * align), min(length, hi * align)
            if b > a:
                pieces[c].append((at + a, b - a))
            lo = hi
        at += length
    return pieces


def inputs(n, count, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(count, generator=g) * (r + 1) for r in range(n)]


@pytest.mark.parametrize("n", WORLDS)
def test_quantized_matches_reference(n):
    for count in counts_for(n):
        for bits, block in ((8, 256), (4, 7), (1, 32), (8, 1)):
            for segments in ([], split_segments(count, 5, count + bits)):
                xs = inputs(n, count, 10 * n + bits)
                outs = quantized(xs, bits=bits, block=block, segments=segments)
                acc = torch.zeros(count)
                for r, x in enumerate(xs):
                    d = codec(x, bits, block, segments)
                    acc = d if r == 0 else acc + d
                expected = codec(acc, bits, block, segments)
                for r, out in enumerate(outs):
                    assert torch.equal(out, expected), \
                        f"n={n} count={count} bits={bits} block={block} segments={segments} rank {r}"


def test_quantized_result_depends_on_the_segment_alone():
    """Stochastic rounding and error feedback: a segment's result and residual are the same
    whatever other segments share the buffer (the property DDP's bucket rebuild relies on;
    keys default to segment positions, so the segment stays at position 0 here)."""
    n, block = 3, 16
    a, b = inputs(n, 1000, 1), inputs(n, 333, 2)
    alone_res = [torch.full((1000,), 0.01) for _ in range(n)]
    alone = quantized(a, alone_res, bits=4, block=block, stochastic=True, seed=5, segments=[1000])
    pair_res = [torch.cat([torch.full((1000,), 0.01), torch.zeros(333)]) for _ in range(n)]
    pair = quantized([torch.cat([x, y]) for x, y in zip(a, b)], pair_res, bits=4, block=block,
                     stochastic=True, seed=5, segments=[1000, 333])
    for r in range(n):
        assert torch.equal(pair[r][:1000], alone[r])
        assert torch.equal(pair_res[r][:1000], alone_res[r])
    # without segments the blocks and owners follow the whole buffer: results differ
    whole = quantized([torch.cat([x, y]) for x, y in zip(a, b)], bits=4, block=block,
                      stochastic=True, seed=5)
    assert not torch.equal(whole[0][:1000], alone[0])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bits", [8, 4, 1])
def test_quantized_error_feedback_conserves(n, bits):
    count = 5003
    stochastic = bits != 1
    residuals = [torch.zeros(count) for _ in range(n)]
    for step in range(3):
        xs = inputs(n, count, 100 * step + n)
        before = sum(x + e for x, e in zip(xs, residuals))
        outs = quantized(xs, residuals, bits=bits, block=64, stochastic=stochastic, seed=step)
        assert all(torch.equal(o, outs[0]) for o in outs), "ranks disagree"
        after = outs[0] + sum(residuals)
        scale = before.abs().max().item()
        assert (after - before).abs().max().item() <= 1e-5 * scale * n, f"step {step}: mass lost"
        # the result approximates the sum within what the two quantizations can lose
        assert (outs[0] - before).abs().max().item() <= scale * (n + 2), "result far from the sum"
    # residuals are not all zero: there was something to feed back
    assert any(e.abs().sum() > 0 for e in residuals)


def test_quantized_stochastic_is_unbiased_on_average():
    n, count, draws = 3, 512, 200
    xs = inputs(n, count, 7)
    exact = sum(xs)
    total = torch.zeros(count)
    for seed in range(draws):
        total += quantized(xs, bits=4, block=32, stochastic=True, seed=seed)[0]
    mean_err = (total / draws - exact).abs().mean().item()
    one_err = (quantized(xs, bits=4, block=32, stochastic=True, seed=0)[0] - exact).abs().mean().item()
    assert mean_err < one_err / 5, (mean_err, one_err)


def test_quantized_usage_errors():
    with pytest.raises(ValueError, match="bits"):
        quantized([torch.zeros(10)], bits=3)
    with pytest.raises(ValueError, match="block"):
        quantized([torch.zeros(10)], block=0)


# ---------------------------------------------------------------------------
# sparse
# ---------------------------------------------------------------------------

def sparse_inputs(n, count, nnz, seed):
    g = torch.Generator().manual_seed(seed)
    indices, values = [], []
    for r in range(n):
        k = min(nnz, count)
        idx = torch.sort(torch.randperm(count, generator=g)[:k]).values if count else torch.zeros(0, dtype=torch.long)
        indices.append(idx.contiguous())
        values.append((torch.randn(k, generator=g) * (r + 1)).contiguous())
    return indices, values


def dense_sum(indices, values, count, round_to=None):
    total = torch.zeros(count)
    for idx, val in zip(indices, values):
        if round_to is not None:
            val = val.to(round_to).float()
        total.index_add_(0, idx, val)  # rank order, unique indices per rank
    return total


def sparse(indices, values, count, residuals=None, value_dtype="float32", keep=0.0, segments=()):
    return loopback.allreduce_sparse(indices, values, count, residuals, value_dtype, keep,
                                     list(segments), 60.0)


@pytest.mark.parametrize("n", WORLDS)
def test_sparse_sum_is_exact(n):
    for count in counts_for(n):
        for nnz in (0, 1, 7, 300):
            indices, values = sparse_inputs(n, count, nnz, n * 1000 + count + nnz)
            segments = split_segments(count, 4, nnz) if nnz % 2 else []
            outs, sent, kept = sparse(indices, values, count, segments=segments)
            expected = dense_sum(indices, values, count)
            for r, out in enumerate(outs):
                assert torch.equal(out, expected), f"n={n} count={count} nnz={nnz} rank {r}"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 9])
@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
def test_sparse_half_values(n, value_dtype):
    count = 4099
    dt = getattr(torch, value_dtype)
    indices, values = sparse_inputs(n, count, 100, n)
    outs, _, _ = sparse(indices, values, count, value_dtype=value_dtype)
    # the owner sums the rounded values in float32, the sum is rounded once more on the wire
    expected = dense_sum(indices, values, count, round_to=dt).to(dt).float()
    for out in outs:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("n", [1, 2, 3, 6, 9])
@pytest.mark.parametrize("segmented", [False, True])
def test_sparse_owner_keeps_its_largest(n, segmented):
    count, keep = 10007, 0.01
    segments = [5000, 7, 0, 3000, 2000] if segmented else []
    indices, values = sparse_inputs(n, count, 500, 3 * n)
    outs, sent, kept = sparse(indices, values, count, keep=keep, segments=segments)
    exact = dense_sum(indices, values, count)
    for out in outs:
        assert torch.equal(out, outs[0])
    for c, pieces in enumerate(ownership(segments, count, n)):
        total = 0
        for lo, length in pieces:
            piece_out, piece_exact = outs[0][lo:lo + length], exact[lo:lo + length]
            sel = piece_out != 0
            total += int(sel.sum())
            assert int(sel.sum()) <= K.topk_count(length, keep)
            assert torch.equal(piece_out[sel], piece_exact[sel]), "kept entries are the exact sums"
            if (~sel).any() and sel.any():
                assert piece_exact[sel].abs().min() >= piece_exact[~sel].abs().max()
        assert total == kept[c]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_sparse_error_feedback_conserves(n, value_dtype):
    count = 3001
    residuals = [torch.zeros(count) for _ in range(n)]
    indices, values = sparse_inputs(n, count, 200, n + 17)
    outs, _, _ = sparse(indices, values, count, residuals, value_dtype, keep=0.02)
    before = dense_sum(indices, values, count)
    after = outs[0] + sum(residuals)
    assert (after - before).abs().max().item() <= 1e-5 * before.abs().max().item() * n
    if n > 1 or value_dtype != "float32":
        assert any(e.abs().sum() > 0 for e in residuals), "nothing was fed back"


@pytest.mark.parametrize("n", [2, 3, 5])
def test_sparse_bytes_and_dense_switch(n):
    count = 20000
    base, extra = divmod(count, n)
    chunks = [base + (1 if c < extra else 0) for c in range(n)]
    # every index: each message goes dense (values only), 16-byte header each
    full = [torch.arange(count) for _ in range(n)]
    vals = [torch.ones(count) * (r + 1) for r in range(n)]
    outs, sent, kept = sparse(full, vals, count, value_dtype="bfloat16")
    assert torch.equal(outs[0], torch.full((count,), n * (n + 1) / 2))
    for r in range(n):
        expected = sum(16 + 2 * chunks[c] for c in range(n) if c != r) + (n - 1) * (16 + 2 * chunks[r])
        assert sent[r] == expected
    # 1% density: varint gaps (1-2 bytes) + 2-byte values, well under 8 bytes per pair
    indices, values = sparse_inputs(n, count, count // 100, 5)
    outs, sent, kept = sparse(indices, values, count, value_dtype="bfloat16", keep=0.01)
    for r in range(n):
        pairs = len(indices[r]) * (n - 1) / n + sum(kept) * (n - 1) / n
        assert sent[r] < 4.5 * pairs + 32 * n, (sent[r], pairs)


def test_sparse_usage_errors():
    idx = [torch.tensor([3, 1])]
    with pytest.raises(ValueError, match="strictly ascending"):
        sparse(idx, [torch.ones(2)], 10)
    with pytest.raises(ValueError, match="outside"):
        sparse([torch.tensor([10])], [torch.ones(1)], 10)
    with pytest.raises(ValueError, match="wire value type"):
        sparse([torch.tensor([1])], [torch.ones(1)], 10, value_dtype="int8")
    with pytest.raises(ValueError, match="keep density"):
        sparse([torch.tensor([1])], [torch.ones(1)], 10, keep=1.5)


# ---------------------------------------------------------------------------
# through ProcessGroupPycomm (multi-process, TCP): same results as the loopback runs,
# submission order with other collectives, usage errors at the call
# ---------------------------------------------------------------------------

def _pg_worker(ctx):
    import torch.distributed as dist
    from pycomm import hooks as H

    world, rank = ctx.world_size, ctx.rank
    pg = H._common._pycomm_backend(None)
    problems = []
    count, segments = 7001, [3000, 1, 4000]
    xs = inputs(world, count, 42)
    # quantized, stochastic, error feedback: equal to the loopback run on the same inputs
    ref_res = [torch.full((count,), 0.01) for _ in range(world)]
    ref = [x.clone() for x in xs]
    loopback.allreduce_quantized(ref, ref_res, 4, 64, True, 9, segments, 60.0)
    mine, res = xs[rank].clone(), torch.full((count,), 0.01)
    before = torch.ones(5) * (rank + 1)
    w0 = dist.all_reduce(before, async_op=True)  # queued ahead: submission order
    work = pg.allreduce_quantized(mine, res, 4, 64, True, 9, segments, [0, 1, 2])
    after = torch.ones(3) * (rank + 1)
    w1 = dist.all_reduce(after, async_op=True)
    value = work.get_future().wait()
    w0.wait()
    w1.wait()
    if not (torch.equal(before, torch.full((5,), world * (world + 1) / 2)) and
            torch.equal(after, torch.full((3,), world * (world + 1) / 2))):
        problems.append("all_reduce around the quantized all-reduce went wrong")
    if not torch.equal(value[0], ref[rank]) or not torch.equal(mine, ref[rank]):
        problems.append("allreduce_quantized differs from the loopback run")
    if not torch.equal(res, ref_res[rank]):
        problems.append("allreduce_quantized residual differs from the loopback run")
    # sparse, bfloat16 values, owners keep 2%
    indices, values = sparse_inputs(world, count, 150, 43)
    ref_res = [torch.zeros(count) for _ in range(world)]
    ref_out, _, _ = sparse(indices, values, count, ref_res, "bfloat16", 0.02, segments)
    out, res = torch.empty(count), torch.zeros(count)
    pg.allreduce_sparse(indices[rank], values[rank], out, res, "bfloat16", 0.02, segments).wait()
    if not torch.equal(out, ref_out[rank]) or not torch.equal(res, ref_res[rank]):
        problems.append("allreduce_sparse differs from the loopback run")
    # divided as placed: the same floats as dividing the sums afterwards, the same residual
    averaged, res = torch.full((count,), 7.0), torch.zeros(count)  # out's old values must not matter
    pg.allreduce_sparse(indices[rank], values[rank], averaged, res, "bfloat16", 0.02, segments, world).wait()
    if not torch.equal(averaged, ref_out[rank] / world) or not torch.equal(res, ref_res[rank]):
        problems.append("allreduce_sparse with divisor=world is not the sums / world, bit for bit")
    if not (averaged != 0).any():
        problems.append("allreduce_sparse with a divisor: nothing reached out")
    # usage errors raise at the call, naming the op; the group stays usable
    bad = [
        (TypeError, "float32", lambda: pg.allreduce_quantized(torch.zeros(4, dtype=torch.float64))),
        (ValueError, "residual", lambda: pg.allreduce_quantized(torch.zeros(4), torch.zeros(3))),
        (ValueError, "bits", lambda: pg.allreduce_quantized(torch.zeros(4), bits=2)),
        (ValueError, "segments", lambda: pg.allreduce_quantized(torch.zeros(4), segments=[1, 2])),
        (ValueError, "ascending", lambda: pg.allreduce_sparse(torch.tensor([2, 1]), torch.ones(2), torch.zeros(4))),
        (ValueError, "outside", lambda: pg.allreduce_sparse(torch.tensor([4]), torch.ones(1), torch.zeros(4))),
        (ValueError, "value_dtype", lambda: pg.allreduce_sparse(torch.tensor([1]), torch.ones(1), torch.zeros(4),
                                                                 value_dtype="float64")),
        (ValueError, "differ in length", lambda: pg.allreduce_sparse(torch.tensor([1]), torch.ones(2),
                                                                      torch.zeros(4))),
        (ValueError, "divisor", lambda: pg.allreduce_sparse(torch.tensor([1]), torch.ones(1), torch.zeros(4),
                                                             divisor=0.0)),
    ]
    for exc, text, call in bad:
        try:
            call()
            problems.append(f"accepted: {text}")
        except exc as e:
            if text not in str(e) or "pycomm allreduce_" not in str(e):
                problems.append(f"unclear message for {text}: {e}")
    t = torch.ones(2)
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((2,), float(world))):
        problems.append("the group is not usable after usage errors")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_process_group_methods(world):
    from mp_util import spawn_run

    loopback.build()  # the ranks compare with the loopback harness: build it once, here

    rets = spawn_run(_pg_worker, world, backend="pycomm", make_ref=False, timeout_s=90,
                     pg_timeout_s=30).check().returns
    problems = [f"rank {r}: {p}" for r, ps in sorted(rets.items()) for p in ps]
    assert not problems, "\n".join(problems)
