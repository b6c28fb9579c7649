"""Differential tests: every collective through the backend under test
("pycomm") and through gloo, on the same deterministic rank-dependent data,
in the same spawned processes (see mp_util.py).

One spawned run per world size executes all *sections* (one per collective
family) and reports each section's list of mismatches as soon as it is done;
the test functions below then assert per (world size, section), so a hang or
crash in one section still leaves the results of the earlier ones readable.

References: gloo where gloo supports the dtype/op; otherwise a closed form
computed locally (every rank can regenerate every other rank's input, so the
exact expected value is known). Closed forms are used for:
  * int16 (gloo raises "Invalid scalar type"),
  * bool reductions (compared with logical OR / AND / XOR, the contract's
    NCCL-like semantics: SUM = OR, PRODUCT = AND),
  * AVG (compared with SUM / n computed in float64),
  * point-to-point (the expected payload is the sender's generated input).
Integers and bool must match exactly; floats within a dtype-dependent
tolerance (float16/bfloat16 looser). Copies (broadcast, gathers, scatters,
all-to-all, p2p) must be bit exact for every dtype. All-reduce results must
also be bitwise identical on every rank.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
import time
import traceback
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

from mp_util import format_failures, spawn_run

BACKEND = "pycomm"

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
ALGOS = ["auto", "ring", "tree", "sharded"]
# gloo in torch 2.13 has no int16 ("Invalid scalar type").
GLOO_DTYPES = set(DTYPES) - {torch.int16}

# (SUM range, PRODUCT range), half-open, chosen so that no result overflows at world size <= 4
INT_RANGES = {
    torch.int8: ((-30, 31), (-3, 4)),
    torch.uint8: ((0, 61), (0, 4)),
    torch.int16: ((-1000, 1001), (-5, 6)),
    torch.int32: ((-10**6, 10**6 + 1), (-20, 21)),
    torch.int64: ((-10**9, 10**9 + 1), (-1000, 1001)),
}


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def ops_for(dtype):
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def rop(name):
    return getattr(dist.ReduceOp, name)


def sizes_for(world, big=True):
    out = []
    for n in [0, 1, world - 1, world + 1, 10007] + ([1 << 18] if big else []):
        if n not in out:
            out.append(n)
    return out


def make_input(rank, dtype, n, op="COPY", salt=""):
    """Deterministic data for (rank, dtype, n, op, salt); any rank can
    regenerate any other rank's input."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{salt}|{rank}|{dtype}|{n}|{op}".encode()))
    if dtype == torch.bool:
        p = {"PRODUCT": 0.8, "MIN": 0.8, "BAND": 0.8, "SUM": 0.3, "MAX": 0.3, "BOR": 0.3}.get(op, 0.5)
        return torch.rand(n, generator=g) < p
    if dtype.is_floating_point:
        if op in ("SUM", "AVG"):
            t = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
        elif op == "PRODUCT":
            mag = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
            sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
            t = mag * sign
        else:
            t = torch.randn(n, generator=g, dtype=torch.float64) * 100
        return t.to(dtype)
    info = torch.iinfo(dtype)
    if op == "SUM":
        lo, hi = INT_RANGES[dtype][0]
    elif op == "PRODUCT":
        lo, hi = INT_RANGES[dtype][1]
    else:
        lo, hi = info.min, (info.max + 1 if dtype != torch.int64 else info.max)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def local_reduce(inputs, op, dtype, world):
    """Closed-form reduction of all ranks' inputs."""
    stack = torch.stack(inputs)
    if dtype == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        if op == "BXOR":
            return functools.reduce(torch.logical_xor, inputs)
        raise ValueError(op)
    if dtype.is_floating_point:
        s = stack.double()
        res = {"SUM": lambda: s.sum(0), "AVG": lambda: s.sum(0) / world, "PRODUCT": lambda: s.prod(0),
               "MIN": lambda: s.amin(0), "MAX": lambda: s.amax(0)}[op]()
        return res.to(dtype)
    if op == "SUM":
        return stack.long().sum(0).to(dtype)
    if op == "PRODUCT":
        return stack.long().prod(0).to(dtype)
    if op == "MIN":
        return stack.amin(0)
    if op == "MAX":
        return stack.amax(0)
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return functools.reduce(fn, inputs)


def use_gloo(dtype, op="COPY"):
    return dtype in GLOO_DTYPES and not (op != "COPY" and (dtype == torch.bool or op == "AVG"))


def tolerance(dtype):
    return {
        torch.float32: (1e-5, 1e-5),
        torch.float64: (1e-12, 1e-12),
        torch.float16: (1e-2, 1e-2),
        torch.bfloat16: (2e-2, 6e-2),
    }[dtype]


def describe_exc(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def digest(t: torch.Tensor) -> int:
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(b, digest_size=7).digest(), "little")


class Checker:
    """Collects failures of one section on one rank."""

    def __init__(self, ctx, section):
        self.ctx = ctx
        self.section = section
        self.failures = []
        self.digests = []  # (what, digest or -1) for the cross-rank identity check

    def note(self, what):
        self.ctx.progress(f"{self.section}: {what}")

    def fail(self, what, msg):
        self.failures.append(f"rank {self.ctx.rank}: {what}: {msg}")

    def call(self, what, fn):
        """Run a call of the backend under test; record an exception as a failure."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001
            self.fail(what, "raised " + describe_exc(e))
            return False

    def ref(self, what, fn):
        """Compute a reference (gloo); an exception here is a harness problem, reported as such."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self.fail(what, "REFERENCE (gloo/closed form) raised " + describe_exc(e))
            return None

    def compare(self, what, got, exp, exact=False):
        if exp is None:
            return
        if got.dtype != exp.dtype or got.shape != exp.shape:
            self.fail(what, f"got {got.dtype}{tuple(got.shape)}, expected {exp.dtype}{tuple(exp.shape)}")
            return
        if exact or not got.dtype.is_floating_point:
            if exact and got.dtype.is_floating_point:  # bitwise
                itype = _same_width_int(got.dtype)
                bad = got.reshape(-1).contiguous().view(itype) != exp.reshape(-1).contiguous().view(itype)
            else:
                bad = (got != exp).reshape(-1)
            tol = "exact"
        else:
            rtol, atol = tolerance(got.dtype)
            bad = ~torch.isclose(got.double(), exp.double(), rtol=rtol, atol=atol).reshape(-1)
            tol = f"rtol={rtol} atol={atol}"
        nbad = int(bad.sum())
        if nbad:
            i = int(bad.nonzero()[0])
            g, x = got.reshape(-1)[i].item(), exp.reshape(-1)[i].item()
            extra = ""
            if got.dtype.is_floating_point:
                extra = f", max |diff| {float((got.double() - exp.double()).abs().max()):.3g}"
            self.fail(what, f"{nbad}/{got.numel()} elements differ ({tol}); first at [{i}]: got {g!r}, "
                            f"expected {x!r}{extra}")

    def digest(self, what, t):
        self.digests.append((what, -1 if t is None else digest(t)))

    def finish(self):
        """Cross-rank identity of all-reduce results, via the gloo group."""
        if not self.digests or self.ctx.ref is None:
            return
        everyone = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, self.digests, group=self.ctx.ref)
        if self.ctx.rank != 0:
            return  # rank 0 reports for all
        by_what = {}
        for r, lst in enumerate(everyone):
            for what, d in lst:
                by_what.setdefault(what, {})[r] = d
        for what, ds in by_what.items():
            if -1 not in ds.values() and len(set(ds.values())) > 1:
                self.failures.append(f"{what}: results are not bitwise identical on ranks {sorted(ds)} "
                                     f"(digests by rank {ds})")


def _same_width_int(dtype):
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]


def set_algo(ctx, chk, name, group=None):
    """Select the all-reduce algorithm (pycomm only; a no-op for other backends)."""
    if ctx.backend != "pycomm":
        return True
    import pycomm

    return chk.call(f"pycomm.set_algorithm({name!r}, group={'sub' if group else None})",
                    lambda: pycomm.set_algorithm(name, group=group))


# --------------------------------------------------------------------------
# sections (run inside the spawned ranks)
# --------------------------------------------------------------------------

def _allreduce_one(ctx, chk, dtype, op, n, label, group=None, ref_group=None, members=None, expect_algo=None):
    w = ctx.world_size if members is None else len(members)
    ranks = list(range(ctx.world_size)) if members is None else members
    what = f"all_reduce[{label}] {dname(dtype)} {op} n={n}"
    if members is not None:
        what += f" ranks={members}"
    chk.note(what)
    mine = make_input(ctx.rank, dtype, n, op, salt=label)
    if use_gloo(dtype, op):
        def gloo_ref():
            t = mine.clone()
            dist.all_reduce(t, op=rop(op), group=ref_group if ref_group is not None else ctx.ref)
            return t
        exp = chk.ref(what, gloo_ref)
    else:
        exp = chk.ref(what, lambda: local_reduce([make_input(r, dtype, n, op, salt=label) for r in ranks],
                                                 op, dtype, w))
    got = mine.clone()
    if chk.call(what, lambda: dist.all_reduce(got, op=rop(op), group=group)):
        chk.compare(what, got, exp)
        chk.digest(what, got)
        if expect_algo and n >= 10007 and ctx.backend == "pycomm":
            import pycomm

            used = pycomm.last_algorithm(group)
            if used != expect_algo:
                chk.fail(what, f"pycomm.last_algorithm() is {used!r}, expected {expect_algo!r}")
    else:
        chk.digest(what, None)


