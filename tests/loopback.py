"""The loopback harness for the algorithm tests: pycomm's algorithms with threads
as ranks over the loopback transport, on torch tensors. The C++ side
(tests/cpp/loopback_module.cc) is a torch-free module the tests build
(cpp_build.py), so the production pycomm._C carries no test code."""
from __future__ import annotations

import functools
import math

import torch

import cpp_build

__all__ = ["build", "collective", "allreduce_quantized", "allreduce_sparse", "allreduce_coo", "set_cpu_isa"]


@functools.lru_cache(maxsize=None)
def build():
    """The compiled module (built once per content, cached across runs)."""
    return cpp_build.python_module("pycomm_loopback", f"{cpp_build.ROOT}/tests/cpp/loopback_module.cc")



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")  # torch.float32 -> "float32", as dtype.h names it


def _floats(tensors, what):
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{what} must be contiguous CPU float32 tensors")


def collective(collective, tensors, op="sum", algorithm="auto", root=0, segment_bytes=256 * 1024,
               timeout_seconds=60.0):
    """Runs one collective on len(tensors) threads; tensor i belongs to rank i and is
    updated in place. Returns the outputs (new tensors for gather-like ops)."""
    n = len(tensors)
    dtypes = {t.dtype for t in tensors}
    counts = {t.numel() for t in tensors}
    if len(dtypes) != 1 or len(counts) != 1 or not all(t.is_contiguous() for t in tensors):
        raise ValueError("tensors must be contiguous, of one dtype and one size")
    count = counts.pop()
    if collective == "allgather":
        outputs = [torch.empty(n * t.numel(), dtype=t.dtype) for t in tensors]
    elif collective == "reduce_scatter":
        outputs = [torch.empty(t.numel() // n, dtype=t.dtype) for t in tensors]
    elif collective == "alltoall":
        outputs = [torch.empty_like(t) for t in tensors]
    else:
        outputs = list(tensors)
    build().collective(collective, [t.data_ptr() for t in tensors], [o.data_ptr() for o in outputs],
                         count, _dtype_name(dtypes.pop()), op, algorithm, root, segment_bytes,
                         timeout_seconds)
    return outputs


def allreduce_quantized(tensors, residuals=None, bits=8, block=256, stochastic=False, seed=0, segments=(),
                        timeout_seconds=60.0):
    """tensors[r] <- the quantized sum (in place); residuals[r] updated when given."""
    _floats(tensors, "tensors")
    count = tensors[0].numel() if tensors else 0
    if any(t.numel() != count for t in tensors):
        raise ValueError("tensors must have one size")
    if residuals is not None:
        _floats(residuals, "residuals")
        if len(residuals) != len(tensors):
            raise ValueError("one residual per rank")
        for r, (e, t) in enumerate(zip(residuals, tensors)):
            if e.numel() != t.numel():
                raise ValueError(f"residual {r} differs in size from its tensor")
    build().allreduce_quantized([t.data_ptr() for t in tensors],
                                  None if residuals is None else [e.data_ptr() for e in residuals],
                                  count, bits, block, stochastic, seed, list(segments), timeout_seconds)


def allreduce_sparse(indices, values, count, residuals=None, value_dtype="float32", keep_density=0.0,
                     segments=(), timeout_seconds=60.0):
    """Returns (outputs, bytes sent per rank, entries kept per owner)."""
    n = len(indices)
    _floats(values, "values")
    if len(values) != n:
        raise ValueError("one values tensor per rank")
    for idx, val in zip(indices, values):
        if idx.dtype != torch.int64 or not idx.is_contiguous() or idx.numel() != val.numel():
            raise ValueError("indices must be contiguous int64 tensors as long as the values")
    if residuals is not None:
        _floats(residuals, "residuals")
        if len(residuals) != n:
            raise ValueError("one residual per rank")
        if any(e.numel() != count for e in residuals):
            raise ValueError("residuals must have `count` elements")
    outputs = [torch.empty(count) for _ in range(n)]
    sent, kept = build().allreduce_sparse(
        [i.data_ptr() for i in indices], [v.data_ptr() for v in values], [i.numel() for i in indices],
        [o.data_ptr() for o in outputs], count, None if residuals is None else [e.data_ptr() for e in residuals],
        value_dtype, keep_density, list(segments), timeout_seconds)
    return outputs, sent, kept


def allreduce_coo(rows, values, row_count, op="sum", shm=False, timeout_seconds=60.0):
    """The COO all-reduce (allreduce_coo.cc) on len(rows) threads: rank r holds row ids
    rows[r] (int64, any order, repeats allowed) with values[r] (nnz x row elements, one
    dtype). Returns each rank's (rows, values) result, values shaped (nnz, row elements)."""
    n = len(rows)
    if len(values) != n:
        raise ValueError("one values tensor per rank")
    dtypes = {v.dtype for v in values}
    widths = {math.prod(v.shape[1:]) for v in values}
    if len(dtypes) != 1 or len(widths) != 1:
        raise ValueError("values must have one dtype and one row width")
    dtype, width = dtypes.pop(), widths.pop()
    for r, v in zip(rows, values):
        if r.dtype != torch.int64 or not r.is_contiguous() or not v.is_contiguous() or r.numel() != v.shape[0]:
            raise ValueError("rows must be contiguous int64, one per row of contiguous values")
    out = build().allreduce_coo([r.data_ptr() for r in rows], [v.data_ptr() for v in values],
                                [r.numel() for r in rows], row_count, width, _dtype_name(dtype), op, shm,
                                timeout_seconds)
    return [(torch.tensor(r, dtype=torch.int64),
             torch.frombuffer(bytearray(b), dtype=dtype).reshape(len(r), width) if len(b) else
             torch.empty(len(r), width, dtype=dtype))
            for r, b in out]


def set_cpu_isa(name: str) -> None:
    """This module's reduction kernels are its own copy: pick their instruction set."""
    build().set_cpu_isa(name)
