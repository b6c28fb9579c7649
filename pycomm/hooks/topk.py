"""DDP communication hooks: dense all-reduce, top-k sparsification, blockwise quantization and
low-rank (PowerSGD) compression.

Usage (any backend; the pycomm backend is not required)::

    from pycomm.hooks import TopKState, topk_hook, QuantizeState, quantize_hook, fp16_wrapper
    ddp.register_comm_hook(TopKState(density=0.01), topk_hook)
    ddp.register_comm_hook(QuantizeState(bits=4), quantize_hook)
    ddp.register_comm_hook(TopKState(), fp16_wrapper(topk_hook))   # values sent as float16
    ddp.register_comm_hook(PowerSGDState(rank=4), powersgd_hook)   # rank-4 factors

Every hook returns a ``Future`` of the bucket's gradient averaged over the group; the
result is bit-identical on every rank (each rank decodes every rank's contribution and
sums them in rank order), so replicas stay in step.

Granularity. Compression works **per parameter** inside a bucket: top-k keeps
``ceil(density * numel)`` entries of every parameter (per layer, as Deep Gradient
Compression does), and quantization blocks never straddle two parameters. Error-feedback
residuals are stored per parameter, and stochastic rounding / threshold sampling draws
from a generator seeded by ``(seed, rank, step, parameter)``. Hence a step's result
depends only on each parameter's gradient, not on how DDP groups parameters into
buckets: DDP's bucket rebuild after the first iteration, a fresh DDP after loading a
checkpoint, and a different ``bucket_cap_mb`` all give the same numbers.

Parameters are keyed by the order in which the hook first sees them (DDP's first
iteration: bucket 0 first, within a bucket in ``bucket.parameters()`` order), which is the
same in every fresh DDP over the same model; checkpoints store residuals under these
ordinals. One state object serves one model.

Exchange. On a pycomm group (``exchange="auto"``, the default) the hooks encode with the
C++ kernels (``pycomm._C.kernels``) and exchange through pycomm's compressed collectives
(csrc/algorithms/allreduce_sparse.cc, allreduce_quantized.cc): rank c owns chunk c of every
parameter, receives every rank's compressed contribution to it, sums them in float32 in rank
order, re-selects (top-k) or requantizes the sum, feeding its own error back through its
residual, and sends the result to every rank; a rank sends about 2 (world - 1) / world of
the compressed size. Elsewhere, or with ``exchange="allgather"``: top-k all-gathers every
rank's ``(int32 indices, values)``, scatter-adds all ranks' entries and divides by the world
size (a dense all-reduce of the sparsified bucket when that moves fewer bytes: ``world * k *
(4 + value_bytes) >= 2 * numel * element_bytes``); quantize all-gathers every rank's packed
codes and float32 scales, dequantizes every rank's and averages. :func:`_compressed_collective`
is the one place that chooses.

Hooks are annotated ``-> torch.futures.Future[torch.Tensor]`` (DDP checks the annotation),
so this module does not use ``from __future__ import annotations``.

Checkpoints: ``state.state_dict()`` holds plain Python values and tensors (torch.save-able,
read back with ``torch.load(..., weights_only=True)``), each rank's tensors under a key
naming the rank; ``load_state_dict`` restores residuals and the step counter, and refuses
another rank's state or one saved at another world size.
"""
import functools
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..compression import (
    SUPPORTED_BITS,
    QuantizedTensor,
    dequantize_blockwise,
    quantize_blockwise,
    topk_approx,
    topk_count,
    topk_exact,
)

__all__ = [
    "AllreduceState",
    "allreduce_hook",
    "TopKState",
    "topk_hook",
    "QuantizeState",
    "quantize_hook",
    "PowerSGDState",
    "powersgd_hook",
    "fp16_wrapper",
    "bf16_wrapper",
    "rank_state",
]

_ALGORITHMS = ("auto", "ring", "tree", "sharded")
# "auto": pycomm's compressed collectives on pycomm groups, all_gather elsewhere;
# "allgather": the all_gather exchange everywhere (the reference path).
_EXCHANGES = ("auto", "allgather")
# Parameters smaller than this use the exact top-k kernel even when exact=False: since the
# exact kernel collects its candidates above a sampled bound (kernels/cpu/topk.cc), it is as
# fast as the sampled-threshold kernel up to 2^23 elements (topk_ef, one thread, 1%: 2^20
# 0.86 against 1.60 ms, 2^23 11.8 against 13.2 ms; measured on this machine, 2026-11-23).
_APPROX_MIN_NUMEL = 1 << 23
# CUDA tensors keep the earlier threshold: the CUDA kernels were not measured for this.
_APPROX_MIN_NUMEL_CUDA = 1 << 20
# TopKState(schedule=...): "bucket" starts each bucket's sparse all-reduce as DDP hands the
# bucket over; "step" encodes each bucket as it comes and sends the whole step in one.
_SCHEDULES = ("bucket", "step")
_VALUE_DTYPES = {None: None, "float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}
_STATE_VERSION = 2  # 2: each rank's tensors under a key of its own (rank<r>), with its rank and world size
_MASK64 = (1 << 64) - 1

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def _group_size(group) -> int:
    return dist.get_world_size(group)


def _is_pycomm(group) -> bool:
    """Whether ``group`` (None: the default group) runs on the pycomm backend."""
    return _pycomm_backend(group) is not None


def _pycomm_backend(group):
    """The group's ProcessGroupPycomm, or None when it runs on another backend."""
    try:
        from .. import _C

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
        return backend if isinstance(backend, _C.ProcessGroupPycomm) else None
    except Exception:  # noqa: BLE001  (no such backend on the group, or not initialised)
        return None


def _compressed_collective(group, kind: str) -> Optional[Callable]:
    """THE plug-in point for pycomm's compressed collectives.

    For a pycomm ``group``, returns ``fn(state, buffer, world, step, segments) ->
    Future[Tensor]`` that encodes the bucket with the C++ kernels (``pycomm._C.kernels``)
    and averages it with the C++ collective: the sparse all-reduce for ``kind ==
    "topk"``, the two-phase quantized all-reduce for ``kind == "quantize"``. Returns
    None for any other backend; the hooks then use the all_gather exchange.

    The compressed collectives run on host memory. A CUDA bucket is staged: copied to
    the host (which waits for the stream that produced it), compressed and reduced
    there, and the result copied back, so the error-feedback residuals of a CUDA model
    live on the host. The result equals the same bucket's on CPU bit for bit."""
    backend = _pycomm_backend(group)
    if backend is None:
        return None
    fn = {"topk": _topk_pycomm, "quantize": _quantize_pycomm}[kind]

    def run(state, buffer, world, step, segments):
        if buffer.device.type == "cpu":
            return fn(backend, state, buffer, world, step, segments)
        host = buffer.to("cpu")
        return fn(backend, state, host, world, step, segments).then(_copied_into(buffer))

    return run


def _aborts_group_on_error(op: str) -> Callable[[Callable], Callable]:
    """Wraps a hook: when it raises on this rank, a pycomm group is aborted first, telling
    the peers why. A hook that raises before its collective is issued (a residual of the
    wrong size after one rank loaded another model's state, say) otherwise leaves the
    other ranks waiting in that collective until the group's timeout; now they fail at once
    with "rank R aborted the group: its topk_hook raised ValueError: ...". The group is of
    no further use either way: the ranks' calls no longer line up. Other backends cannot
    be aborted from here; their ranks wait as before."""
    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)  # keeps the annotations DDP checks (inspect follows __wrapped__)
        def run(state, bucket):
            try:
                return hook(state, bucket)
            except TypeError:
                raise  # a state of the wrong type: every rank's alike, and the group stays usable
            except Exception as exc:
                backend = _pycomm_backend(getattr(state, "process_group", None))
                if backend is not None:
                    backend.abort_with_reason(f"its {op} raised {type(exc).__name__}: {exc}")
                raise
        return run
    return wrap