def sec_all_reduce(ctx, chk, full):
    w = ctx.world_size
    dtypes = DTYPES if full else [torch.float32, torch.float16, torch.int32, torch.uint8, torch.bool]
    for algo in ALGOS:
        if not set_algo(ctx, chk, algo):
            continue
        for dtype in dtypes:
            for op in ops_for(dtype):
                for n in sizes_for(w):
                    _allreduce_one(ctx, chk, dtype, op, n, algo, expect_algo=None if algo == "auto" else algo)
    set_algo(ctx, chk, "auto")


def sec_all_reduce_layouts(ctx, chk, full):
    """Contiguous views with a storage offset (must not touch neighbouring
    memory), multi-dimensional tensors, complex (torch views it as real)."""
    w = ctx.world_size
    for algo in ALGOS:
        if not set_algo(ctx, chk, algo):
            continue
        for dtype, n in [(torch.float32, 10007), (torch.int64, 1 << 17), (torch.float16, w + 1)]:
            what = f"all_reduce[{algo}] view with storage offset {dname(dtype)} n={n}"
            chk.note(what)
            mine = make_input(ctx.rank, dtype, n, "SUM", salt="view")
            exp = chk.ref(what, lambda: _gloo_allreduce(ctx, mine, "SUM"))
            big = torch.full((n + 24,), 7, dtype=dtype)
            view = big[8:8 + n]
            view.copy_(mine)
            if chk.call(what, lambda: dist.all_reduce(view)):
                chk.compare(what, view, exp)
                guard = torch.cat([big[:8], big[8 + n:]])
                if not bool((guard == 7).all()):
                    chk.fail(what, "wrote outside the view (neighbouring elements changed)")
        what = f"all_reduce[{algo}] 3-D tensor float64 shape (7, 3, 479) MAX"
        chk.note(what)
        mine = make_input(ctx.rank, torch.float64, 7 * 3 * 479, "MAX", salt="3d").reshape(7, 3, 479)
        exp = chk.ref(what, lambda: _gloo_allreduce(ctx, mine, "MAX"))
        got = mine.clone()
        if chk.call(what, lambda: dist.all_reduce(got, op=dist.ReduceOp.MAX)):
            chk.compare(what, got, exp)
        what = f"all_reduce[{algo}] complex64 SUM n=1001 (torch passes a float32 view)"
        chk.note(what)
        re_ = make_input(ctx.rank, torch.float32, 2002, "SUM", salt="cplx")
        mine = torch.view_as_complex(re_.reshape(1001, 2))
        exp = chk.ref(what, lambda: _gloo_allreduce(ctx, mine, "SUM"))
        got = mine.clone()
        if chk.call(what, lambda: dist.all_reduce(got)):
            chk.compare(what, torch.view_as_real(got), torch.view_as_real(exp))
    set_algo(ctx, chk, "auto")


def _gloo_allreduce(ctx, t, op, group=None):
    r = t.clone()
    dist.all_reduce(r, op=rop(op), group=group if group is not None else ctx.ref)
    return r


def sec_broadcast(ctx, chk, full):
    w = ctx.world_size
    dtypes = DTYPES if full else [torch.float32, torch.int64, torch.bool, torch.bfloat16]
    for src in range(w):
        for dtype in dtypes:
            ns = sizes_for(w, big=(dtype == torch.float32))
            for n in ns:
                what = f"broadcast src={src} {dname(dtype)} n={n}"
                chk.note(what)
                mine = make_input(ctx.rank, dtype, n, salt="bcast")
                if use_gloo(dtype):
                    def gloo_ref():
                        t = mine.clone()
                        dist.broadcast(t, src=src, group=ctx.ref)
                        return t
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = make_input(src, dtype, n, salt="bcast")
                got = mine.clone()
                if chk.call(what, lambda: dist.broadcast(got, src=src)):
                    chk.compare(what, got, exp, exact=True)


def sec_reduce(ctx, chk, full):
    w = ctx.world_size
    for dst in range(w):
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for n in [1, 10007]:
                    what = f"reduce dst={dst} {dname(dtype)} {op} n={n}"
                    chk.note(what)
                    mine = make_input(ctx.rank, dtype, n, op, salt="reduce")
                    if use_gloo(dtype, op):
                        def gloo_ref():
                            t = mine.clone()
                            dist.reduce(t, dst=dst, op=rop(op), group=ctx.ref)
                            return t
                        exp = chk.ref(what, gloo_ref)
                    else:
                        exp = local_reduce([make_input(r, dtype, n, op, salt="reduce") for r in range(w)], op, dtype, w)
                    got = mine.clone()
                    if chk.call(what, lambda: dist.reduce(got, dst=dst, op=rop(op))) and ctx.rank == dst:
                        # only the destination's result is specified
                        chk.compare(what, got, exp)


def sec_all_gather(ctx, chk, full):
    w = ctx.world_size
    for dtype in DTYPES:
        for n in sizes_for(w, big=False):
            what = f"all_gather {dname(dtype)} n={n}"
            chk.note(what)
            mine = make_input(ctx.rank, dtype, n, salt="ag")
            if use_gloo(dtype):
                def gloo_ref():
                    outs = [torch.empty(n, dtype=dtype) for _ in range(w)]
                    dist.all_gather(outs, mine, group=ctx.ref)
                    return torch.stack(outs)
                exp = chk.ref(what, gloo_ref)
            else:
                exp = torch.stack([make_input(r, dtype, n, salt="ag") for r in range(w)])
            outs = [torch.zeros(n, dtype=dtype) for _ in range(w)]
            if chk.call(what, lambda: dist.all_gather(outs, mine)):
                chk.compare(what, torch.stack(outs), exp, exact=True)
            if not torch.equal(mine, make_input(ctx.rank, dtype, n, salt="ag")):
                chk.fail(what, "modified its input tensor")


def sec_all_gather_into_tensor(ctx, chk, full):
    w = ctx.world_size
    dtypes = DTYPES if full else [torch.float32, torch.int8, torch.bool]
    for dtype in dtypes:
        for n in sizes_for(w, big=(dtype == torch.float32)):
            # (the stacked (world, n) output layout is not covered: gloo rejects it)
            for layout in ["concat"]:
                what = f"all_gather_into_tensor {dname(dtype)} n={n}"
                chk.note(what)
                mine = make_input(ctx.rank, dtype, n, salt="agt")
                shape = (w * n,)
                if use_gloo(dtype):
                    def gloo_ref():
                        out = torch.empty(shape, dtype=dtype)
                        dist.all_gather_into_tensor(out, mine, group=ctx.ref)
                        return out
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = torch.cat([make_input(r, dtype, n, salt="agt") for r in range(w)]).reshape(shape)
                out = torch.zeros(shape, dtype=dtype)
                if chk.call(what, lambda: dist.all_gather_into_tensor(out, mine)):
                    chk.compare(what, out, exp, exact=True)


def sec_gather(ctx, chk, full):
    w = ctx.world_size
    for dst in range(w):
        for dtype in DTYPES:
            for n in [0, 1, 10007]:
                what = f"gather dst={dst} {dname(dtype)} n={n}"
                chk.note(what)
                mine = make_input(ctx.rank, dtype, n, salt="gather")
                if use_gloo(dtype):
                    def gloo_ref():
                        outs = [torch.empty(n, dtype=dtype) for _ in range(w)] if ctx.rank == dst else None
                        dist.gather(mine, outs, dst=dst, group=ctx.ref)
                        return torch.stack(outs) if outs is not None else None
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = torch.stack([make_input(r, dtype, n, salt="gather") for r in range(w)])
                outs = [torch.zeros(n, dtype=dtype) for _ in range(w)] if ctx.rank == dst else None
                if chk.call(what, lambda: dist.gather(mine, outs, dst=dst)) and ctx.rank == dst:
                    chk.compare(what, torch.stack(outs), exp, exact=True)


def sec_scatter(ctx, chk, full):
    w = ctx.world_size
    for src in range(w):
        for dtype in DTYPES:
            for n in [0, 1, 10007]:
                what = f"scatter src={src} {dname(dtype)} n={n}"
                chk.note(what)
                chunks = [make_input(src, dtype, n, salt=f"scatter->{r}") for r in range(w)]
                lst = chunks if ctx.rank == src else None
                if use_gloo(dtype):
                    def gloo_ref():
                        t = torch.empty(n, dtype=dtype)
                        dist.scatter(t, [c.clone() for c in lst] if lst else None, src=src, group=ctx.ref)
                        return t
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = chunks[ctx.rank]
                got = torch.zeros(n, dtype=dtype)
                if chk.call(what, lambda: dist.scatter(got, lst, src=src)):
                    chk.compare(what, got, exp, exact=True)


def _rs_inputs(rank, dtype, n, op, w, salt):
    return [make_input(rank, dtype, n, op, salt=f"{salt}->{j}") for j in range(w)]


def _rs_share(j, n, mode):
    # uneven (as gloo allows): rank j's share, the same on every rank; includes zeros
    return n if mode == "even" else (j % 3) * n


