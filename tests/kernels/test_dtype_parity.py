"""Drop-in parity with gloo where torch does not convert the dtype for the backend.

torch's Python layer hands complex tensors to a backend as (re, im) pairs for all_reduce,
broadcast, all_gather and send, but not for reduce and reduce_scatter: gloo sums them,
pycomm refused them (TypeError). Point-to-point moves bytes: gloo sends any dtype,
pycomm refused those it does not reduce (uint16/32/64, float8). And a group's timeout
set through the backend object (gloo's ``_set_default_timeout`` / ``options``; torch's
``_set_pg_timeout`` reaches only gloo and NCCL) did not exist on pycomm.
"""
import datetime

import pytest
import torch

from mp_util import spawn_run

P2P_DTYPES = ["uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "complex128"]


def _complex_worker(ctx):
    import torch.distributed as dist

    r, w = ctx.rank, ctx.world_size
    out = {}
    for dtype in (torch.complex64, torch.complex128):
        def make(n, base=0):
            return torch.complex(torch.arange(n, dtype=torch.float64) + 10 * r + base,
                                 torch.arange(n, dtype=torch.float64) * 0.5 - r).to(dtype)

        for op in ("SUM", "AVG"):
            reduce_op = getattr(dist.ReduceOp, op)
            t = make(5)
            dist.reduce(t, dst=0, op=reduce_op)
            out[(str(dtype), op, "reduce")] = t.tolist() if r == 0 else None  # non-roots' are unspecified
            o = torch.zeros(3, dtype=dtype)
            dist.reduce_scatter(o, [make(3, 100 * j) for j in range(w)], op=reduce_op)
            out[(str(dtype), op, "reduce_scatter")] = o.tolist()
            o = torch.zeros(3, dtype=dtype)
            dist.reduce_scatter_tensor(o, make(3 * w), op=reduce_op)
            out[(str(dtype), op, "reduce_scatter_tensor")] = o.tolist()
    return out


def test_complex_reduce_and_reduce_scatter_match_gloo():
    got = {b: spawn_run(_complex_worker, 2, backend=b, make_ref=False, timeout_s=90).check().returns
           for b in ("pycomm", "gloo")}
    for rank in (0, 1):
        assert got["pycomm"][rank] == got["gloo"][rank], rank


def _p2p_worker(ctx):
    import torch.distributed as dist

    out = {}
    for name in P2P_DTYPES:
        dtype = getattr(torch, name)
        sent = (torch.arange(7, dtype=torch.float32) * 1.5 + 1).to(dtype)
        if ctx.rank == 0:
            dist.send(sent, dst=1)
            work = dist.irecv(torch.zeros(7, dtype=dtype), src=1)
            work.wait()
        else:
            got = torch.zeros(7, dtype=dtype)
            dist.recv(got, src=0)
            dist.isend(got, dst=0).wait()
            out[name] = (got.view(torch.uint8).tolist(), sent.view(torch.uint8).tolist())
    return out


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_send_and_recv_move_any_dtype(backend):
    rets = spawn_run(_p2p_worker, 2, backend=backend, make_ref=False, timeout_s=90).check().returns
    for name in P2P_DTYPES:
        got, sent = rets[1][name]
        assert got == sent, name


def _timeout_worker(ctx):
    import time

    import torch.distributed as dist

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    backend._set_default_timeout(datetime.timedelta(seconds=2))
    out = {"timeout": backend.options._timeout.total_seconds()}
    if ctx.rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))  # rank 1 does not take part
            out["error"] = None
        except Exception as e:  # noqa: BLE001
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - start
        ctx.mark_done()
    else:
        ctx.wait_done(0, limit_s=30)
    return out


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_default_timeout_set_through_the_backend_object(backend):
    rets = spawn_run(_timeout_worker, 2, backend=backend, make_ref=False, timeout_s=90,
                     pg_timeout_s=60).check().returns
    assert rets[0]["timeout"] == 2.0 and rets[1]["timeout"] == 2.0
    assert rets[0]["error"] is not None, "the all-reduce without rank 1 should time out"
    assert rets[0]["seconds"] < 10, f"timed out after {rets[0]['seconds']:.1f} s, not 2"