def _copied_into(buffer: torch.Tensor):
    def finish(fut):
        buffer.copy_(_future_tensor(fut))  # re-raises a failed collective
        return buffer
    return finish


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _dense_allreduce(buffer: torch.Tensor, group, world: int) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` in place: scale by 1/world first, then SUM. DDP without a hook
    does the same (it multiplies by 1/world as it copies gradients into the bucket), so
    the results are bit-identical to it."""
    buffer.mul_(1.0 / world)
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _all_gather_bytes(payload: torch.Tensor, group, world: int) -> Tuple[torch.futures.Future, torch.Tensor]:
    """All-gather one uint8 payload per rank; returns (future, [world, len] output)."""
    out = payload.new_empty(world * payload.numel())
    fut = _all_gather_single(out, payload, group=group, async_op=True).get_future()
    return fut, out.view(world, payload.numel())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def _future_tensor(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------

class AllreduceState:
    """State of :func:`allreduce_hook`: the process group and the all-reduce algorithm.

    ``algorithm`` (``"auto"``, ``"ring"``, ``"tree"``, ``"sharded"``; None keeps the
    group's setting) is applied with :func:`pycomm.set_algorithm` on the first call, so
    it is a setting of the whole group, not of this hook alone. It needs a pycomm group
    (other backends accept only None or ``"auto"``)."""

    def __init__(self, process_group=None, algorithm: Optional[str] = None):
        if algorithm is not None and algorithm not in _ALGORITHMS:
            raise ValueError(f"pycomm allreduce_hook: algorithm must be one of {', '.join(_ALGORITHMS)} "
                             f"or None (got {algorithm!r})")
        self.process_group = process_group
        self.algorithm = algorithm
        self.step = 0
        self._applied = False

    def _apply_algorithm(self) -> None:
        if self._applied:
            return
        self._applied = True
        if self.algorithm is None:
            return
        if _is_pycomm(self.process_group):
            from .._backend import set_algorithm

            set_algorithm(self.algorithm, self.process_group)
        elif self.algorithm != "auto":
            raise ValueError(f"pycomm allreduce_hook: algorithm {self.algorithm!r} needs a pycomm process "
                             f"group (this group's backend is {dist.get_backend(self.process_group)})")

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "allreduce", "version": _STATE_VERSION, "step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_kind("allreduce_hook", state, "allreduce")
        self.step = int(state.get("step", 0))


@_aborts_group_on_error("allreduce_hook")
def allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Dense gradient averaging (the same numbers as DDP without a hook). ``state``: an
    :class:`AllreduceState`, a process group, or None (default group)."""
    if isinstance(state, AllreduceState):
        state._apply_algorithm()
        group = state.process_group
        if bucket.is_last():
            state.step += 1
    else:
        group = state
    buffer = bucket.buffer()
    return _dense_allreduce(buffer, group, _group_size(group))


# ---------------------------------------------------------------------------
# compressed hooks: shared state
# ---------------------------------------------------------------------------

def _check_kind(op: str, state: Dict[str, Any], kind: str) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"pycomm {op}: load_state_dict expects a dict (got {type(state).__name__})")
    got = state.get("kind")
    if got != kind:
        raise ValueError(f"pycomm {op}: this state_dict is of a {got!r} hook, not {kind!r}")
    version = state.get("version", _STATE_VERSION)
    if version > _STATE_VERSION:
        raise ValueError(f"pycomm {op}: state_dict version {version} is newer than this pycomm "
                         f"understands ({_STATE_VERSION})")


class _CompressionState:
    """Shared machinery: process group, step counter, per-parameter residuals, seeding."""

    _kind = ""
    _op = ""

    def __init__(self, process_group, error_feedback: bool, warmup_steps: int, seed: int,
                 exchange: str = "auto"):
        if int(warmup_steps) < 0:
            raise ValueError(f"pycomm {self._op}: warmup_steps must be >= 0 (got {warmup_steps!r})")
        if exchange not in _EXCHANGES:
            raise ValueError(f"pycomm {self._op}: exchange must be one of {', '.join(_EXCHANGES)} "
                             f"(got {exchange!r})")
        self.exchange = exchange
        self.process_group = process_group
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = int(warmup_steps)
        self.seed = int(seed)
        self.step = 0  # synchronised iterations completed (no_sync() iterations are not counted)
        self._residuals: Dict[int, torch.Tensor] = {}
        self._ordinals: Dict[int, Tuple[weakref.ref, int]] = {}
        self._next_ordinal = 0  # never reused: a dead parameter's id may come back on a new one
        self._flat: Dict[tuple, torch.Tensor] = {}  # per bucket layout: its residuals, one tensor
        self._momenta: Dict[int, torch.Tensor] = {}  # DGC velocities (TopKState(momentum > 0))
        self._generator = torch.Generator()

    # -- parameters ------------------------------------------------------------
    def _ordinal(self, param: torch.Tensor) -> int:
        """The parameter's number, in the order the state first saw it (the same on every
        rank). A parameter that replaces a dead one at the same id() gets a new number:
        counting the table instead (as before) handed it the number of the next new
        parameter too, so two parameters shared a residual; which ids Python reuses
        differs between ranks, so one rank raised while the others waited in the
        collective."""
        entry = self._ordinals.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        ordinal = self._next_ordinal
        self._next_ordinal += 1
        self._ordinals[id(param)] = (weakref.ref(param), ordinal)
        return ordinal

    def _segments(self, bucket, buffer: torch.Tensor) -> List[Tuple[int, int, int]]:
        """(ordinal, offset, numel) of every parameter in the bucket's flat buffer."""
        segments, offset = [], 0
        for param in bucket.parameters():
            numel = param.numel()
            segments.append((self._ordinal(param), offset, numel))
            offset += numel
        if offset != buffer.numel():
            raise ValueError(f"pycomm {self._op}: bucket {bucket.index()} holds {buffer.numel()} elements "
                             f"but its parameters have {offset} (sparse gradients are not supported)")
        return segments

    def _input(self, buffer: torch.Tensor, ordinal: int, offset: int, numel: int,
               grad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This parameter's gradient (float32 copy; ``grad`` instead when given) plus its
        error-feedback residual."""
        source = buffer[offset: offset + numel] if grad is None else grad
        x = source.to(torch.float32, copy=True)
        if self.error_feedback:
            residual = self._residuals.get(ordinal)
            if residual is not None:
                if residual.numel() != numel:
                    raise ValueError(
                        f"pycomm {self._op}: the residual of parameter #{ordinal} has {residual.numel()} "
                        f"elements but the parameter has {numel} (state loaded from another model?)")
                x += residual.to(x.device)
        return x

    def _store_residual(self, ordinal: int, residual: torch.Tensor) -> None:
        if self.error_feedback:
            self._residuals[ordinal] = residual

    def _flat_residual(self, segments, numel: int) -> Optional[torch.Tensor]:
        """The bucket's residuals as one float32 tensor (zeros where a parameter has none),
        or None without error feedback. Every parameter's stored residual becomes a view
        of it, so what a collective writes into it is what the next step feeds back."""
        if not self.error_feedback:
            return None
        key = tuple(segments)
        cached = self._flat.get(key)
        if cached is not None and all(
                self._residuals.get(o) is not None and self._residuals[o].data_ptr() == cached[off: off + n].data_ptr()
                for o, off, n in segments if n):
            return cached  # the residuals are still views of the last step's tensor
        flat = torch.zeros(numel, dtype=torch.float32)
        self._flat[key] = flat
        for ordinal, offset, n in segments:
            residual = self._residuals.get(ordinal)
            view = flat[offset: offset + n]
            if residual is not None:
                if residual.numel() != n:
                    raise ValueError(
                        f"pycomm {self._op}: the residual of parameter #{ordinal} has {residual.numel()} "
                        f"elements but the parameter has {n} (state loaded from another model?)")
                view.copy_(residual.reshape(-1))
            self._residuals[ordinal] = view
        return flat

    def _hold_unused(self, buffer: torch.Tensor, segments) -> Optional[list]:
        """Takes the residual and DGC velocity of every parameter whose local gradient (its
        slice of ``buffer``) is all zero out of the step: they are zeroed here, so the hook
        sends nothing for the parameter, and :meth:`_release` adds them back once the
        collective is done. Returns what it took (None when nothing).

        Under ``DDP(find_unused_parameters=True)`` a parameter this rank did not use has a
        zero slice, and DDP does not copy the averaged bucket into ``.grad`` for a
        parameter no rank used: whatever a hook sends for it is lost. Sending its residual
        (the slice plus the residual is the residual alone) and clearing it lost the
        residual; and the velocity decayed with no gradient in it. A used parameter whose
        gradient is exactly zero keeps its residual for a later step too, which only
        delays it."""
        if not segments or not (self.error_feedback or self._momenta):
            return None
        if buffer.device.type == "cpu" and buffer.is_contiguous():
            from .._C import kernels

            zero = kernels.zero_segments(buffer, [o for _, o, _ in segments], [n for _, _, n in segments])
        else:
            zero = torch.stack([buffer[o: o + n].count_nonzero() == 0 for _, o, n in segments]).tolist()
        held = []
        for (ordinal, _, n), unused in zip(segments, zero):
            if not unused or n == 0:
                continue
            r = self._residuals.get(ordinal) if self.error_feedback else None
            u = self._momenta.get(ordinal)
            r = r if r is not None and r.numel() == n else None  # a size mismatch is reported later
            u = u if u is not None and u.numel() == n else None
            if r is None and u is None:
                continue
            held.append((ordinal, None if r is None else r.clone(), None if u is None else u.clone()))
            for t in (r, u):
                if t is not None:
                    t.zero_()
        return held or None

    def _restore(self, held: Optional[list]) -> None:
        """Adds what :meth:`_hold_unused` took back: the residual onto whatever the step
        left there (the collectives' own error feedback), the velocity as it was."""
        for ordinal, r, u in held or ():
            if r is not None:
                current = self._residuals.get(ordinal)
                if current is None or current.numel() != r.numel():
                    self._residuals[ordinal] = r
                else:
                    current.view(-1).add_(r.view(-1))
            if u is not None:
                current = self._momenta.get(ordinal)
                if current is None or current.numel() != u.numel():
                    self._momenta[ordinal] = u
                else:
                    current.copy_(u.view_as(current))

    def _release(self, buffer: torch.Tensor, segments, start: Callable[[], torch.futures.Future]
                 ) -> torch.futures.Future:
        """``start()``'s future, with the bucket's unused parameters held out of it
        (:meth:`_hold_unused`); it completes after :meth:`_restore` has put them back (at
        once when ``start`` raises)."""
        held = self._hold_unused(buffer, segments)
        try:
            fut = start()
        except BaseException:
            self._restore(held)
            raise
        if held is None:
            return fut

        def restored(f):
            self._restore(held)
            return f.value()  # re-raises a failed collective
        return fut.then(restored)

    def _seeded(self, ordinal: int, step: int) -> torch.Generator:
        rank = dist.get_rank(self.process_group)
        return self._generator.manual_seed(_mix_seed(self.seed, rank, step, ordinal))

    def _begin(self, bucket) -> int:
        """The step this bucket belongs to; counts the step when the last bucket arrives."""
        step = self.step
        self._last = bool(bucket.is_last())
        if self._last:
            self.step += 1
        return step

    # -- checkpoints -------------------------------------------------------------
    def _config(self) -> Dict[str, Any]:
        return {}

    def _rank_and_world(self) -> Tuple[int, int]:
        """This process's rank in the state's group and the group's size (0 and 1 before
        torch.distributed is initialised)."""
        if not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _rank_state(self) -> Dict[str, Any]:
        """What is this rank's own: its residuals and velocities (by parameter ordinal)."""
        return {
            "residuals": {ordinal: r.detach().clone() for ordinal, r in sorted(self._residuals.items())},
            "momenta": {ordinal: u.detach().clone() for ordinal, u in sorted(self._momenta.items())},
        }

    def _load_rank_state(self, mine: Dict[str, Any]) -> None:
        self._residuals = {int(o): r.detach().to(torch.float32).clone() for o, r in mine.get("residuals", {}).items()}
        self._momenta = {int(o): u.detach().to(torch.float32).clone() for o, u in mine.get("momenta", {}).items()}

    def state_dict(self) -> Dict[str, Any]:
        """Step counter, settings and this rank's tensors; torch.save-able.

        The residuals (and velocities, warm-start matrices) differ between ranks, so they
        sit under a key naming the rank, ``"rank<r>"``, as a one-element tuple holding
        ``{"rank", "world_size", "residuals", "momenta"}`` (ordinal -> float32 tensor).
        ``torch.distributed.checkpoint`` then keeps every rank's (it keeps one copy of a
        key all ranks share), and stores the tuple as one object, so a fresh process,
        whose state has no residuals yet, loads them whole. :meth:`load_state_dict`
        refuses another rank's state, or a state saved at another world size."""
        rank, world = self._rank_and_world()
        mine = {"rank": rank, "world_size": world}
        mine.update(self._rank_state())
        return {
            "kind": self._kind,
            "version": _STATE_VERSION,
            "step": self.step,
            "seed": self.seed,
            "config": self._config(),
            "world_size": world,
            f"rank{rank}": (mine,),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _check_kind(self._op, state, self._kind)
        rank, world = self._rank_and_world()
        if int(state.get("version", 1)) < 2:
            warnings.warn(f"pycomm {self._op}: this state_dict was saved by a pycomm that did not record the "
                          f"rank; whether its residuals are this rank's ({rank}) cannot be checked", stacklevel=2)
            mine = state
        else:
            saved = _saved_ranks(state)
            mine = saved.get(rank)
            if mine is None:
                names = ", ".join(f"rank{r}" for r in sorted(saved)) or "no rank"
                raise ValueError(
                    f"pycomm {self._op}: this state_dict holds the state of {names}, "
                    f"not of rank {rank}: each rank loads the state it saved (torch.save a file per rank, "
                    f"or use torch.distributed.checkpoint, which keeps every rank's)")
            saved_world = int(mine["world_size"])
            if saved_world != world:
                raise ValueError(
                    f"pycomm {self._op}: this state was saved by rank {rank} of {saved_world} ranks, and this "
                    f"group has {world}: its residuals belong to another split of the gradients (start from "
                    f"a fresh state at a new world size)")
        self.step = int(state["step"])
        self.seed = int(state.get("seed", self.seed))
        self._load_rank_state(mine)
        self._flat.clear()

    def reset_residuals(self) -> None:
        """Forget the error-feedback residuals and momenta (e.g. after changing the model)."""
        self._residuals.clear()
        self._momenta.clear()
        self._flat.clear()

    def _velocity(self, ordinal: int, grad: torch.Tensor, momentum: float) -> torch.Tensor:
        """DGC momentum correction: u <- momentum * u + grad, kept per parameter (float32)."""
        u = self._momenta.get(ordinal)
        if u is None:
            u = self._momenta[ordinal] = grad.to(torch.float32, copy=True)
            return u
        if u.numel() != grad.numel():
            raise ValueError(f"pycomm {self._op}: the momentum of parameter #{ordinal} has {u.numel()} "
                             f"elements but the parameter has {grad.numel()} (state loaded from another model?)")
        return u.mul_(momentum).add_(grad)


def _saved_ranks(state_dict: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """The ``"rank<r>"`` entries of a compressed hook's ``state_dict()``, by rank, each
    unwrapped from its one-element tuple."""
    return {int(k[4:]): v[0] if isinstance(v, (tuple, list)) else v for k, v in state_dict.items()
            if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()}


def rank_state(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """The part of a compressed hook's ``state_dict()`` that belongs to the rank that saved
    it: ``{"rank", "world_size", "residuals", "momenta"}`` (PowerSGD: also ``"q"``), the
    tensors by parameter ordinal. For reading a checkpoint; :meth:`load_state_dict` takes
    the whole dict."""
    entries = list(_saved_ranks(state_dict).values())
    if len(entries) != 1:
        raise ValueError(f"pycomm rank_state: expected the state of one rank, found {len(entries)}")
    return entries[0]


def _check_state(op: str, state, cls) -> None:
    if not isinstance(state, cls):
        raise TypeError(f"pycomm {op}: state must be a {cls.__name__} (got {type(state).__name__}); "
                        f"register it as ddp.register_comm_hook({cls.__name__}(...), {op})")


# ---------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------

class TopKState(_CompressionState):
    """State of :func:`topk_hook`.

    ``density``: fraction of each parameter's entries sent per step (at least one).
    ``error_feedback``: add what was not sent to the next step's gradient.
    ``warmup_steps``: dense all-reduce for the first synchronised steps.
    ``exact``: exact selection; otherwise DGC's sampled threshold (about k entries;
    padded with zeros to exactly k on the all_gather exchange).
    ``seed``: seeds the threshold sampling.
    ``exchange``: ``"auto"`` (pycomm's sparse all-reduce on pycomm groups, all_gather
    elsewhere) or ``"allgather"`` (all_gather everywhere).
    ``value_dtype``: values on the wire of the sparse all-reduce, ``"bfloat16"``
    (default), ``"float16"`` or ``"float32"``; None: the bucket's dtype (float32 unless a
    16-bit wrapper cast it). Wire rounding goes into the residual. (float32 was the
    default before: bfloat16 sends about a third fewer bytes per pair, which pays for
    ``small_bits``; docs/compression.md, *The tiny LM within a point*.)
    ``owner_density``: on the sparse all-reduce, each chunk owner sends back the top
    ``owner_density`` of its reduced chunk (None: ``2 * density``, at most 1; 0: every
    nonzero entry, the exact sum of all ranks' selections); what it drops goes into its
    residual. Keeping only ``density`` there (the default before) dropped up to half of
    the ranks' selections at 2 ranks and cost accuracy with momentum SGD
    (docs/compression.md, *Accuracy with the user's optimizer*).
    ``momentum``: DGC's momentum correction (Lin et al. 2018): the hook keeps a velocity
    ``u <- momentum * u + g`` per parameter and selects from ``u + residual``; the selected
    entries of ``u`` are zeroed (momentum factor masking). Use it with an optimizer without
    momentum (plain SGD): the hook applies it. 0 (default): off.
    ``schedule`` (sparse all-reduce only): ``"bucket"`` (default) starts each bucket's
    collective as DDP hands the bucket over, so it runs while backward goes on;
    ``"step"`` encodes each bucket as it comes and sends the whole step in one collective
    from the last bucket (fewer rounds; no overlap with backward). Same numbers either way.
    ``min_compression_rate`` (sparse all-reduce only): a parameter whose dense bytes are
    below ``min_compression_rate`` times its top-k pairs' bytes is not sparsified but
    averaged apart, all such parameters of a bucket (of a step, with ``schedule="step"``)
    in one all-reduce (:meth:`compressed` states the rule). None (default): a parameter
    of which top-k would send fewer than 1.5 entries per step (``density * numel <
    1.5``; at 1%, fewer than 150 entries: LayerNorm gains, biases) is averaged apart;
    top-k would update such a parameter one entry at a time, each about every
    ``numel`` steps. On the all_gather exchange None sparsifies every parameter.
    0: every parameter is sparsified.
    ``small_bits``: how the parameters averaged apart travel: 8 (default) or 4 through
    pycomm's two-phase quantized all-reduce (blocks of 256, stochastic rounding, the
    error into their residuals when ``error_feedback``); None exactly, in one float32
    all-reduce (their residuals become zero), at 4 or 8 times the bytes.
    ``hosts`` (sparse all-reduce only, ``schedule="bucket"``): None (default) runs the
    sparse all-reduce over every rank of the group. ``"auto"`` groups the ranks by host
    (hostname, boot id and namespaces, as pycomm's transport does), or give the layout
    as lists of group ranks, every rank once (tests, or hosts pycomm cannot tell apart):
    each host's ranks then sum the bucket densely on its lowest rank (through shared
    memory on one host), only those leaders select the top-k of the host's sum (error
    feedback on the leader) and run the sparse all-reduce among themselves, and each
    leader broadcasts the result to its host. On many hosts the flat exchange's
    messages (2 (n - 1) per phase towards every rank) and its n ranks' pairs crossing
    each host's link cost more than it saves (docs/planner.md, *Extrapolation*); this
    sends the leaders' pairs only. Different numbers from the flat hook (one selection
    per host instead of per rank). Every rank of the default group must build the state
    at the same point (it creates process groups), and the state's group must be the
    whole default group. Falls back to the flat exchange when every host has one rank or
    there is one host."""

    _kind = "topk"
    _op = "topk_hook"

    def __init__(self, process_group=None, density: float = 0.01, error_feedback: bool = True,
                 warmup_steps: int = 0, exact: bool = False, *, seed: int = 0,
                 exchange: str = "auto", value_dtype: Optional[str] = "bfloat16",
                 owner_density: Optional[float] = None, momentum: float = 0.0,
                 schedule: str = "bucket", min_compression_rate: Optional[float] = None,
                 small_bits: Optional[int] = 8, hosts=None):
        density = float(density)
        if hosts is not None and (schedule != "bucket" or exchange != "auto"):
            raise ValueError("pycomm topk_hook: hosts needs schedule='bucket' and exchange='auto' "
                             f"(got schedule={schedule!r}, exchange={exchange!r})")
        if schedule not in _SCHEDULES:
            raise ValueError(f"pycomm topk_hook: schedule must be one of {', '.join(_SCHEDULES)} "
                             f"(got {schedule!r})")
        if min_compression_rate is not None and not float(min_compression_rate) >= 0.0:
            raise ValueError(f"pycomm topk_hook: min_compression_rate must be >= 0 (got {min_compression_rate!r})")
        if small_bits not in (None, 8, 4):
            raise ValueError(f"pycomm topk_hook: small_bits must be None, 8 or 4 (got {small_bits!r})")
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"pycomm topk_hook: momentum must be in [0, 1) (got {momentum!r})")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"pycomm topk_hook: density must be in (0, 1] (got {density!r})")
        if value_dtype not in _VALUE_DTYPES:
            raise ValueError(f"pycomm topk_hook: value_dtype must be None, 'float32', 'float16' or "
                             f"'bfloat16' (got {value_dtype!r})")
        if owner_density is not None and not 0.0 <= float(owner_density) <= 1.0:
            raise ValueError(f"pycomm topk_hook: owner_density must be in [0, 1] (got {owner_density!r})")
        super().__init__(process_group, error_feedback, warmup_steps, seed, exchange)
        self.density = density
        self.exact = bool(exact)
        self.value_dtype = value_dtype
        self.owner_density = min(1.0, 2.0 * density) if owner_density is None else float(owner_density)
        self.momentum = float(momentum)
        self.schedule = schedule
        self.min_compression_rate = None if min_compression_rate is None else float(min_compression_rate)
        self.small_bits = small_bits
        self._pending: List["_PendingBucket"] = []  # schedule="step": this step's buckets so far
        self._layout: Optional[Tuple[tuple, ...]] = None  # the last complete step's bucket layout
        self._seen: List[tuple] = []  # this step's bucket layouts so far (learns _layout)
        self.hosts = hosts
        self._hosts: Optional[_HostGroups] = _HostGroups.build(process_group, hosts, self._op)

    def _config(self) -> Dict[str, Any]:
        return {"density": self.density, "exact": self.exact, "error_feedback": self.error_feedback,
                "warmup_steps": self.warmup_steps, "exchange": self.exchange,
                "value_dtype": self.value_dtype, "owner_density": self.owner_density,
                "momentum": self.momentum, "schedule": self.schedule,
                "min_compression_rate": self.min_compression_rate, "small_bits": self.small_bits,
                "hosts": _hosts_config(self.hosts)}

    def compressed(self, numel: int, element_bytes: int = 4, value_bytes: int = 4) -> bool:
        """Whether a parameter of ``numel`` elements is sparsified on the sparse all-reduce
        (else it is averaged apart, in one all-reduce with the bucket's other small
        parameters, as ``small_bits`` says). With ``min_compression_rate`` None (the
        default): when ``density * numel >= 1.5``. Otherwise: when its dense bytes are at
        least ``min_compression_rate`` times its pairs' bytes, ``numel * element_bytes >=
        min_compression_rate * k * (4 + value_bytes)`` with ``k = ceil(density * numel)``
        (at least one); 0 sparsifies every parameter."""
        if numel == 0:
            return True
        if self.min_compression_rate is None:
            return self.density * numel >= _SPARSE_MIN_ENTRIES
        if self.min_compression_rate <= 0.0:
            return True
        k = topk_count(numel, self.density)
        return numel * element_bytes >= self.min_compression_rate * k * (4 + value_bytes)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._pending, self._seen = [], []

    def reset_residuals(self) -> None:
        super().reset_residuals()
        self._pending, self._seen = [], []


# The name pycomm.train's hook discovery derives from "topk_hook".
TopkState = TopKState


def _select(state: TopKState, x: torch.Tensor, k: int, ordinal: int, step: int):
    if state.exact:
        return topk_exact(x, k)
    return topk_approx(x, k, generator=state._seeded(ordinal, step), max_k=k)


def _pad(indices: torch.Tensor, values: torch.Tensor, k: int):
    """Pad to exactly k entries with (index 0 of the parameter, value 0): adds nothing."""
    short = k - indices.numel()
    if short <= 0:
        return indices, values
    return torch.cat([indices, indices.new_zeros(short)]), torch.cat([values, values.new_zeros(short)])


def _start_compressed(name, state, state_class, bucket, kind):
    """The start every compressed hook shares: counts the step and numbers the
    bucket's parameters (also during warm-up, which fixes their ordinals). Returns
    (buffer, group, world, step, segments, done); `done` is a future when this step
    needs nothing more from the hook: an empty bucket, a dense warm-up step, or the
    group's compressed collective of `kind` ("topk" / "quantize") under exchange="auto"."""
    _check_state(name, state, state_class)
    buffer = bucket.buffer()
    group = state.process_group
    world = _group_size(group)
    step = state._begin(bucket)
    if buffer.numel() == 0:
        return buffer, group, world, step, None, _completed(buffer)
    segments = state._segments(bucket, buffer)
    if step < state.warmup_steps:
        return buffer, group, world, step, segments, _dense_allreduce(buffer, group, world)
    fast = _compressed_collective(group, kind) if state.exchange == "auto" else None
    done = fast(state, buffer, world, step, segments) if fast is not None else None
    return buffer, group, world, step, segments, done


@_aborts_group_on_error("topk_hook")
def topk_hook(state: TopKState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsified gradient averaging with error feedback (see the module docstring)."""
    buffer, group, world, step, segments, done = _start_compressed("topk_hook", state, TopKState, bucket, "topk")
    if done is not None:
        return done
    if state.min_compression_rate:  # None (the default rule) sparsifies every parameter here
        raise ValueError("pycomm topk_hook: min_compression_rate needs the sparse all-reduce of a pycomm group "
                         "(exchange='auto'); the all_gather exchange sparsifies every parameter")
    return state._release(buffer, segments, lambda: _topk_allgather(state, buffer, group, world, step, segments))


def _topk_allgather(state: TopKState, buffer: torch.Tensor, group, world: int, step: int, segments):
    """topk_hook on another backend (or exchange="allgather"): every rank's selections
    all-gathered, summed in rank order."""
    index_parts, value_parts = [], []
    for ordinal, offset, numel in segments:
        u = None
        if state.momentum:
            u = state._velocity(ordinal, buffer[offset: offset + numel].to(torch.float32), state.momentum)
        x = state._input(buffer, ordinal, offset, numel, u)
        k = topk_count(numel, state.density)
        indices, values = _select(state, x, k, ordinal, step)
        if u is not None:
            u[indices] = 0.0  # momentum factor masking
        sent = values.to(buffer.dtype)
        if state.error_feedback:
            x[indices] -= sent.to(torch.float32)  # x becomes what was not sent (indices are unique)
            state._store_residual(ordinal, x)
        indices, sent = _pad(indices, sent, k)
        index_parts.append((indices + offset).to(torch.int32))
        value_parts.append(sent)
    indices = torch.cat(index_parts)
    values = torch.cat(value_parts)
    k_total = indices.numel()
    value_bytes = buffer.element_size()

    if world * k_total * (4 + value_bytes) >= 2 * buffer.numel() * buffer.element_size():
        # Denser than the break-even point: a dense all-reduce of the sparsified bucket.
        sparse = torch.zeros_like(buffer)
        sparse.index_put_((indices.long(),), values, accumulate=True)
        buffer.copy_(sparse)
        return _dense_allreduce(buffer, group, world)

    payload = torch.cat([_as_bytes(indices), _as_bytes(values)])
    fut, rows = _all_gather_bytes(payload, group, world)
    split = 4 * k_total

    def decode(_fut):
        _fut.value()  # re-raises a failed all-gather
        all_indices = rows[:, :split].contiguous().view(torch.int32).flatten().long()
        all_values = rows[:, split:].contiguous().view(buffer.dtype).flatten().to(torch.float32)
        total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        total.index_add_(0, all_indices, all_values)  # rank order: identical sums on every rank
        buffer.copy_(total.div_(world))
        return buffer

    return fut.then(decode)


# ---------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------

class QuantizeState(_CompressionState):
    """State of :func:`quantize_hook`.

    ``bits``: 8 or 4 (QSGD-style levels, scale = max |x| per block) or 1 (sign, scale =
    mean |x| per block); ``block``: elements per scale; ``stochastic``: unbiased
    stochastic rounding for 8/4 bits (1 bit is always deterministic);
    ``error_feedback``: carry the quantization error to the next step;
    ``warmup_steps``: dense all-reduce for the first synchronised steps; ``seed``: seeds
    the stochastic rounding (per rank, step and parameter); ``exchange``: ``"auto"``
    (pycomm's two-phase quantized all-reduce on pycomm groups, all_gather elsewhere) or
    ``"allgather"`` (all_gather everywhere); ``hosts``: as :class:`TopKState`'s, the
    quantized all-reduce among the host leaders of each host's sum (error feedback on the
    leader)."""

    _kind = "quantize"
    _op = "quantize_hook"

    def __init__(self, process_group=None, bits: int = 8, block: int = 256, stochastic: bool = True,
                 error_feedback: bool = True, *, warmup_steps: int = 0, seed: int = 0,
                 exchange: str = "auto", hosts=None):
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"pycomm quantize_hook: bits must be 8, 4 or 1 (got {bits!r})")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"pycomm quantize_hook: block must be a positive integer (got {block!r})")
        super().__init__(process_group, error_feedback, warmup_steps, seed, exchange)
        if hosts is not None and exchange != "auto":
            raise ValueError(f"pycomm quantize_hook: hosts needs exchange='auto' (got {exchange!r})")
        self.bits = int(bits)
        self.block = int(block)
        self.stochastic = bool(stochastic)
        self.hosts = hosts
        self._hosts: Optional[_HostGroups] = _HostGroups.build(process_group, hosts, self._op)

    def _config(self) -> Dict[str, Any]:
        return {"bits": self.bits, "block": self.block, "stochastic": self.stochastic,
                "error_feedback": self.error_feedback, "warmup_steps": self.warmup_steps,
                "exchange": self.exchange, "hosts": _hosts_config(self.hosts)}


@_aborts_group_on_error("quantize_hook")
def quantize_hook(state: QuantizeState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Blockwise-quantized gradient averaging with error feedback (see the module docstring)."""
    buffer, group, world, step, segments, done = _start_compressed("quantize_hook", state, QuantizeState, bucket,
                                                                   "quantize")
    if done is not None:
        return done
    return state._release(buffer, segments,
                          lambda: _quantize_allgather(state, buffer, group, world, step, segments))


def _quantize_allgather(state: QuantizeState, buffer: torch.Tensor, group, world: int, step: int, segments):
    """quantize_hook on another backend (or exchange="allgather"): every rank's codes
    all-gathered, dequantized and summed in rank order."""
    bits, block = state.bits, state.block
    stochastic = state.stochastic and bits != 1
    code_parts, scale_parts, layout = [], [], []
    for ordinal, offset, numel in segments:
        x = state._input(buffer, ordinal, offset, numel)
        generator = state._seeded(ordinal, step) if stochastic else None
        q = quantize_blockwise(x, bits, block, stochastic, generator)
        if state.error_feedback:
            state._store_residual(ordinal, x.sub_(dequantize_blockwise(q)))
        code_parts.append(q.codes)
        scale_parts.append(q.scales)
        layout.append((offset, numel, q.codes.numel(), q.scales.numel()))
    codes = torch.cat(code_parts)
    scales = torch.cat(scale_parts)

    payload = torch.cat([codes, _as_bytes(scales)])
    fut, rows = _all_gather_bytes(payload, group, world)
    split = codes.numel()

    def decode(_fut):
        _fut.value()  # re-raises a failed all-gather
        all_codes = rows[:, :split]
        all_scales = rows[:, split:].contiguous().view(torch.float32)
        total = torch.empty(buffer.numel(), dtype=torch.float32, device=buffer.device)
        code_at = scale_at = 0
        for offset, numel, ncodes, nscales in layout:
            acc = total[offset: offset + numel].zero_()
            for r in range(world):  # rank order: identical sums on every rank
                acc += dequantize_blockwise(QuantizedTensor(
                    all_codes[r, code_at: code_at + ncodes], all_scales[r, scale_at: scale_at + nscales],
                    numel, bits, block))
            code_at += ncodes
            scale_at += nscales
        buffer.copy_(total.div_(world))
        return buffer

    return fut.then(decode)


# ---------------------------------------------------------------------------
# pycomm fast paths: C++ kernels + C++ compressed collectives
# ---------------------------------------------------------------------------

def _returned(buffer: torch.Tensor):
    def finish(fut):
        _future_tensor(fut)  # re-raises a failed collective
        return buffer
    return finish


def _averaged_into(buffer: torch.Tensor, world: int):
    def finish(fut):
        total = _future_tensor(fut)  # re-raises a failed collective
        if total.dtype == buffer.dtype:
            torch.div(total, world, out=buffer)
        else:
            buffer.copy_(total.div_(world))
        return buffer
    return finish


_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SPARSE_MIN_ENTRIES = 1.5  # TopKState(min_compression_rate=None): sparsified when density * numel >= this
_SMALL_BLOCK = 256  # TopKState(small_bits=...): elements per scale of the small parameters' all-reduce
_SMALL_SEED = 0x5347  # mixed into that all-reduce's rounding seed (apart from the selections')


def _wire_dtype(state: TopKState, buffer: torch.Tensor) -> str:
    if state.value_dtype is not None:
        return state.value_dtype
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(buffer.dtype, "float32")


def _topk_encode(state: TopKState, buffer: torch.Tensor, step: int, segments, residual: Optional[torch.Tensor],
                 rank: int, base: int, value_dtype: str):
    """Per parameter: top-k of gradient + residual with the fused C++ kernel (residual <- what
    was not selected). Returns (int64 indices + ``base``, float32 values, dense) where dense
    lists ``(base + offset, gradient + residual)`` of the parameters too small to pay
    (:meth:`TopKState.compressed`), whose residuals become zero: they are sent exactly."""
    from .._C import kernels

    grads = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
    element_bytes, value_bytes = buffer.element_size(), _WIRE_BYTES[value_dtype]
    e_all = residual if residual is not None else torch.zeros_like(grads)
    # Without momentum, on the CPU, every sparsified parameter of the bucket goes through one
    # kernel call (a call per parameter cost more in Python than the selection of the small
    # ones); with momentum the kernel reads each parameter's velocity instead.
    one_call = not state.momentum and not grads.is_cuda
    limit = _APPROX_MIN_NUMEL_CUDA if grads.is_cuda else _APPROX_MIN_NUMEL  # below it exact is as fast
    picked, index_parts, value_parts, dense = [], [], [], []
    for ordinal, offset, n in segments:
        compressed = state.compressed(n, element_bytes, value_bytes)
        seed = _mix_seed(state.seed, rank, step, ordinal)
        exact = state.exact or n < limit
        if compressed and one_call:
            picked.append((offset, n, exact, seed))
            continue
        g = grads[offset: offset + n]
        if state.momentum:
            g = state._velocity(ordinal, g, state.momentum)
        e = e_all[offset: offset + n]
        if not compressed:
            dense.append((base + offset, g + e, e, ordinal))
            e.zero_()  # small_bits: the quantized all-reduce writes its error here
            if state.momentum:
                g.zero_()  # every entry is sent: momentum factor masking clears the whole velocity
            continue
        indices, values = kernels.topk_ef(g, e, state.density, exact, seed)
        if state.momentum:
            g[indices] = 0.0  # momentum factor masking
        index_parts.append(indices + (base + offset))
        value_parts.append(values)
    if picked:
        offsets, lengths, exacts, seeds = (list(column) for column in zip(*picked))
        indices, values = kernels.topk_ef_segments(grads, e_all, offsets, lengths, state.density, exacts, seeds, base)
        return indices, values, dense
    if not index_parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32), dense
    return torch.cat(index_parts), torch.cat(value_parts), dense


def _sparse_and_dense(backend, state: TopKState, indices, values, out, residual, value_dtype, lengths,
                      dense, step: int, group=None, divisor: int = 1) -> torch.futures.Future:
    """Starts the sparse all-reduce of (indices, values) into ``out`` and, when ``dense``
    lists parameters too small to pay, one all-reduce (SUM) of all of them, issued right
    after it (the same order on every rank): exact in float32, or quantized to
    ``state.small_bits`` with its error written into their residuals. The future
    completes with ``out`` holding the sums of all ranks, the small parameters' included,
    divided by ``divisor`` (the same float division as dividing ``out`` afterwards)."""
    work = backend.allreduce_sparse(indices, values, out, residual, value_dtype, state.owner_density, lengths,
                                    float(divisor))
    fut = work.get_future()
    if not dense:
        return fut
    flat = torch.cat([x for _, x, _, _ in dense])
    error = None
    if state.small_bits:
        # a segment per parameter, keyed by its ordinal: ownership and rounding seeds follow
        # the parameter, not the bucket layout (a parameter of one block is owned by rank 0)
        error = torch.zeros_like(flat) if state.error_feedback else None
        dense_fut = backend.allreduce_quantized(flat, error, state.small_bits, _SMALL_BLOCK, True,
                                                _mix_seed(state.seed, step, _SMALL_SEED),
                                                [x.numel() for _, x, _, _ in dense],
                                                [ordinal for _, _, _, ordinal in dense]).get_future()
    else:
        dense_fut = dist.all_reduce(flat, group=group if group is not None else state.process_group,
                                    async_op=True).get_future()

    def place(all_done):
        for f in all_done.value():
            f.value()  # re-raises a failed collective
        at = 0
        for offset, x, e, _ in dense:
            if divisor == 1:
                out[offset: offset + x.numel()].copy_(flat[at: at + x.numel()])
            else:
                torch.div(flat[at: at + x.numel()], divisor, out=out[offset: offset + x.numel()])
            if error is not None:
                e.copy_(error[at: at + x.numel()])
            at += x.numel()
        return out

    return torch.futures.collect_all([fut, dense_fut]).then(place)


class _PendingBucket:
    """schedule="step": one bucket encoded and waiting for the step's sparse all-reduce."""

    __slots__ = ("buffer", "step", "numel", "lengths", "indices", "values", "dense", "value_dtype", "flat",
                 "future")

    def __init__(self, buffer, step, numel, lengths, indices, values, dense, value_dtype, flat):
        self.buffer, self.step, self.numel, self.lengths = buffer, step, numel, lengths
        self.indices, self.values, self.dense, self.value_dtype, self.flat = indices, values, dense, value_dtype, flat
        self.future: torch.futures.Future = torch.futures.Future()


def _launch_step(backend, state: TopKState, world: int) -> None:
    """One sparse all-reduce (plus one dense one for small parameters) for every pending
    bucket: they are a prefix of the step's layout, so their residuals are a prefix of the
    step's flat residual and their indices already count from the step's start."""
    pending, state._pending = state._pending, []
    if not pending:
        return
    total = sum(p.numel for p in pending)
    residual = pending[0].flat[:total] if pending[0].flat is not None else None
    indices = torch.cat([p.indices for p in pending])
    values = torch.cat([p.values for p in pending])
    lengths = [n for p in pending for n in p.lengths]
    dense = [d for p in pending for d in p.dense]
    out = torch.empty(total, dtype=torch.float32)
    try:
        fut = _sparse_and_dense(backend, state, indices, values, out, residual, pending[0].value_dtype, lengths,
                                dense, pending[0].step)
    except BaseException as exc:  # noqa: BLE001  (every waiting bucket learns of it)
        for p in pending:
            p.future.set_exception(exc)
        raise

    def finish(f):
        try:
            f.value()  # re-raises a failed collective
            at = 0
            for p in pending:
                part = out[at: at + p.numel]
                at += p.numel
                if p.buffer.dtype == torch.float32:
                    torch.div(part, world, out=p.buffer)
                else:
                    p.buffer.copy_(part.div_(world))
                p.future.set_result(p.buffer)
        except BaseException as exc:  # noqa: BLE001  (handed to DDP through the futures)
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(exc)

    fut.add_done_callback(finish)


def _step_flat(state: TopKState, layout) -> Tuple[Optional[torch.Tensor], List[int]]:
    """The step's residuals as one flat tensor over every bucket of ``layout`` (None without
    error feedback) and each bucket's start in it."""
    bases, global_segments, at = [], [], 0
    for segments in layout:
        bases.append(at)
        for ordinal, offset, n in segments:
            global_segments.append((ordinal, at + offset, n))
        at += sum(n for _, _, n in segments)
    return state._flat_residual(global_segments, at), bases


def _topk_pycomm(backend, state: TopKState, buffer: torch.Tensor, world: int, step: int, segments, group=None):
    """Per parameter: top-k of gradient + residual with the fused C++ kernel (residual <- what
    was not selected); then pycomm's sparse all-reduce (allreduce_sparse.cc): rank c owns
    chunk c of every parameter, keeps the top ``density`` of each reduced chunk and feeds
    back what it drops. Parameters too small to pay go in one dense all-reduce.

    ``schedule="bucket"``: each bucket's collective starts as DDP hands the bucket over.
    ``schedule="step"``: each bucket is encoded as it comes, and the step's last bucket
    starts one collective for all of them (the layout is learned from the previous step;
    a step whose layout differs, such as the first, or DDP's rebuild, runs per bucket).
    Ownership and seeds are per parameter, so both give the same numbers.
    ``group``: the group ``backend`` belongs to, when not the state's (the host leaders'
    group of ``hosts``)."""
    if state._hosts is not None and group is None:
        return _hosts_exchange(state, buffer, world, step, segments, _topk_pycomm)
    # (on a host leader, buffer is the host's sum)
    return state._release(buffer, segments,
                          lambda: _topk_sparse(backend, state, buffer, world, step, segments, group))


def _topk_sparse(backend, state: TopKState, buffer: torch.Tensor, world: int, step: int, segments, group):
    rank = dist.get_rank(group if group is not None else state.process_group)
    value_dtype = _wire_dtype(state, buffer)
    numel = buffer.numel()
    lengths = [n for _, _, n in segments]
    if state.schedule == "step":
        last = state._last
        if state._pending and state._pending[0].step != step:
            _launch_step(backend, state, world)  # a step that never reached its last bucket
        key = tuple(segments)
        state._seen.append(key)
        layout, position = state._layout, len(state._pending)
        if last:
            state._layout, state._seen = tuple(state._seen), []
        fits = (layout is not None and position < len(layout) and layout[position] == key
                and last == (position == len(layout) - 1)
                and all(p.value_dtype == value_dtype for p in state._pending))
        if fits:
            flat, bases = _step_flat(state, layout)
            base = bases[position]
            residual = flat[base: base + numel] if flat is not None else None
            indices, values, dense = _topk_encode(state, buffer, step, segments, residual, rank, base, value_dtype)
            pending = _PendingBucket(buffer, step, numel, lengths, indices, values, dense, value_dtype, flat)
            state._pending.append(pending)
            if last:
                _launch_step(backend, state, world)
            return pending.future
        _launch_step(backend, state, world)  # buckets of this step already waiting go first
    residual = state._flat_residual(segments, numel)
    indices, values, dense = _topk_encode(state, buffer, step, segments, residual, rank, 0, value_dtype)
    # The encode has read the bucket: a float32 CPU bucket takes the average itself (the
    # collective divides as it places the sums), which spares a bucket-sized allocation
    # per call, whose fresh pages were faulted in every call (16 MiB at 2 ranks: ~10 of a
    # 22 ms call), and the pass that divided it.
    in_place = buffer.dtype == torch.float32 and buffer.is_contiguous()
    out = buffer if in_place else torch.empty(numel, dtype=torch.float32)
    fut = _sparse_and_dense(backend, state, indices, values, out, residual, value_dtype, lengths, dense, step,
                            group, divisor=world if in_place else 1)
    return fut.then(_returned(buffer) if in_place else _averaged_into(buffer, world))


def _host_key() -> str:
    """This process's host as pycomm's transport tells hosts apart (shm_segment.cc
    hostKey): hostname, boot id, and the network, IPC, mount and PID namespaces."""
    import os
    import socket

    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.readline().strip())
    except OSError:
        parts.append("?")
    for name in ("net", "ipc", "mnt", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{name}"))
        except OSError:
            parts.append("?")
    return "|".join(parts)


def _hosts_config(hosts):
    return hosts if isinstance(hosts, (str, type(None))) else [list(h) for h in hosts]


class _HostGroups:
    """TopKState(hosts=...): this rank's host, its leader and the groups the hierarchical
    exchange runs on. Two groups per host, one for the sum towards the leader and one
    for the leader's broadcast: the leader starts a bucket's broadcast only when the
    leaders' sparse all-reduce is done, by which time it may have started later
    buckets' sums; on one group the ranks' calls would pair up out of order."""

    def __init__(self, layout: List[List[int]], rank: int, world: int, backend: str):
        import threading

        self.layout = layout
        self.host = next(h for h, ranks in enumerate(layout) if rank in ranks)
        self.leader = layout[self.host][0]  # group rank (the state's group is the default group)
        self.is_leader = rank == self.leader
        self.world = world
        # new_group is collective over the default group: every rank creates every group,
        # in the same order.
        self.sum_group = self.bcast_group = self.leaders = None
        for h, ranks in enumerate(layout):
            sum_group = dist.new_group(ranks, backend=backend)
            bcast_group = dist.new_group(ranks, backend=backend)
            if h == self.host:
                self.sum_group, self.bcast_group = sum_group, bcast_group
        leaders = dist.new_group([ranks[0] for ranks in layout], backend=backend)
        if self.is_leader:
            self.leaders = leaders
        self.lock = threading.RLock()  # a stage that fails registers the bucket's later stages
        self.tickets = 0  # buckets started: the leader starts their sparse all-reduces and
        # broadcasts in this order, whichever thread gets to a bucket first
        self.next = {"sparse": 0, "broadcast": 0}
        self.ready: Dict[str, Dict[int, Callable[[], None]]] = {"sparse": {}, "broadcast": {}}

    @staticmethod
    def build(process_group, hosts, op: str) -> Optional["_HostGroups"]:
        """The groups for ``hosts`` (None: none, the flat exchange)."""
        if hosts is None:
            return None
        if not dist.is_initialized():
            raise ValueError(f"pycomm {op}: hosts needs an initialised default process group "
                             "(create the state after dist.init_process_group)")
        world = _group_size(process_group)
        if world != dist.get_world_size():
            raise ValueError(f"pycomm {op}: hosts needs the state's group to be the whole default group "
                             f"(it has {world} of {dist.get_world_size()} ranks)")
        if not _is_pycomm(process_group):
            raise ValueError(f"pycomm {op}: hosts needs a pycomm process group (its compressed all-reduce)")
        rank = dist.get_rank(process_group)
        if hosts == "auto":
            keys: List[Optional[str]] = [None] * world
            dist.all_gather_object(keys, _host_key(), group=process_group)
            order: Dict[str, List[int]] = {}
            for r, key in enumerate(keys):
                order.setdefault(key, []).append(r)
            layout = list(order.values())
        elif isinstance(hosts, (list, tuple)):
            layout = [sorted(int(r) for r in ranks) for ranks in hosts]
            flat = sorted(r for ranks in layout for r in ranks)
            if flat != list(range(world)) or any(not ranks for ranks in layout):
                raise ValueError(f"pycomm {op}: hosts must list every rank of the group once, in "
                                 f"non-empty lists (got {hosts!r} for {world} ranks)")
            layout.sort(key=lambda ranks: ranks[0])
        else:
            raise ValueError(f"pycomm {op}: hosts must be None, 'auto' or lists of ranks (got {hosts!r})")
        if len(layout) in (1, world):
            return None  # one host, or one rank per host: the flat exchange is the same thing
        return _HostGroups(layout, rank, world, dist.get_backend(process_group))

    def in_order(self, stage: str, ticket: int, start: Callable[[], None]) -> None:
        """Runs the leader's ``stage`` ("sparse" / "broadcast") of bucket ``ticket`` once
        that of every earlier bucket has run: collectives must start in the same order on
        every rank, and a bucket's sum can complete (and its callback run, on a completion
        thread or inline on DDP's) before an earlier bucket's callback has started."""
        with self.lock:
            self.ready[stage][ticket] = start
            while self.next[stage] in self.ready[stage]:
                fn = self.ready[stage].pop(self.next[stage])
                self.next[stage] += 1
                fn()  # under the lock: one bucket at a time, in bucket order


def _hosts_exchange(state, buffer: torch.Tensor, world: int, step: int, segments, exchange):
    """``hosts=...``: the bucket summed on the host's leader, the leaders' compressed
    all-reduce of their hosts' sums (``exchange``: _topk_pycomm or _quantize_pycomm, on the
    leaders' group, divided by the whole world), the result broadcast inside each host."""
    h = state._hosts
    with h.lock:
        ticket = h.tickets
        h.tickets += 1
    leader = h.leader
    if not h.is_leader:
        # A copy goes to the sum: the broadcast, on another group, writes into the buffer.
        sent = buffer.clone()
        dist.reduce(sent, dst=leader, group=h.sum_group, async_op=True)
        fut = dist.broadcast(buffer, src=leader, group=h.bcast_group, async_op=True).get_future()
        return fut.then(lambda f: _future_tensor(f))
    result: torch.futures.Future = torch.futures.Future()
    summed = dist.reduce(buffer, dst=leader, group=h.sum_group, async_op=True).get_future()
    failed: List[BaseException] = []
    registered = set()  # this bucket's stages handed to h.in_order

    def advance(stage: str, start: Callable[[], None]) -> None:
        registered.add(stage)
        h.in_order(stage, ticket, start)

    def fail(error: BaseException) -> None:
        # The host's other ranks wait in the broadcast: take its group down so they fail
        # too, rather than waiting for the timeout.
        backend = _pycomm_backend(h.bcast_group)
        if backend is not None:
            backend.abort()
        if not failed:
            failed.append(error)
        # later buckets' stages wait for this one's: let them go
        for stage in ("sparse", "broadcast"):
            if stage not in registered:
                advance(stage, lambda: None)
        if not result.done():
            result.set_result(None)  # re-raised by the .then below, as torch's callbacks raise

    def broadcast() -> None:
        try:
            done = dist.broadcast(buffer, src=leader, group=h.bcast_group, async_op=True).get_future()
        except Exception as e:  # noqa: BLE001  (the group was aborted by an earlier bucket's failure)
            fail(e)
            return

        def finish(f):
            try:
                f.value()
                result.set_result(buffer)
            except Exception as e:  # noqa: BLE001
                fail(e)
        done.add_done_callback(finish)

    def then_stage(fut: torch.futures.Future, stage: str, start: Callable[[], None]) -> None:
        """When ``fut`` completes: its error fails the bucket, else ``stage`` starts in order."""
        def done(f):
            try:
                f.value()
            except Exception as e:  # noqa: BLE001
                fail(e)
                return
            advance(stage, start)
        fut.add_done_callback(done)

    def sparse() -> None:
        try:
            averaged = exchange(_pycomm_backend(h.leaders), state, buffer, world, step, segments,
                                group=h.leaders)
        except Exception as e:  # noqa: BLE001
            fail(e)
            return
        then_stage(averaged, "broadcast", broadcast)

    then_stage(summed, "sparse", sparse)

    def value(f):
        if failed:
            raise failed[0]
        return buffer
    return result.then(value)


def _quantize_pycomm(backend, state: QuantizeState, buffer: torch.Tensor, world: int, step: int, segments,
                     group=None):
    """The bucket, plus its residual, through pycomm's two-phase quantized all-reduce
    (allreduce_quantized.cc): rank c owns chunk c (whole blocks) of every parameter; the C++
    kernels quantize, owners sum in float32 and requantize; both phases' errors land in the
    residual. Seeds are mixed from (seed, step, parameter ordinal, rank, chunk), so a
    parameter's result does not depend on the bucket layout. ``group``: as _topk_pycomm's."""
    if state._hosts is not None and group is None:
        return _hosts_exchange(state, buffer, world, step, segments, _quantize_pycomm)
    return state._release(buffer, segments,
                          lambda: _quantize_twophase(backend, state, buffer, world, step, segments))


def _quantize_twophase(backend, state: QuantizeState, buffer: torch.Tensor, world: int, step: int, segments):
    # float32 buckets are reduced in place (DDP's bucket is overwritten with the result anyway)
    data = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
    residual = state._flat_residual(segments, buffer.numel())
    stochastic = state.stochastic and state.bits != 1
    seed = _mix_seed(state.seed, step)  # the collective mixes in the parameter, rank and chunk
    work = backend.allreduce_quantized(data, residual, state.bits, state.block, stochastic, seed,
                                       [n for _, _, n in segments], [o for o, _, _ in segments])
    return work.get_future().then(_averaged_into(buffer, world))


# ---------------------------------------------------------------------------
# 16-bit wrappers
# ---------------------------------------------------------------------------

def _cast_wrapper(hook: Callable, dtype: torch.dtype, name: str) -> Callable:
    if not callable(hook):
        raise TypeError(f"pycomm {name}: hook must be callable (got {type(hook).__name__})")

    def wrapped(state, bucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(state, bucket)

        def restore(f):
            original.copy_(_future_tensor(f))
            return original

        return fut.then(restore)

    inner = getattr(hook, "__name__", type(hook).__name__)
    wrapped.__name__ = f"{name}_{inner}"
    wrapped.__qualname__ = wrapped.__name__
    wrapped.__doc__ = f"{inner} on the bucket cast to {dtype} (result cast back to the bucket's dtype)."
    return wrapped


def fp16_wrapper(hook: Callable) -> Callable:
    """``hook`` run on the bucket cast to float16; the averaged result is copied back into
    the original (float32) bucket. With :func:`topk_hook` the values travel as float16
    (6 bytes per entry instead of 8); with :func:`allreduce_hook` it is fp16 compression;
    with :func:`quantize_hook` only the input is rounded (scales stay float32).
    Residuals stay float32."""
    return _cast_wrapper(hook, torch.float16, "fp16_wrapper")


def bf16_wrapper(hook: Callable) -> Callable:
    """As :func:`fp16_wrapper`, with bfloat16."""
    return _cast_wrapper(hook, torch.bfloat16, "bf16_wrapper")


# ---------------------------------------------------------------------------
# low-rank (PowerSGD)
# ---------------------------------------------------------------------------

class PowerSGDState(_CompressionState):
    """State of :func:`powersgd_hook`: rank-``rank`` gradient compression by one step of
    power iteration per round (Vogels, Karimireddy, Jaggi, "PowerSGD", NeurIPS 2019).

    ``rank``: columns of the factors P (n x r) and Q (m x r) of each compressed parameter
    (its gradient viewed as ``shape[0] x prod(shape[1:])``); clamped to ``min(n, m)``.
    ``error_feedback``: each rank adds what its own share of the approximation missed,
    ``M - P Q_rank^T``, to its next gradient.
    ``warm_start``: Q of the previous step starts the next power iteration; otherwise a
    fresh Gaussian Q (seeded by ``(seed, step, parameter)``) every step.
    ``min_compression_rate``: a parameter is compressed only if it has at least 2
    dimensions and ``n m >= min_compression_rate * r (n + m)`` (its elements against the
    elements of P and Q); 1-D and small parameters are averaged exactly, in the same
    all-reduce as the P factors. 0 compresses every parameter with 2+ dimensions.
    ``warmup_steps``: dense all-reduce for the first synchronised steps (PowerSGD starts
    at step ``warmup_steps``).
    ``seed``: seeds the initial Q (the same on every rank, as power iteration needs).

    ``state_dict()`` adds the warm-start matrices (``"q"``: ordinal -> m x r float32) to
    the rank's residuals of the other compressed hooks."""

    _kind = "powersgd"
    _op = "powersgd_hook"

    def __init__(self, process_group=None, rank: int = 1, error_feedback: bool = True,
                 warm_start: bool = True, *, min_compression_rate: float = 2.0, warmup_steps: int = 0,
                 seed: int = 0):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"pycomm powersgd_hook: rank must be a positive integer (got {rank!r})")
        if float(min_compression_rate) < 0:
            raise ValueError(f"pycomm powersgd_hook: min_compression_rate must be >= 0 "
                             f"(got {min_compression_rate!r})")
        super().__init__(process_group, error_feedback, warmup_steps, seed)
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.min_compression_rate = float(min_compression_rate)
        self._qs: Dict[int, torch.Tensor] = {}  # ordinal -> Q (m x r), the last step's, for warm start
        # The future of the last bucket handed to the hook: a bucket's collectives start only
        # once the previous bucket's have finished, so every rank issues them in one order
        # (the second all-reduce of a bucket is issued from a callback, off DDP's thread).
        self._tail: Optional[torch.futures.Future] = None

    def compressed_shape(self, shape) -> Optional[Tuple[int, int, int]]:
        """``(n, m, r)`` if a parameter of this shape is compressed, None if it is sent as is."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = 1
        for d in shape[1:]:
            m *= int(d)
        r = min(self.rank, n, m)
        if r == 0 or n * m < self.min_compression_rate * r * (n + m):
            return None
        return n, m, r

    def _config(self) -> Dict[str, Any]:
        return {"rank": self.rank, "error_feedback": self.error_feedback, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate, "warmup_steps": self.warmup_steps}

    def _rank_state(self) -> Dict[str, Any]:
        state = super()._rank_state()
        state["q"] = {ordinal: q.detach().clone() for ordinal, q in sorted(self._qs.items())}
        return state

    def _load_rank_state(self, mine: Dict[str, Any]) -> None:
        super()._load_rank_state(mine)
        self._qs = {int(o): q.detach().to(torch.float32).clone() for o, q in mine.get("q", {}).items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._tail = None

    def reset_residuals(self) -> None:
        """Forget the residuals and the warm-start matrices."""
        super().reset_residuals()
        self._qs.clear()

    def _initial_q(self, ordinal: int, step: int, m: int, r: int) -> torch.Tensor:
        """A Gaussian m x r start, identical on every rank (no rank in the seed)."""
        generator = self._generator.manual_seed(_mix_seed(self.seed, 0 if self.warm_start else step, ordinal))
        return torch.randn(m, r, generator=generator)

    def _start_q(self, ordinal: int, step: int, m: int, r: int) -> torch.Tensor:
        q = self._qs.get(ordinal) if self.warm_start else None
        if q is not None and tuple(q.shape) != (m, r):
            raise ValueError(f"pycomm powersgd_hook: the warm-start Q of parameter #{ordinal} is "
                             f"{tuple(q.shape)} but the parameter needs ({m}, {r}) (state loaded from another "
                             f"model or with another rank?)")
        return q if q is not None else self._initial_q(ordinal, step, m, r)


def _orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (n x r) of p's column space, padded to r columns where p has
    lower rank: Householder QR, which stays orthonormal for rank-deficient input."""
    return torch.linalg.qr(p, mode="reduced").Q


@_aborts_group_on_error("powersgd_hook")
def powersgd_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Rank-r PowerSGD gradient averaging with error feedback and warm start (see
    :class:`PowerSGDState` and docs/compression.md). Two all-reduces per bucket on the
    state's group: [uncompressed parameters, P factors], then [Q factors]; the result is
    ``P_hat Q^T / world`` per compressed parameter, the exact mean for the others."""
    _check_state("powersgd_hook", state, PowerSGDState)
    buffer = bucket.buffer()
    group = state.process_group
    world = _group_size(group)
    step = state._begin(bucket)
    if buffer.numel() == 0:
        return _completed(buffer)
    segments = state._segments(bucket, buffer)
    if step < state.warmup_steps:
        return _dense_allreduce(buffer, group, world)
    return state._release(buffer, segments,
                          lambda: _powersgd_start(state, bucket, buffer, group, world, step, segments))


def _powersgd_start(state: PowerSGDState, bucket, buffer: torch.Tensor, group, world: int, step: int, segments):
    """powersgd_hook's collectives for one bucket; the future completes with the result."""
    plain, low = [], []  # (offset, numel) sent as is; (ordinal, offset, n, m, r, M, Q) compressed
    for (ordinal, offset, numel), param in zip(segments, bucket.parameters()):
        shape = state.compressed_shape(param.shape)
        if shape is None:
            plain.append((offset, numel))
            continue
        n, m, r = shape
        x = state._input(buffer, ordinal, offset, numel).view(n, m)  # gradient + residual, float32
        low.append((ordinal, offset, n, m, r, x, state._start_q(ordinal, step, m, r)))
    plain_numel = sum(numel for _, numel in plain)
    p_numel = sum(n * r for _, _, n, _, r, _, _ in low)
    q_numel = sum(m * r for _, _, _, m, r, _, _ in low)
    first = torch.empty(plain_numel + p_numel, dtype=torch.float32)
    at = 0
    for offset, numel in plain:
        first[at: at + numel].copy_(buffer[offset: offset + numel])
        at += numel
    ps = []
    for _, _, n, _, r, x, q in low:
        p = first[at: at + n * r].view(n, r)
        torch.matmul(x, q, out=p)
        ps.append(p)
        at += n * r
    second = torch.empty(q_numel, dtype=torch.float32)
    result: torch.futures.Future = torch.futures.Future()
    # Completes (with None, or the exception) when this bucket's collectives are done; the next
    # bucket starts on it. A future of its own, not `result`: DDP chains its callbacks onto
    # `result`, and holding those in the state would keep DDP, and its process group, alive.
    gate: torch.futures.Future = torch.futures.Future()

    def fail(exc: BaseException) -> None:
        if not result.done():
            result.set_exception(exc)
        if not gate.done():
            gate.set_result(exc)

    def after_q(fut):
        try:
            fut.value()  # re-raises a failed all-reduce
            at = 0
            for (ordinal, offset, n, m, r, _, _), p_hat in zip(low, p_hats):
                q = second[at: at + m * r].view(m, r).div_(world)
                at += m * r
                buffer[offset: offset + n * m].view(n, m).copy_(torch.matmul(p_hat, q.t()))
                if state.warm_start and q.any():
                    # q is zero when no rank had anything for the parameter (unused by all):
                    # the last Q (or the seeded initial one) stays, rather than restarting
                    # the power iteration from a QR of zeros
                    state._qs[ordinal] = q.clone()
            result.set_result(buffer)
            gate.set_result(None)
        except BaseException as exc:  # noqa: BLE001  (handed to DDP through the future)
            fail(exc)

    p_hats: List[torch.Tensor] = []

    def after_p(fut):
        try:
            fut.value()
            at = 0
            for offset, numel in plain:
                buffer[offset: offset + numel].copy_(first[at: at + numel].div_(world))
                at += numel
            at = 0
            for (ordinal, _, n, m, r, x, _), p in zip(low, ps):
                p_hat = _orthonormal_columns(p)  # p is the sum over ranks: identical everywhere
                p_hats.append(p_hat)
                q_local = second[at: at + m * r].view(m, r)
                torch.matmul(x.t(), p_hat, out=q_local)  # this rank's M^T P_hat
                at += m * r
                if state.error_feedback:  # what this rank's share P_hat Q_rank^T missed
                    state._store_residual(ordinal, x.sub_(torch.matmul(p_hat, q_local.t())).view(-1))
            if q_numel:
                dist.all_reduce(second, group=group, async_op=True).get_future().add_done_callback(after_q)
            else:
                after_q(fut)
        except BaseException as exc:  # noqa: BLE001
            fail(exc)

    def launch(previous=None):
        try:
            if previous is not None and previous.value() is not None:
                raise previous.value()  # the previous bucket failed: so does this one
            dist.all_reduce(first, group=group, async_op=True).get_future().add_done_callback(after_p)
        except BaseException as exc:  # noqa: BLE001
            fail(exc)

    previous, state._tail = state._tail, gate
    if previous is None:
        launch()
    else:
        previous.add_done_callback(launch)  # runs at once if it has completed
    if bucket.is_last():
        # The step's collectives above are issued from callbacks, off DDP's thread. DDP
        # issues its own on this group once the last bucket's hook returns (with
        # find_unused_parameters: the used-parameter map), so every one of ours must be
        # issued by then, on every rank, or the ranks call the group's collectives in
        # different orders ("rank 0 called with 16 bytes where 384 were expected"). DDP
        # waits for the buckets' futures right after backward anyway.
        gate.wait()
    return result