def sec_reduce_scatter(ctx, chk, full):
    w = ctx.world_size
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for mode, n in [("even", 0), ("even", 1), ("even", w + 1), ("even", 1001), ("uneven", 1),
                            ("uneven", 1001)]:
                what = f"reduce_scatter({mode}) {dname(dtype)} {op} n={n}/rank"
                chk.note(what)

                def inputs(rank):
                    return [make_input(rank, dtype, _rs_share(j, n, mode), op, salt=f"rs->{j}") for j in range(w)]
                ins = inputs(ctx.rank)
                mine = _rs_share(ctx.rank, n, mode)
                if use_gloo(dtype, op):
                    def gloo_ref():
                        t = torch.empty(mine, dtype=dtype)
                        dist.reduce_scatter(t, [x.clone() for x in ins], op=rop(op), group=ctx.ref)
                        return t
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = local_reduce([inputs(r)[ctx.rank] for r in range(w)], op, dtype, w)
                got = torch.zeros(mine, dtype=dtype)
                if chk.call(what, lambda: dist.reduce_scatter(got, ins, op=rop(op))):
                    chk.compare(what, got, exp)


def sec_reduce_scatter_tensor(ctx, chk, full):
    w = ctx.world_size
    dtypes = DTYPES if full else [torch.float32, torch.bfloat16, torch.int32, torch.bool]
    for dtype in dtypes:
        for op in ops_for(dtype):
            for n in ([0, 1, w + 1, 1001] + ([1 << 16] if op == "SUM" else [])):
                what = f"reduce_scatter_tensor {dname(dtype)} {op} n={n}/rank"
                chk.note(what)
                inp = torch.cat(_rs_inputs(ctx.rank, dtype, n, op, w, "rst"))
                if use_gloo(dtype, op):
                    def gloo_ref():
                        t = torch.empty(n, dtype=dtype)
                        dist.reduce_scatter_tensor(t, inp.clone(), op=rop(op), group=ctx.ref)
                        return t
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = local_reduce([_rs_inputs(r, dtype, n, op, w, "rst")[ctx.rank] for r in range(w)], op, dtype, w)
                got = torch.zeros(n, dtype=dtype)
                if chk.call(what, lambda: dist.reduce_scatter_tensor(got, inp, op=rop(op))):
                    chk.compare(what, got, exp)


def _a2a_count(src, dst, base):
    # uneven, includes zeros
    return (src * 2 + dst) % 3 * base


def sec_all_to_all(ctx, chk, full):
    w, r = ctx.world_size, ctx.rank
    for dtype in DTYPES:
        for base in [1, 5, 1000]:
            for mode in ["even", "uneven"]:
                what = f"all_to_all(list, {mode}) {dname(dtype)} base={base}"
                chk.note(what)

                def count(src, dst):
                    return base if mode == "even" else _a2a_count(src, dst, base)
                ins = [make_input(r, dtype, count(r, j), salt=f"a2a->{j}") for j in range(w)]
                def closed_form():
                    return torch.cat([make_input(j, dtype, count(j, r), salt=f"a2a->{r}") for j in range(w)])
                if use_gloo(dtype) and mode == "even":
                    def gloo_ref():
                        outs = [torch.empty(count(j, r), dtype=dtype) for j in range(w)]
                        try:
                            dist.all_to_all(outs, [x.clone() for x in ins], group=ctx.ref)
                        except RuntimeError as e:  # torch 2.11's gloo has no list all_to_all
                            if "does not support alltoall" not in str(e):
                                raise
                            return closed_form()
                        return torch.cat(outs)
                    exp = chk.ref(what, gloo_ref)
                else:
                    # closed form: gloo's list all_to_all rejects tensors of different sizes
                    exp = closed_form()
                outs = [torch.zeros(count(j, r), dtype=dtype) for j in range(w)]
                if chk.call(what, lambda: dist.all_to_all(outs, ins)):
                    chk.compare(what, torch.cat(outs), exp, exact=True)


def sec_all_to_all_single(ctx, chk, full):
    w, r = ctx.world_size, ctx.rank
    dtypes = DTYPES if full else [torch.float32, torch.int64, torch.bool]
    for dtype in dtypes:
        for base in [0, 1, 3, 1000]:
            for mode in ["even", "uneven", "uneven-2d"]:
                what = f"all_to_all_single[{mode}] {dname(dtype)} base={base}"
                chk.note(what)
                cols = 3 if mode == "uneven-2d" else 1
                if mode == "even":
                    in_splits = out_splits = None
                    nin = nout = w * base
                else:
                    in_splits = [_a2a_count(r, j, base) for j in range(w)]
                    out_splits = [_a2a_count(j, r, base) for j in range(w)]
                    nin, nout = sum(in_splits), sum(out_splits)

                # every rank's input row block j goes to rank j; generate per (src, dst) block
                def block(src, dst):
                    cnt = base if mode == "even" else _a2a_count(src, dst, base)
                    return make_input(src, dtype, cnt * cols, salt=f"a2as{mode}->{dst}").reshape(cnt, cols)

                inp = torch.cat([block(r, j) for j in range(w)])
                if cols == 1:
                    inp = inp.reshape(-1)
                if use_gloo(dtype):
                    def gloo_ref():
                        out = torch.empty((nout, cols) if cols > 1 else (nout,), dtype=dtype)
                        dist.all_to_all_single(out, inp.clone(), out_splits, in_splits, group=ctx.ref)
                        return out
                    exp = chk.ref(what, gloo_ref)
                else:
                    exp = torch.cat([block(j, r) for j in range(w)])
                    if cols == 1:
                        exp = exp.reshape(-1)
                out = torch.zeros((nout, cols) if cols > 1 else (nout,), dtype=dtype)
                if chk.call(what, lambda: dist.all_to_all_single(out, inp, out_splits, in_splits)):
                    chk.compare(what, out, exp, exact=True)


def sec_barrier(ctx, chk, full):
    w, r = ctx.world_size, ctx.rank
    dist.barrier(group=ctx.ref)  # line everyone up (gloo)
    # 1. a late rank holds everyone else in the barrier
    # Rank 0 writes the time it entered (CLOCK_MONOTONIC is one clock for the whole host);
    # every other rank must leave the barrier after it, with no margin to guess.
    chk.note("barrier with rank 0 arriving 0.6 s late")
    entry = os.path.join(ctx.tmpdir, "barrier_late_entry")
    if r == 0:
        time.sleep(0.6)
        with open(entry + ".tmp", "w") as handle:
            handle.write(repr(time.monotonic()))
        os.replace(entry + ".tmp", entry)
    if chk.call("barrier", lambda: dist.barrier()):
        left = time.monotonic()
        if r != 0:
            try:
                with open(entry) as handle:
                    entered = float(handle.read())
            except OSError:
                entered = None
            if entered is None or left < entered:
                chk.fail("barrier", "returned before rank 0 entered it")
    # 2. ordering: files written before barrier i are all visible after it
    for i in range(8):
        chk.note(f"barrier ordering round {i}")
        if i % 3 == r % 3:
            time.sleep(0.02)
        open(os.path.join(ctx.tmpdir, f"barrier_{i}_{r}"), "w").close()
        if not chk.call(f"barrier round {i}", lambda: dist.barrier()):
            break
        missing = [q for q in range(w) if not os.path.exists(os.path.join(ctx.tmpdir, f"barrier_{i}_{q}"))]
        if missing:
            chk.fail(f"barrier round {i}", f"passed before ranks {missing} arrived")
    # 3. async barrier
    chk.note("barrier(async_op=True)")
    chk.call("barrier(async_op=True).wait()", lambda: dist.barrier(async_op=True).wait())


def sec_p2p(ctx, chk, full):
    w, r = ctx.world_size, ctx.rank
    # Expected payloads are the sender's generated inputs (closed form; p2p has
    # no reduction, a gloo run would only repeat the same copy).
    # 1. blocking send/recv between every ordered pair, in the same global order on all ranks
    for a in range(w):
        for b in range(w):
            if a == b:
                continue
            for dtype, n in [(torch.float32, 1 << 18), (torch.int16, 1001), (torch.bool, 7), (torch.float64, 0)]:
                what = f"send/recv {a}->{b} {dname(dtype)} n={n}"
                chk.note(what)
                payload = make_input(a, dtype, n, salt=f"p2p{a}->{b}")
                if r == a:
                    chk.call(what, lambda: dist.send(payload, dst=b))
                elif r == b:
                    got = torch.zeros(n, dtype=dtype)
                    src_box = []
                    if chk.call(what, lambda: src_box.append(dist.recv(got, src=a))):
                        chk.compare(what, got, payload, exact=True)
                        if src_box and src_box[0] != a:
                            chk.fail(what, f"recv returned sender {src_box[0]}, expected {a}")
    # 2. tags: two sends in flight, received in the opposite order by tag
    what = "isend tags 11,22 then recv tag 22, tag 11"
    chk.note(what)
    pa = make_input(0, torch.float32, 513, salt="tagA")
    pb = make_input(0, torch.float32, 513, salt="tagB")
    if r == 0:
        works = []
        if chk.call(what, lambda: works.extend([dist.isend(pa, dst=1, tag=11), dist.isend(pb, dst=1, tag=22)])):
            for wk in works:
                chk.call(what + " wait", wk.wait)
    elif r == 1:
        gb, ga = torch.zeros(513), torch.zeros(513)
        if chk.call(what, lambda: (dist.recv(gb, src=0, tag=22), dist.recv(ga, src=0, tag=11))):
            chk.compare(what + " (tag 22)", gb, pb, exact=True)
            chk.compare(what + " (tag 11)", ga, pa, exact=True)
    # 3. isend/irecv all pairs at once
    for dtype in DTYPES:
        n = 257
        what = f"isend/irecv all pairs {dname(dtype)} n={n}"
        chk.note(what)
        recvs = {j: torch.zeros(n, dtype=dtype) for j in range(w) if j != r}
        works = []

        def post():
            for j in range(w):
                if j != r:
                    works.append(dist.irecv(recvs[j], src=j, tag=5))
            for j in range(w):
                if j != r:
                    works.append(dist.isend(make_input(r, dtype, n, salt=f"ip2p->{j}"), dst=j, tag=5))
            for wk in works:
                wk.wait()
        if chk.call(what, post):
            for j, t in recvs.items():
                chk.compare(what + f" from {j}", t, make_input(j, dtype, n, salt=f"ip2p->{r}"), exact=True)
    # 4. batch_isend_irecv ring exchange
    for dtype, n in [(torch.float32, 10007), (torch.int64, 3), (torch.bfloat16, 1 << 16)]:
        what = f"batch_isend_irecv ring {dname(dtype)} n={n}"
        chk.note(what)
        nxt, prv = (r + 1) % w, (r - 1) % w
        send = make_input(r, dtype, n, salt="ring")
        recv = torch.zeros(n, dtype=dtype)

        def ring():
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
            for wk in dist.batch_isend_irecv(ops):
                wk.wait()
        if chk.call(what, ring):
            chk.compare(what, recv, make_input(prv, dtype, n, salt="ring"), exact=True)


def _strided(t, how="transpose"):
    """A tensor with the values and shape of 2-D `t` that is strided but not
    contiguous: column-major ("transpose"), or every other element of a buffer
    whose other elements hold 7 ("step"; returns the buffer too, to check them)."""
    if how == "transpose":
        return t.t().contiguous().t()
    buf = torch.full((2 * t.numel(),), 7, dtype=t.dtype)
    out = buf[::2].view(t.shape)
    out.copy_(t)
    return out, buf


def sec_non_contiguous(ctx, chk, full):
    """Strided tensors that are not contiguous (a transpose, every other element,
    channels_last) in every collective, as gloo takes them: pycomm stages them
    through contiguous copies and copies the outputs back. Reference: gloo on the
    same kind of tensors; for all_to_all_single and point-to-point, which gloo
    refuses ("has to be contiguous"), gloo or the closed form on contiguous ones; for
    a view of every other element, the closed form (gloo's result is wrong); for the
    list all_to_all, the closed form (torch 2.11's gloo has none)."""
    w, r = ctx.world_size, ctx.rank
    f32 = torch.float32

    def inp(rank, n=35, dtype=f32, op="SUM", salt="nc"):
        return make_input(rank, dtype, n, op, salt=salt).reshape(5, n // 5)

    def both(what, run, exact=False, compare_to=None):
        """run(group) -> the tensors it wrote; pycomm's against gloo's."""
        chk.note(what)
        exp = chk.ref(what, lambda: run(ctx.ref)) if compare_to is None else compare_to
        box = []
        if chk.call(what, lambda: box.append(run(None))) and exp is not None:
            for g, x in zip(box[0], exp):
                chk.compare(what, g.contiguous(), x.contiguous(), exact=exact)

    def noncontig(*ts):
        for t in ts:
            assert not t.is_contiguous(), "the test must pass a non-contiguous tensor"

    def all_reduce(group, how="transpose", dtype=f32, op="SUM"):
        mine = make_input(r, dtype, 35, op, salt="nc-ar").reshape(5, 7)
        if how == "step":
            t, buf = _strided(mine, "step")
        else:
            t, buf = _strided(mine), None
        noncontig(t)
        dist.all_reduce(t, op=rop(op), group=group)
        if buf is not None and not bool((buf[1::2] == 7).all()):
            raise AssertionError("wrote between the elements of an every-other-element view")
        return [t]
    both("all_reduce transpose float32 SUM", all_reduce)
    # gloo (torch 2.13) returns wrong values for such a view and writes into its gaps:
    # the closed form is the reference
    both("all_reduce every other element int64 MAX",
         lambda g: all_reduce(g, "step", torch.int64, "MAX"), exact=True,
         compare_to=[torch.stack([make_input(j, torch.int64, 35, "MAX", salt="nc-ar") for j in range(w)])
                     .max(0).values.reshape(5, 7)])

    def channels_last(group):
        t = make_input(r, torch.bfloat16, 2 * 3 * 4 * 5, "SUM", salt="nc-cl").reshape(2, 3, 4, 5)
        t = t.to(memory_format=torch.channels_last)
        noncontig(t)
        dist.all_reduce(t, group=group)
        return [t]
    both("all_reduce channels_last bfloat16", channels_last)

    def broadcast(group):
        t = _strided(inp(r, dtype=torch.int32, op="COPY"))
        noncontig(t)
        dist.broadcast(t, src=w - 1, group=group)
        return [t]
    both("broadcast transpose int32", broadcast, exact=True)

    def reduce(group):
        t = _strided(inp(r))
        dist.reduce(t, dst=0, group=group)
        return [t] if r == 0 else []
    both("reduce transpose float32 dst=0", reduce)

    def all_gather(group):
        outs = [_strided(torch.zeros(5, 7)) for _ in range(w)]
        src = _strided(inp(r, op="COPY"))
        noncontig(src, *outs)
        dist.all_gather(outs, src, group=group)
        return outs
    both("all_gather transpose (input and outputs)", all_gather, exact=True)

    def all_gather_into_tensor(group):
        out = _strided(torch.zeros(w * 5, 7))
        src, _ = _strided(inp(r, op="COPY"), "step")
        noncontig(out, src)
        dist.all_gather_into_tensor(out, src, group=group)
        return [out]
    both("all_gather_into_tensor transpose output, every-other-element input", all_gather_into_tensor,
         exact=True)

    def gather(group):
        outs = [_strided(torch.zeros(5, 7)) for _ in range(w)] if r == 0 else None
        dist.gather(_strided(inp(r, op="COPY")), outs, dst=0, group=group)
        return outs or []
    both("gather transpose dst=0", gather, exact=True)

    def scatter(group):
        out = _strided(torch.zeros(5, 7))
        ins = [_strided(inp(j, op="COPY", salt="nc-sc")) for j in range(w)] if r == w - 1 else None
        dist.scatter(out, ins, src=w - 1, group=group)
        return [out]
    both("scatter transpose src=last", scatter, exact=True)

    def reduce_scatter(group):
        out = _strided(torch.zeros(5, 7))
        ins = [_strided(inp(r, salt=f"nc-rs{j}")) for j in range(w)]
        dist.reduce_scatter(out, ins, group=group)
        return [out]
    both("reduce_scatter transpose", reduce_scatter)

    def reduce_scatter_tensor(group):
        out = _strided(torch.zeros(5, 7))
        src = _strided(make_input(r, f32, w * 35, "SUM", salt="nc-rst").reshape(w * 5, 7))
        noncontig(out, src)
        dist.reduce_scatter_tensor(out, src, group=group)
        return [out]
    both("reduce_scatter_tensor transpose", reduce_scatter_tensor)

    def all_to_all(group):
        outs = [_strided(torch.zeros(5, 7, dtype=torch.int64)) for _ in range(w)]
        ins = [_strided(inp(r, dtype=torch.int64, op="COPY", salt=f"nc-a2a{j}")) for j in range(w)]
        dist.all_to_all(outs, ins, group=group)
        return outs
    # closed form: rank j's input number r (torch 2.11's gloo has no list all_to_all)
    both("all_to_all transpose int64", all_to_all, exact=True, compare_to=[
        inp(j, dtype=torch.int64, op="COPY", salt=f"nc-a2a{r}") for j in range(w)])

    def all_to_all_single(group, strided):
        out = torch.zeros(w * 5, 7)
        src = make_input(r, f32, w * 35, salt="nc-a2as").reshape(w * 5, 7)
        if strided:
            out, src = _strided(out), _strided(src)
            noncontig(out, src)
        dist.all_to_all_single(out, src, group=group)
        return [out]
    what = "all_to_all_single transpose (gloo, contiguous)"
    both(what, lambda g: all_to_all_single(g, True), exact=True,
         compare_to=chk.ref(what, lambda: all_to_all_single(ctx.ref, False)))

    # point-to-point: a ring, then a receive from any source into a larger buffer
    what = "send/recv ring transpose float64"
    chk.note(what)
    nxt, prv = (r + 1) % w, (r - 1) % w
    send = _strided(inp(r, dtype=torch.float64, op="COPY", salt="nc-p2p"))
    recv = _strided(torch.zeros(5, 7, dtype=torch.float64))
    noncontig(send, recv)

    def ring():
        for wk in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
            wk.wait()
    if chk.call(what, ring):
        chk.compare(what, recv.contiguous(), inp(prv, dtype=torch.float64, op="COPY", salt="nc-p2p"), exact=True)
    what = "recv from any source, 12 elements into a 5x7 transpose (the rest stays)"
    chk.note(what)
    payload = make_input(1, f32, 12, salt="nc-any")
    if r == 1:
        chk.call(what, lambda: dist.send(payload, dst=0, tag=9))
    elif r == 0:
        got = _strided(torch.full((5, 7), -1.0))
        box = []
        if chk.call(what, lambda: box.append(dist.recv(got, tag=9))):
            exp = torch.full((35,), -1.0)
            exp[:12] = payload
            chk.compare(what, got.contiguous().reshape(-1), exp, exact=True)
            if box[0] != 1:
                chk.fail(what, f"recv returned sender {box[0]}, expected 1")

    # async: wait(), the future's value, and a blocking call queued behind an async one
    def async_all_reduce(group):
        t = _strided(inp(r, salt="nc-async"))
        work = dist.all_reduce(t, async_op=True, group=group)
        work.wait()
        u = _strided(inp(r, salt="nc-fut"))
        value = dist.all_reduce(u, async_op=True, group=group).get_future().wait()
        if group is None and value[0].data_ptr() != u.data_ptr():
            raise AssertionError("the future's value is not the caller's tensor")
        big = make_input(r, f32, 1 << 18, "SUM", salt="nc-big")
        first = dist.all_reduce(big, async_op=True, group=group)
        v = _strided(inp(r, salt="nc-queued"))
        dist.all_reduce(v, group=group)  # queued behind `first`: torch waits on its Work
        first.wait()
        return [t, value[0], v, big]
    both("async all_reduce transpose: wait, future, blocking behind async", async_all_reduce)

    def expanded_input(group):
        outs = [torch.zeros(5, 7) for _ in range(w)]
        src = torch.full((1, 7), float(r)).expand(5, 7)
        noncontig(src)
        dist.all_gather(outs, src, group=group)
        return outs
    both("all_gather of an expand()ed input", expanded_input, exact=True)


def sec_staged_order(ctx, chk, full):
    """Calls that stage copies (non-contiguous tensors; all-to-all whose input is its
    output) keep the queue order, as contiguous calls do: an async call reads what the
    calls queued before it wrote, and a call queued after it (a barrier) finds its
    results in the caller's tensors; copies back also reach inference tensors, and
    overlapping outputs of one list are written in list order. Closed form reference.
    (The seam copied inputs at the call and outputs back on the completion pool: two
    async all-reduces on x and x.T gave 2, 3 or 4 for 4, and a barrier returned before
    x.T's result was in x.)"""
    w, r = ctx.world_size, ctx.rank
    n = 1 << 18
    for first, second in (("T", "T"), ("contiguous", "T"), ("T", "contiguous")):
        what = f"async all_reduce on {first} then on {second} of one buffer"
        chk.note(what)
        view = {"T": lambda b: b.t(), "contiguous": lambda b: b}
        base = torch.ones(2, n)

        def two():
            works = [dist.all_reduce(view[first](base), async_op=True),
                     dist.all_reduce(view[second](base), async_op=True)]
            for work in works:
                work.wait()
        if chk.call(what, two):
            chk.compare(what, base, torch.full((2, n), float(w * w)), exact=True)

    what = "async all_reduce on x.T, then a barrier, then x without wait()"
    chk.note(what)
    stale = []

    def after_barrier():
        works = []
        for i in range(20):
            base = torch.ones(64, 64)
            works.append(dist.all_reduce(base.t(), async_op=True))
            dist.barrier()
            if not bool((base == w).all()):
                stale.append(i)
        for work in works:
            work.wait()
    if chk.call(what, after_barrier) and stale:
        chk.fail(what, f"x not yet written after the barrier in iterations {stale}")

    what = "async all_reduce then async all_to_all_single(t, t) on it"
    chk.note(what)
    t = torch.arange(w * 1000, dtype=torch.float64) + 10_000 * r
    # t after the all-reduce: w * arange + 10_000 * (0 + ... + w - 1); block j goes to rank j
    summed = w * torch.arange(w * 1000, dtype=torch.float64) + 10_000 * (w * (w - 1) // 2)
    exp = torch.cat([summed[r * 1000:(r + 1) * 1000]] * w)

    def reduce_then_exchange():
        works = [dist.all_reduce(t, async_op=True), dist.all_to_all_single(t, t, async_op=True)]
        for work in works:
            work.wait()
    if chk.call(what, reduce_then_exchange):
        chk.compare(what, t, exp, exact=True)

    for how in ("blocking inside inference_mode", "async inside inference_mode",
                "blocking outside inference_mode on an inference tensor"):
        what = f"all_reduce on x.T, {how}"
        chk.note(what)
        box = []

        def inference():
            with torch.inference_mode():
                base = torch.ones(3, 5)
                if how.startswith("async"):
                    dist.all_reduce(base.t(), async_op=True).wait()
                elif how.endswith("inside inference_mode"):
                    dist.all_reduce(base.t())
            if how.endswith("inference tensor"):
                dist.all_reduce(base.t())
            box.append(base.clone())
        if chk.call(what, inference):
            chk.compare(what, box[0], torch.full((3, 5), float(w)), exact=True)

    for order in ("column, row", "row, column"):
        what = f"all_gather into overlapping outputs ({order})"
        chk.note(what)
        buf = torch.zeros(3, 3)
        outs = [buf[:, 0], buf[0, :]] if order == "column, row" else [buf[0, :], buf[:, 0]]
        exp = torch.zeros(3, 3)
        for j, o in enumerate([exp[:, 0], exp[0, :]] if order == "column, row" else [exp[0, :], exp[:, 0]]):
            o.fill_(float(j + 1))  # output j holds rank j's tensor; the later output wins
        outs += [torch.empty(3) for _ in range(w - 2)]  # ranks 2.. land apart
        if chk.call(what, lambda: dist.all_gather(outs, torch.full((3,), float(r + 1)))):
            chk.compare(what, buf, exp, exact=True)


def sec_all_to_all_in_place(ctx, chk, full):
    """all_to_all_single(t, t) and all_to_all with outputs that are the inputs in
    another order: the inputs are read from a copy. Closed form reference (gloo,
    torch 2.13, returns wrong blocks for the first, at most sizes)."""
    w, r = ctx.world_size, ctx.rank
    for n in (1, 1000, 100_000):
        what = f"all_to_all_single(t, t) n={n} per rank"
        chk.note(what)
        t = torch.arange(w * n, dtype=torch.float32) + 10_000 * r
        exp = torch.cat([torch.arange(r * n, (r + 1) * n, dtype=torch.float32) + 10_000 * j for j in range(w)])
        if chk.call(what, lambda: dist.all_to_all_single(t, t)):
            chk.compare(what, t, exp, exact=True)
        what = f"all_to_all(reversed(inputs), inputs) n={n}"
        chk.note(what)
        ins = [torch.arange(n, dtype=torch.int64) + 10_000 * r + 1_000 * j for j in range(w)]
        outs = list(reversed(ins))
        if chk.call(what, lambda: dist.all_to_all(outs, ins)):
            for j, o in enumerate(outs):
                chk.compare(what + f" from rank {j}", o, torch.arange(n, dtype=torch.int64) + 10_000 * j + 1_000 * r)


def sec_coalesced(ctx, chk, full):
    w = ctx.world_size
    warnings.simplefilter("ignore")
    for dtype, op in [(torch.float32, "SUM"), (torch.int64, "SUM"), (torch.float64, "MAX"), (torch.int32, "BXOR")]:
        for sizes in [(5, 10007, 1), (0, 3, w + 1)]:
            what = f"all_reduce_coalesced {dname(dtype)} {op} sizes={sizes}"
            chk.note(what)
            ins = [make_input(ctx.rank, dtype, n, op, salt=f"coal{i}") for i, n in enumerate(sizes)]

            def gloo_ref():
                ts = [t.clone() for t in ins]
                dist.all_reduce_coalesced(ts, op=rop(op), group=ctx.ref)
                return ts
            exp = chk.ref(what, gloo_ref)
            got = [t.clone() for t in ins]
            if chk.call(what, lambda: dist.all_reduce_coalesced(got, op=rop(op))) and exp is not None:
                for i, (g, e) in enumerate(zip(got, exp)):
                    chk.compare(what + f" [{i}]", g, e)


def _structure(v):
    if isinstance(v, torch.Tensor):
        return ("Tensor", tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return [_structure(x) for x in v]
    return type(v).__name__


def _flat(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _flat(x)]
    return []


def sec_async(ctx, chk, full):
    w, r = ctx.world_size, ctx.rank
    n = 10007

    def run_async(group, kind):
        """Launch `kind` async on `group`; returns (work, output tensors)."""
        if kind == "all_reduce":
            t = make_input(r, torch.float32, n, "SUM", salt="async")
            return dist.all_reduce(t, async_op=True, group=group), [t]
        if kind == "broadcast":
            t = make_input(r, torch.int32, n, salt="async")
            return dist.broadcast(t, src=w - 1, async_op=True, group=group), [t]
        if kind == "all_gather_into_tensor":
            out = torch.zeros(w * n, dtype=torch.float16)
            return dist.all_gather_into_tensor(out, make_input(r, torch.float16, n, salt="async"),
                                               async_op=True, group=group), [out]
        if kind == "all_gather":
            outs = [torch.zeros(n, dtype=torch.int64) for _ in range(w)]
            return dist.all_gather(outs, make_input(r, torch.int64, n, salt="async"),
                                   async_op=True, group=group), outs
        if kind == "reduce_scatter_tensor":
            out = torch.zeros(n, dtype=torch.float64)
            return dist.reduce_scatter_tensor(out, make_input(r, torch.float64, w * n, "SUM", salt="async"),
                                              async_op=True, group=group), [out]
        if kind == "all_to_all_single":
            out = torch.zeros(w * 11, dtype=torch.int64)
            return dist.all_to_all_single(out, make_input(r, torch.int64, w * 11, salt="async"),
                                          async_op=True, group=group), [out]
        raise ValueError(kind)

    # reduce_scatter_tensor: gloo's Work has no future ("Work::getFuture not implemented"), so
    # only work.wait() + the output tensor are compared for it.
    what = "async reduce_scatter_tensor: work.wait()"
    chk.note(what)
    ref = chk.ref(what, lambda: _run_wait(run_async, ctx.ref, "reduce_scatter_tensor"))
    res = {}
    if chk.call(what, lambda: res.setdefault("v", _run_wait(run_async, None, "reduce_scatter_tensor"))) \
            and ref is not None:
        chk.compare(what, res["v"], ref)

    for kind in ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "all_to_all_single"]:
        what = f"async {kind}: work.get_future().wait()"
        chk.note(what)
        ref = chk.ref(what, lambda: _run_future(run_async, ctx.ref, kind))
        res = {}

        def go():
            res["v"] = _run_future(run_async, None, kind)
        if not chk.call(what, go) or ref is None:
            continue
        (rval, routs, rsame), (val, outs, same) = ref, res["v"]
        for i, (g, e) in enumerate(zip(outs, routs)):
            chk.compare(what + f" output tensor [{i}] after wait", g, e)
        if kind == "all_gather_into_tensor" and _structure(val) == _structure(outs):
            # gloo's future holds per-rank chunks of the output; [output] itself
            # (what NCCL returns) is accepted too. Values are checked below.
            rval, rsame = routs, [True]
        if _structure(val) != _structure(rval):
            chk.fail(what, f"future value has structure {_structure(val)}, gloo gives {_structure(rval)}")
            continue
        for i, (g, e) in enumerate(zip(_flat(val), _flat(rval))):
            chk.compare(what + f" future value [{i}]", g, e)
        if same != rsame:
            chk.fail(what, f"future value tensors alias the output tensors: {same}; with gloo: {rsame}")

    # several outstanding ops, waited in reverse order; then a .then() chain (what DDP hooks use)
    what = "4 outstanding async all_reduce waited in reverse order"
    chk.note(what)
    ts = [make_input(r, torch.float32, 1000 * (i + 1), "SUM", salt=f"multi{i}") for i in range(4)]
    exps = [chk.ref(what, lambda t=t: _gloo_allreduce(ctx, t, "SUM")) for t in ts]
    got = [t.clone() for t in ts]

    def multi():
        works = [dist.all_reduce(t, async_op=True) for t in got]
        for wk in reversed(works):
            if wk.wait() is not True:
                chk.fail(what, "work.wait() did not return True")
            if not wk.is_completed():
                chk.fail(what, "work.is_completed() is False after wait()")
    if chk.call(what, multi):
        for i, (g, e) in enumerate(zip(got, exps)):
            chk.compare(what + f" [{i}]", g, e)

    # two pycomm groups used concurrently, issued in opposite orders on
    # alternate ranks (legal: the groups are independent communicators)
    what = "async all_reduce on two groups, issued in opposite orders on alternate ranks"
    chk.note(what)
    g2 = dist.new_group()
    g2_ref = dist.new_group(backend="gloo")
    ta = make_input(r, torch.float32, 50000, "SUM", salt="grpA")
    tb = make_input(r, torch.int64, 50000, "SUM", salt="grpB")
    exp_a = chk.ref(what, lambda: _gloo_allreduce(ctx, ta, "SUM"))
    exp_b = chk.ref(what, lambda: _gloo_allreduce(ctx, tb, "SUM", group=g2_ref))
    ga, gb = ta.clone(), tb.clone()

    def two_groups():
        if r % 2 == 0:
            works = [dist.all_reduce(ga, async_op=True), dist.all_reduce(gb, group=g2, async_op=True)]
        else:
            works = [dist.all_reduce(gb, group=g2, async_op=True), dist.all_reduce(ga, async_op=True)]
        for wk in works:
            wk.wait()
    if chk.call(what, two_groups):
        chk.compare(what + " (default group)", ga, exp_a)
        chk.compare(what + " (second group)", gb, exp_b)

    what = "get_future().then(...) chain"
    chk.note(what)
    t = make_input(r, torch.float64, 333, "SUM", salt="then")
    exp = chk.ref(what, lambda: _gloo_allreduce(ctx, t, "SUM"))
    got_t = t.clone()
    out = {}

    def chain():
        fut = dist.all_reduce(got_t, async_op=True).get_future()
        out["v"] = fut.then(lambda f: f.value()[0] / w).wait()
    if chk.call(what, chain) and exp is not None:
        chk.compare(what, out["v"], exp / w)


def _run_wait(run_async, group, kind):
    work, outs = run_async(group, kind)
    work.wait()
    return outs[0]


def _run_future(run_async, group, kind):
    work, outs = run_async(group, kind)
    val = work.get_future().wait()
    flat = _flat(val)
    # does each future tensor live inside one of the output tensors?
    same = [any(o.data_ptr() <= f.data_ptr() and f.data_ptr() + f.nbytes <= o.data_ptr() + o.nbytes
                for o in outs) for f in flat]
    return val, outs, same


def sec_subgroups(ctx, chk, full):
    w, r = ctx.world_size, ctx.rank
    members = [0, 2] if w >= 3 else [1]
    chk.note(f"new_group({members})")
    g = dist.new_group(members)
    gr = dist.new_group(members, backend="gloo")
    if r in members:
        for dtype, op in [(torch.float32, "SUM"), (torch.int64, "MAX"), (torch.bool, "PRODUCT")]:
            _allreduce_one(ctx, chk, dtype, op, 10007, f"new_group{members}", group=g, ref_group=gr,
                           members=members)
        for algo in ["ring", "tree", "sharded"]:
            if set_algo(ctx, chk, algo, group=g):
                _allreduce_one(ctx, chk, torch.float32, "SUM", 10007, f"new_group{members} {algo}", group=g,
                               ref_group=gr, members=members, expect_algo=algo if len(members) > 1 else None)
        set_algo(ctx, chk, "auto", group=g)
        what = f"new_group{members} broadcast src=global {members[-1]}"
        chk.note(what)
        t = make_input(r, torch.int32, 999, salt="subbc")
        exp = make_input(members[-1], torch.int32, 999, salt="subbc")
        if chk.call(what, lambda: dist.broadcast(t, src=members[-1], group=g)):
            chk.compare(what, t, exp, exact=True)
        what = f"new_group{members} all_gather_into_tensor"
        chk.note(what)
        out = torch.zeros(len(members) * 77)
        if chk.call(what, lambda: dist.all_gather_into_tensor(out, make_input(r, torch.float32, 77, salt="subag"),
                                                              group=g)):
            chk.compare(what, out, torch.cat([make_input(m, torch.float32, 77, salt="subag") for m in members]),
                        exact=True)
        what = f"new_group{members} get_rank/get_world_size"
        if dist.get_rank(g) != members.index(r) or dist.get_world_size(g) != len(members):
            chk.fail(what, f"got rank {dist.get_rank(g)} size {dist.get_world_size(g)}")
    # everybody: a second full-world pycomm group next to the default one
    chk.note("new_group(all ranks)")
    gall = dist.new_group()
    _allreduce_one(ctx, chk, torch.float32, "SUM", 5000, "new_group(all)", group=gall, ref_group=ctx.ref)
    # new_subgroups
    if w == 2:
        desc, make = "new_subgroups(group_size=1)", lambda **kw: dist.new_subgroups(group_size=1, **kw)
        layout = [[0], [1]]
    elif w == 3:
        layout = [[0, 2], [1]]
        desc, make = f"new_subgroups_by_enumeration({layout})", \
            lambda **kw: dist.new_subgroups_by_enumeration(layout, **kw)
    else:
        layout = [list(range(i, i + 2)) for i in range(0, w, 2)]
        desc, make = "new_subgroups(group_size=2)", lambda **kw: dist.new_subgroups(group_size=2, **kw)
    chk.note(desc)
    cur, _ = make()
    cur_ref, _ = make(backend="gloo")
    mine = next(m for m in layout if r in m)
    for dtype, op in [(torch.float64, "SUM"), (torch.int8, "MIN"), (torch.float16, "AVG")]:
        _allreduce_one(ctx, chk, dtype, op, 3001, desc, group=cur, ref_group=cur_ref, members=mine)
    what = f"{desc} barrier"
    chk.call(what, lambda: dist.barrier(group=cur))


def sec_reinit(ctx, chk, full):
    """destroy_process_group, then init_process_group again in the same process."""
    w, r = ctx.world_size, ctx.rank
    for round_ in range(2):
        what = f"destroy_process_group + init_process_group (round {round_})"
        chk.note(what)
        dist.destroy_process_group()
        ctx.ref = None
        if not chk.call(what, lambda: dist.init_process_group(
                ctx.backend, init_method=ctx.init_method(f"reinit{round_}"), rank=r, world_size=w,
                timeout=ctx.timeout())):
            return
        ctx.ref = dist.new_group(backend="gloo")
        for dtype, op, n in [(torch.float32, "SUM", 10007), (torch.int32, "BOR", w + 1), (torch.bool, "SUM", 5)]:
            _allreduce_one(ctx, chk, dtype, op, n, f"after re-init {round_}")
        what = f"broadcast after re-init {round_}"
        t = make_input(r, torch.float64, 100, salt="rbc")
        if chk.call(what, lambda: dist.broadcast(t, src=w - 1)):
            chk.compare(what, t, make_input(w - 1, torch.float64, 100, salt="rbc"), exact=True)
        what = f"new_group after re-init {round_}"
        chk.note(what)
        sub = dist.new_group(list(range(w)))
        _allreduce_one(ctx, chk, torch.float64, "SUM", 100, f"new_group after re-init {round_}", group=sub)


SECTIONS = {
    "all_reduce": sec_all_reduce,
    "all_reduce_layouts": sec_all_reduce_layouts,
    "broadcast": sec_broadcast,
    "reduce": sec_reduce,
    "all_gather": sec_all_gather,
    "all_gather_into_tensor": sec_all_gather_into_tensor,
    "gather": sec_gather,
    "scatter": sec_scatter,
    "reduce_scatter": sec_reduce_scatter,
    "reduce_scatter_tensor": sec_reduce_scatter_tensor,
    "all_to_all": sec_all_to_all,
    "all_to_all_single": sec_all_to_all_single,
    "barrier": sec_barrier,
    "p2p": sec_p2p,
    "non_contiguous": sec_non_contiguous,
    "all_to_all_in_place": sec_all_to_all_in_place,
    "staged_order": sec_staged_order,
    "coalesced": sec_coalesced,
    "async": sec_async,
    "subgroups": sec_subgroups,
    "reinit": sec_reinit,  # must stay last: it destroys the groups
}
SECTIONS_W4 = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "all_to_all_in_place", "staged_order", "p2p", "subgroups"]


def collectives_worker(ctx, sections, full):
    for name in sections:
        chk = Checker(ctx, name)
        t0 = time.monotonic()
        try:
            SECTIONS[name](ctx, chk, full)
        except Exception:  # noqa: BLE001  (an unguarded call raised: report, keep going)
            chk.fail("section aborted", traceback.format_exc(limit=6))
        try:
            chk.finish()
        except Exception as e:  # noqa: BLE001
            chk.fail("cross-rank digest exchange (gloo)", describe_exc(e))
        ctx.report(name, {"failures": chk.failures, "seconds": time.monotonic() - t0})
    return True


# --------------------------------------------------------------------------
# tests (parent side)
# --------------------------------------------------------------------------

# Every world size with the shared-memory path forced on and forced off (TCP).
@pytest.fixture(scope="module", params=[(w, t) for t in ("shm", "tcp") for w in (2, 3, 4)],
                ids=lambda p: f"w{p[0]}-{p[1]}")
def collectives_run(request):
    w, transport = request.param
    sections = list(SECTIONS) if w < 4 else SECTIONS_W4
    # the 2-rank runs start fresh interpreters: a forked rank leaves through os._exit, and
    # every collective's state should also be seen through a real interpreter exit
    res = spawn_run(collectives_worker, w, backend=BACKEND, args=(sections, w < 4),
                    timeout_s=240, pg_timeout_s=30, env={"PYCOMM_TRANSPORT": transport},
                    start_method="spawn" if w == 2 else None)
    return w, sections, res


@pytest.mark.parametrize("section", list(SECTIONS))
def test_collective(collectives_run, section):
    w, sections, res = collectives_run
    if section not in sections:
        pytest.skip(f"{section} is not run at world size {w}")
    done = [r for r in range(w) if section in res.reports.get(r, {})]
    if len(done) < w:
        pytest.fail(f"section {section!r} did not complete on ranks "
                    f"{sorted(set(range(w)) - set(done))}:\n{res.failure_message()}", pytrace=False)
    failures = [f for r in range(w) for f in res.reports[r][section]["failures"]]
    if failures:
        pytest.fail(f"{section} (world size {w}, backend {BACKEND!r} vs gloo): " + format_failures(failures),
                    pytrace=False)


def test_run_completed(collectives_run):
    """The spawned run as a whole: no crash, hang or teardown failure."""
    w, sections, res = collectives_run
    res.check()


def init_algo_worker(ctx):
    """Small sweep used with the tcp:// / env:// rendezvous and PYCOMM_ALGO."""
    chk = Checker(ctx, "init/env")
    w = ctx.world_size
    algo = os.environ.get("PYCOMM_ALGO")
    if ctx.backend == "pycomm":
        import pycomm

        if pycomm.get_algorithm() != algo:
            chk.fail("pycomm.get_algorithm()", f"is {pycomm.get_algorithm()!r} with PYCOMM_ALGO={algo!r}")
    for dtype in [torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool]:
        for op in ["SUM", "MAX"] + (["AVG"] if dtype.is_floating_point else ["BXOR"]):
            for n in sizes_for(w):
                _allreduce_one(ctx, chk, dtype, op, n, "env-selected", expect_algo=algo)
    what = "broadcast"
    t = make_input(ctx.rank, torch.float32, 1000, salt="ib")
    if chk.call(what, lambda: dist.broadcast(t, src=0)):
        chk.compare(what, t, make_input(0, torch.float32, 1000, salt="ib"), exact=True)
    chk.finish()
    return chk.failures


@pytest.mark.parametrize("init,algo", [("tcp", "ring"), ("env", "tree"), ("file", "sharded")])
def test_init_method_and_env_algo(init, algo):
    """init_method tcp:// and env:// (file:// is used everywhere else), with
    the all-reduce algorithm chosen through the PYCOMM_ALGO environment variable."""
    rets = spawn_run(init_algo_worker, 3, backend=BACKEND, init=init, env={"PYCOMM_ALGO": algo},
                     timeout_s=120, pg_timeout_s=30).check().returns
    failures = [f for r in sorted(rets) for f in rets[r]]
    assert not failures, f"init={init} PYCOMM_ALGO={algo}: " + format_failures(failures)


def _switches_of_other_threads():
    """Voluntary context switches of every thread of this process but the main one."""
    counts = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        counts[tid] = int(line.split()[1])
        except FileNotFoundError:  # the thread ended
            pass
    return counts


def blocking_calls_worker(ctx):
    x = torch.ones(2)
    for _ in range(20):
        dist.all_reduce(x)
    before = _switches_of_other_threads()
    for _ in range(200):
        dist.all_reduce(x)
    after = _switches_of_other_threads()
    woken = max((after[t] - before[t] for t in after if t in before), default=0)
    # The worker still runs what is queued: async calls, then a blocking one behind them.
    x.fill_(1)
    works = [dist.all_reduce(x, async_op=True) for _ in range(3)]
    dist.all_reduce(x)
    for w in works:
        w.wait()
    return {"woken": woken, "result": float(x[0])}


def blocking_call_work_worker(ctx):
    import torch._C._distributed_c10d as c10d_impl

    pg = dist.group.WORLD
    out = {}
    x = torch.ones(2)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    # A blocking call that ran on the caller's thread hands back no Work (torch's
    # frontend waits only on a Work it got) and is complete when it returns.
    out["blocking"] = repr(pg.allreduce([x], opts))
    out["blocking_sum"] = float(x[0])
    barrier_opts = dist.BarrierOptions()
    barrier_opts.asyncOp = False
    out["barrier"] = repr(pg.barrier(barrier_opts))
    x.fill_(1)
    work = pg.allreduce([x])  # asyncOp defaults to True: a Work, as before
    out["async_is_work"] = work is not None
    work.wait()
    out["async_sum"] = float(x[0])
    # torch's in-flight work registry needs a Work for every call it registers.
    c10d_impl._set_allow_inflight_collective_as_graph_input(True)
    try:
        x.fill_(1)
        work = pg.allreduce([x], opts)
        out["inflight_is_work"] = work is not None
        if work is not None:
            work.wait()
        out["inflight_sum"] = float(x[0])
    finally:
        c10d_impl._set_allow_inflight_collective_as_graph_input(False)
    # Under the profiler the Work carries the call's event.
    x.fill_(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        work = pg.allreduce([x], opts)
        out["profiled_is_work"] = work is not None
        if work is not None:
            work.wait()
    out["profiled_event"] = any(e.name == "pycomm:allreduce" for e in prof.events())
    # A failure of a blocking call is raised by the call itself: the ranks' sizes differ.
    try:
        dist.all_reduce(torch.ones(2 + ctx.rank))
        out["mismatch"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the type is the point
        out["mismatch"] = type(exc).__name__
    return out


def test_blocking_call_returns_no_work():
    """A blocking collective run on the caller's thread returns no Work (None in
    Python), which spares torch's frontend the Work, its Future and the wait(); an
    async call, a call under the profiler, and one under torch's in-flight work
    registry still get theirs, and a failure surfaces from the call."""
    rets = spawn_run(blocking_call_work_worker, 2, backend=BACKEND, make_ref=False,
                     timeout_s=120, pg_timeout_s=30).check().returns
    for rank, out in rets.items():
        assert out["blocking"] == "None" and out["blocking_sum"] == 2.0, (rank, out)
        assert out["barrier"] == "None", (rank, out)
        assert out["async_is_work"] and out["async_sum"] == 2.0, (rank, out)
        assert out["inflight_is_work"] and out["inflight_sum"] == 2.0, (rank, out)
        assert out["profiled_is_work"] and out["profiled_event"], (rank, out)
        assert out["mismatch"] == "DistBackendError", (rank, out)


def test_blocking_calls_leave_the_worker_asleep():
    """A blocking call with nothing queued runs on the caller's thread; it must not
    wake the group's worker thread each time (on a host with more ranks than cores
    that wake-up cost a context switch per call: 60 instead of 24 us per 8-byte
    all-reduce with 4 ranks on 2 cores)."""
    rets = spawn_run(blocking_calls_worker, 2, backend=BACKEND, make_ref=False,
                     timeout_s=120, pg_timeout_s=30).check().returns
    for rank, out in rets.items():
        assert out["woken"] < 20, (f"rank {rank}: another thread woke {out['woken']} times in 200 "
                                   "blocking calls (70 before the fix)")
        assert out["result"] == 2 ** 4, out


def p2p_future_callback_worker(ctx):
    out = {}
    if ctx.rank == 0:
        first, second = torch.zeros(1000), torch.zeros(1000)

        def receive_the_second(fut):
            with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
                out["callback_thread"] = f.read().strip()
            dist.recv(second, src=1, tag=2)  # blocks in the callback
            return fut.value()
        work = dist.irecv(first, src=1, tag=1)
        chained = work.get_future().then(receive_the_second)
        dist.barrier(group=ctx.ref)  # rank 1 sends once the callback is attached
        t0 = time.monotonic()
        chained.wait()
        out["seconds"] = time.monotonic() - t0
        out["first"], out["second"] = first[0].item(), second[-1].item()
        # wait() covers the future too: its value is there the moment wait() returns.
        for i in range(50):
            t = torch.zeros(3)
            w = dist.irecv(t, src=1, tag=10 + i)
            w.wait()
            out.setdefault("values", []).append(w.get_future().value()[0][0].item())
    else:
        dist.barrier(group=ctx.ref)
        dist.send(torch.full((1000,), 1.0), dst=0, tag=1)
        time.sleep(0.2)
        dist.send(torch.full((1000,), 2.0), dst=0, tag=2)
        for i in range(50):
            dist.send(torch.full((3,), float(i)), dst=0, tag=10 + i)
    dist.barrier()
    return out


def test_p2p_future_callback_may_wait_on_another_receive():
    """A callback on an irecv's Future that itself waits on a receive: point-to-point
    requests complete on the TCP I/O thread, which used to run the Future's callbacks
    too, so the inner receive waited for the thread it was blocking and timed out (10 s
    here, the group timeout). Callbacks now run on the group's completion pool."""
    rets = spawn_run(p2p_future_callback_worker, 2, backend=BACKEND,
                     env={"PYCOMM_TRANSPORT": "tcp"}, timeout_s=120, pg_timeout_s=10).check().returns
    out = rets[0]
    assert out["first"] == 1.0 and out["second"] == 2.0, out
    assert out["seconds"] < 5, out
    assert out["callback_thread"] == "pycomm-done", out
    assert out["values"] == [float(i) for i in range(50)], out


def _source_rank_refused(work):
    """True when work._source_rank() raises torch's "only on a receive" error."""
    try:
        work._source_rank()
        return "no error"
    except RuntimeError as exc:
        return "may only be called" in str(exc)


def p2p_sizes_worker(ctx):
    out = {}
    for name, group in (("pycomm", None), ("gloo", ctx.ref)):
        res = out[name] = {}
        if ctx.rank == 1:
            dist.send(torch.ones(2), dst=0, group=group)                     # into a larger buffer
            dist.send(torch.full((3,), 2.0), dst=0, group=group)             # into one of its size, from any rank
            work = dist.isend(torch.ones(1), dst=0, group=group)
            work.wait()
            res["send_source_rank"] = _source_rank_refused(work)
        else:
            larger = torch.zeros(3)
            res["src"] = dist.recv(larger, src=1, group=group)
            res["larger"] = larger.tolist()
            exact = torch.zeros(3)
            res["any_src"] = dist.recv(exact, group=group)
            res["exact"] = exact.tolist()
            dist.recv(torch.zeros(1), src=1, group=group)
        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
        work.wait()
        res["collective_source_rank"] = _source_rank_refused(work)
    # A message larger than the receive fails it (gloo aborts the process there); the
    # group stays usable, since the stream stays in step.
    if ctx.rank == 1:
        dist.send(torch.ones(4), dst=0)
    else:
        try:
            dist.recv(torch.zeros(3), src=1)
            out["smaller_buffer"] = "no error"
        except dist.DistBackendError as exc:
            out["smaller_buffer"] = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


def test_p2p_receives_into_a_larger_buffer_and_source_rank_as_gloo():
    """As gloo (and MPI): a receive takes a message up to its buffer's size and leaves the
    rest of the buffer as it was (pycomm failed it: "sent 8 bytes where 12 were
    expected"); source_rank() exists only on a receive's work (pycomm returned the
    destination of a send and -1 for a collective)."""
    rets = spawn_run(p2p_sizes_worker, 2, backend=BACKEND, timeout_s=120, pg_timeout_s=20).check().returns
    for rank, out in rets.items():
        assert out["pycomm"] == out["gloo"], (rank, out)
        assert out["after"] == 2.0, (rank, out)
    r0 = rets[0]["pycomm"]
    assert r0["src"] == 1 and r0["larger"] == [1.0, 1.0, 0.0], r0
    assert r0["any_src"] == 1 and r0["exact"] == [2.0, 2.0, 2.0], r0
    assert r0["collective_source_rank"] is True and rets[1]["pycomm"]["send_source_rank"] is True, rets
    assert "rank 1 sent 16 bytes where at most 12 were expected" in rets[0]["smaller_buffer"], rets[0]


def p2p_wait_timeout_worker(ctx):
    import datetime
    out = {}
    if ctx.rank == 0:
        got = torch.zeros(4)
        work = dist.irecv(got, src=1, tag=3)
        try:
            work.wait(datetime.timedelta(seconds=0.3))
            out["first_wait"] = "no error"
        except dist.DistBackendError as exc:
            out["first_wait"] = str(exc)
        out["completed_after_timeout"] = work.is_completed()
        dist.barrier(group=ctx.ref)  # now rank 1 sends
        work.wait()
        out["got"] = got.tolist()
    else:
        dist.barrier(group=ctx.ref)
        dist.send(torch.full((4,), 5.0), dst=0, tag=3)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


def test_p2p_wait_with_a_short_timeout_leaves_the_receive_posted():
    """docs/failures.md: a wait(timeout) shorter than the group timeout raises and leaves
    the receive posted (the group usable); a later wait() returns with the message."""
    rets = spawn_run(p2p_wait_timeout_worker, 2, backend=BACKEND, timeout_s=120, pg_timeout_s=20).check().returns
    r0 = rets[0]
    assert "wait() timed out waiting for rank 1" in r0["first_wait"], r0
    assert r0["completed_after_timeout"] is False, r0
    assert r0["got"] == [5.0] * 4, r0
    assert rets[0]["after"] == rets[1]["after"] == 2.0, rets


def different_roots_tcp_worker(ctx):
    x = torch.full((4,), float(ctx.rank))
    dist.broadcast(x, src=ctx.rank)  # each rank names itself the root: both only send
    out = {"broadcast": x.tolist()}
    try:
        dist.all_reduce(torch.ones(1))
        out["next"] = "no error"
    except dist.DistBackendError as exc:
        out["next"] = str(exc)
    return out


def test_broadcast_with_different_roots_fails_at_the_next_call_over_tcp():
    """2 ranks over TCP, each naming itself broadcast's root: both only send, so no
    receive meets the other's message in that call (it returns, as each root's does).
    Its message used to wait unread for good and each rank kept its own tensor without
    an error; now the next call's receive meets it and fails, naming the collective."""
    rets = spawn_run(different_roots_tcp_worker, 2, backend=BACKEND, make_ref=False,
                     env={"PYCOMM_TRANSPORT": "tcp"}, timeout_s=120, pg_timeout_s=20).check().returns
    for rank, out in rets.items():
        assert out["next"] != "no error", (rank, out)
    assert len(rets) == 2, rets
    assert any(re.search(r"rank \d sent a message in collective #\d+ that this rank finished without it",
                         out["next"]) for out in rets.values()), rets


def different_calls_tcp_worker(ctx, case):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (ctx.rank + 1)
    try:
        if case == "dtype":  # the same bytes: float32 against int32
            dist.all_reduce(x if ctx.rank == 0 else x.to(torch.int32))
        elif case == "reduce_op":
            dist.all_reduce(x, op=dist.ReduceOp.SUM if ctx.rank == 0 else dist.ReduceOp.MAX)
        elif case == "collective":  # 16 bytes each: all_reduce against broadcast from rank 0
            if ctx.rank == 0:
                dist.broadcast(x, src=0)
            else:
                dist.all_reduce(x)
        elif case == "widths":  # 4 float32 against 2 float64
            dist.all_reduce(x if ctx.rank == 0 else x[:2].to(torch.float64))
    except dist.DistBackendError as exc:
        return str(exc)
    # A broadcast's root only sends: it may return before a peer has found the
    # mismatch, and learns of it at its next call.
    try:
        dist.all_reduce(torch.ones(1))
        return "no error: " + str(x.tolist())
    except dist.DistBackendError as exc:
        return "next call: " + str(exc)


@pytest.mark.parametrize("case", ["dtype", "reduce_op", "collective", "widths"])
def test_calls_that_move_the_same_bytes_fail_over_tcp(case):
    """Over TCP, ranks whose calls differ but move the same bytes (another dtype of the
    same size, another reduce op, another collective) computed garbage without an error
    (gloo does too for the first two); a collective's tags now carry a hash of its call,
    and the receive that meets a message of another call fails, on every rank."""
    rets = spawn_run(different_calls_tcp_worker, 2, backend=BACKEND, args=(case,), make_ref=False,
                     env={"PYCOMM_TRANSPORT": "tcp"}, timeout_s=120, pg_timeout_s=20).check().returns
    for rank, err in rets.items():
        assert not err.startswith("no error"), (rank, err)
        assert case == "collective" or not err.startswith("next call"), (rank, err)
    assert any("is in another call at this collective" in err for err in rets.values()), rets
