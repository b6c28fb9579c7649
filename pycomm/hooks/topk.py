"""topk_hook: top-k sparsification with error feedback, on the all_gather exchange and on
pycomm's sparse all-reduce."""
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..compression import topk_approx, topk_count, topk_exact
from ._common import (_aborts_group_on_error, _all_gather_bytes, _as_bytes, _averaged_into, _dense_allreduce,
                      _group_size, _mix_seed, _pycomm_backend, _returned)
from .exchange import _HostGroups, _hosts_config, _hosts_exchange
from .state import _CompressionState, _start_compressed

# Parameters smaller than this use the exact top-k kernel even when exact=False: the exact
# kernel collects its candidates above a sampled bound (kernels/cpu/topk.cc), which makes it
# as fast as the sampled-threshold kernel up to 2^23 elements (benchmarks/kernels_cpu.py;
# docs/compression.md).
_APPROX_MIN_NUMEL = 1 << 23
# CUDA tensors keep 2^20: where the CUDA kernels cross over has not been measured.
_APPROX_MIN_NUMEL_CUDA = 1 << 20
# TopKState(schedule=...): "bucket" starts each bucket's sparse all-reduce as DDP hands the
# bucket over; "step" encodes each bucket as it comes and sends the whole step in one.
_SCHEDULES = ("bucket", "step")
_VALUE_DTYPES = {None: None, "float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}


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
    16-bit wrapper cast it). Wire rounding goes into the residual. (bfloat16 sends about
    a third fewer bytes per pair than float32, which pays for ``small_bits``;
    docs/compression.md, *The tiny LM within a point*.)
    ``owner_density``: on the sparse all-reduce, each chunk owner sends back the top
    ``owner_density`` of its reduced chunk (None: ``2 * density``, at most 1; 0: every
    nonzero entry, the exact sum of all ranks' selections); what it drops goes into its
    residual. Keeping only ``density`` there drops up to half of the ranks' selections at
    2 ranks and costs accuracy with momentum SGD
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
    there is one host.
    ``density_warmup``: DGC's sparsity warm-up: over the first ``density_warmup``
    synchronised steps the density falls exponentially from ``start_density`` (0.25) to
    ``density`` (owners keep 2 x the step's density). 0 (default): off; what it
    gains and costs: docs/compression.md, *Tasks it was never tuned on*.
    The step counter and the schedule are saved in :meth:`state_dict`, so a resumed run
    continues the schedule.

    :meth:`health` reports the effective density, the residual / gradient norm ratio and
    the bytes sent over the run (also listed by ``pycomm.stats()["hooks"]``)."""

    _kind = "topk"
    _op = "topk_hook"

    def __init__(self, process_group=None, density: float = 0.01, error_feedback: bool = True,
                 warmup_steps: int = 0, exact: bool = False, *, seed: int = 0,
                 exchange: str = "auto", value_dtype: Optional[str] = "bfloat16",
                 owner_density: Optional[float] = None, momentum: float = 0.0,
                 schedule: str = "bucket", min_compression_rate: Optional[float] = None,
                 small_bits: Optional[int] = 8, hosts=None, density_warmup: int = 0,
                 start_density: float = 0.25):
        density = float(density)
        if int(density_warmup) < 0:
            raise ValueError(f"pycomm topk_hook: density_warmup must be >= 0 (got {density_warmup!r})")
        if not 0.0 < float(start_density) <= 1.0:
            raise ValueError(f"pycomm topk_hook: start_density must be in (0, 1] (got {start_density!r})")
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
        self._owner_default = owner_density is None
        self.owner_density = min(1.0, 2.0 * density) if owner_density is None else float(owner_density)
        self.density_warmup = int(density_warmup)
        self.start_density = max(float(start_density), density)
        self._health = _Health()
        self._bytes_group = None  # None: not known yet; True: a pycomm group (bytes counted); False: not
        self._bytes_at = 0  # pycomm's bytes_sent when counting started (or was last read)
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
                "hosts": _hosts_config(self.hosts), "density_warmup": self.density_warmup,
                "start_density": self.start_density}

    def density_at(self, step: int) -> float:
        """The density of synchronised step ``step``: ``density`` once the warm-up is over;
        during the first ``density_warmup`` steps it falls exponentially from
        ``start_density`` to ``density`` (DGC's sparsity warm-up)."""
        if step >= self.density_warmup or self.start_density <= self.density:
            return self.density
        return self.start_density * (self.density / self.start_density) ** (step / self.density_warmup)

    def _owner_at(self, step: int) -> float:
        """The owners' density of step ``step``: 2 x the step's density unless given; a
        given one is scaled with the step's density during the warm-up."""
        d = self.density_at(step)
        if self._owner_default:
            return min(1.0, 2.0 * d)
        if self.owner_density == 0.0:
            return 0.0
        return min(1.0, self.owner_density * d / self.density)

    # -- health ------------------------------------------------------------------
    def _count_bytes(self) -> None:
        """Starts (first call) or advances the count of bytes sent: pycomm's process-wide
        counter (pycomm.stats()["bytes_sent"]), on a pycomm group only."""
        if self._bytes_group is None:
            if _pycomm_backend(self.process_group) is None:
                self._bytes_group = False
                return
            self._bytes_group = True
            self._bytes_at = _bytes_sent_now()
            return
        if self._bytes_group:
            now = _bytes_sent_now()
            self._health.bytes_sent += now - self._bytes_at
            self._bytes_at = now

    def health(self) -> Dict[str, Any]:
        """How compression is going on this rank, over every step since the state was made
        (or the checkpoint it loaded was, counters included):

        ``steps``: synchronised steps; ``density``: the density of the next step;
        ``effective_density``: entries this rank selected / entries of the sparsified
        parameters, over the run (phase 1; the warm-up included);
        ``residual_ratio``: ||residual|| / ||gradient|| of the last step (error-feedback
        residual after the selection against the step's local gradient, over the hook's
        buckets); ``residual_ratio_mean``: its mean over the steps; a ratio that keeps
        growing means the residuals hold gradient the model never receives in time;
        ``bytes_sent``: bytes this process sent through pycomm since the hook's first step
        (pycomm.stats()["bytes_sent"]: every pycomm group of the process, so the hook's
        traffic when nothing else communicates meanwhile; None on other backends);
        ``dense_bytes``: what a ring all-reduce of the same gradients in their dtype would
        have sent, ``2 (world - 1) / world x bytes`` per step (a model, not a measurement);
        ``bytes_ratio``: ``dense_bytes / bytes_sent``."""
        self._count_bytes() if self._bytes_group else None
        h = self._health
        sent = h.bytes_sent if self._bytes_group or h.bytes_sent else None
        return {
            "steps": self.step,
            "density": self.density_at(self.step),
            "effective_density": h.selected / h.elements if h.elements else None,
            "residual_ratio": h.last_ratio,
            "residual_ratio_mean": h.ratio_sum / h.ratio_steps if h.ratio_steps else None,
            "bytes_sent": sent,
            "dense_bytes": h.dense_bytes,
            "bytes_ratio": h.dense_bytes / sent if sent else None,
        }

    def _observe(self, step: int, grad_sq: float, residual_sq: float, selected: int, elements: int,
                 dense_bytes: float) -> None:
        self._health.add(step, grad_sq, residual_sq, selected, elements, dense_bytes)

    def _rank_state(self) -> Dict[str, Any]:
        out = super()._rank_state()
        self._count_bytes() if self._bytes_group else None
        out["health"] = self._health.as_dict()
        return out

    def _load_rank_state(self, mine: Dict[str, Any]) -> None:
        super()._load_rank_state(mine)
        self._health = _Health.from_dict(mine.get("health"))
        if self._bytes_group:
            self._bytes_at = _bytes_sent_now()

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
        config = state.get("config", {})
        if "density_warmup" in config:  # the schedule resumes where it was
            self.density_warmup = int(config["density_warmup"])
            self.start_density = float(config["start_density"])

    def reset_residuals(self) -> None:
        super().reset_residuals()
        self._pending, self._seen = [], []


# The name pycomm.train's hook discovery derives from "topk_hook".
TopkState = TopKState


# The states whose hook has run, for pycomm.stats()["hooks"] and reset_stats().
_LIVE: "weakref.WeakSet[TopKState]" = weakref.WeakSet()


def _health_report() -> List[Dict[str, Any]]:
    """pycomm.stats()["hooks"]: the health of every live TopKState whose hook has run."""
    return [dict(kind="topk", **state.health()) for state in list(_LIVE)]


def _reset_stats(reset) -> None:
    """pycomm.reset_stats(): the live states take the bytes counted so far before the
    counter goes to zero, and count from zero after."""
    states = list(_LIVE)
    for state in states:
        state._count_bytes()
    reset()
    for state in states:
        state._bytes_at = 0


def _bytes_sent_now() -> int:
    from .._C import _stats

    return int(_stats()["bytes_sent"])


class _Health:
    """TopKState.health()'s counters (saved in the rank's state_dict entry)."""

    _FIELDS = ("selected", "elements", "ratio_sum", "ratio_steps", "last_ratio", "bytes_sent", "dense_bytes")

    def __init__(self):
        self.selected = 0
        self.elements = 0
        self.ratio_sum = 0.0
        self.ratio_steps = 0
        self.last_ratio = None
        self.bytes_sent = 0
        self.dense_bytes = 0.0
        self._step = None  # the step whose buckets are being summed
        self._grad_sq = 0.0
        self._residual_sq = 0.0

    def add(self, step, grad_sq, residual_sq, selected, elements, dense_bytes):
        if self._step != step:
            self._close()
            self._step = step
        self._grad_sq += grad_sq
        self._residual_sq += residual_sq
        self.selected += selected
        self.elements += elements
        self.dense_bytes += dense_bytes
        self._update()

    def _update(self):
        if self._grad_sq > 0.0:
            self.last_ratio = (self._residual_sq / self._grad_sq) ** 0.5

    def _close(self):
        if self._step is not None and self.last_ratio is not None and self._grad_sq > 0.0:
            self.ratio_sum += self.last_ratio
            self.ratio_steps += 1
        self._grad_sq = self._residual_sq = 0.0

    def as_dict(self):
        self._close()
        self._step = None
        return {k: getattr(self, k) for k in self._FIELDS}

    @classmethod
    def from_dict(cls, d):
        h = cls()
        for k, v in (d or {}).items():
            if k in cls._FIELDS:
                setattr(h, k, v)
        return h


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


@_aborts_group_on_error("topk_hook")
def topk_hook(state: TopKState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsified gradient averaging with error feedback (see the module docstring)."""
    if isinstance(state, TopKState) and state._bytes_group is None:
        state._count_bytes()  # bytes are counted from the hook's first step on
        _LIVE.add(state)
    buffer, group, world, step, segments, done = _start_compressed("topk_hook", state, TopKState, bucket, _topk_pycomm)
    if done is not None:
        if segments is not None and step < state.warmup_steps:  # a dense warm-up step
            n = buffer.numel()
            state._observe(step, 0.0, 0.0, n, n, _dense_bytes(buffer, world))
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
        k = topk_count(numel, state.density_at(step))
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
    if state.error_feedback:
        residual_sq = sum(float(torch.dot(state._residuals[o].view(-1), state._residuals[o].view(-1)))
                          for o, _, n in segments if n and state._residuals.get(o) is not None)
    else:
        residual_sq = 0.0
    g32 = buffer.to(torch.float32).view(-1)
    state._observe(step, float(torch.dot(g32, g32)), residual_sq, k_total, buffer.numel(),
                   _dense_bytes(buffer, world))

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


_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SPARSE_MIN_ENTRIES = 1.5  # TopKState(min_compression_rate=None): sparsified when density * numel >= this
_SMALL_BLOCK = 256  # TopKState(small_bits=...): elements per scale of the small parameters' all-reduce
_SMALL_SEED = 0x5347  # mixed into that all-reduce's rounding seed (apart from the selections')


def _dense_bytes(buffer: torch.Tensor, world: int) -> float:
    """What a ring all-reduce of ``buffer`` sends per rank: 2 (world - 1) / world of it."""
    return 2.0 * (world - 1) / world * buffer.numel() * buffer.element_size()


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
    density = state.density_at(step)
    flat_grads = grads.reshape(-1)
    grad_sq = float(torch.dot(flat_grads, flat_grads))  # before the kernels (momentum rewrites grads)
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
        indices, values = kernels.topk_ef(g, e, density, exact, seed)
        if state.momentum:
            g[indices] = 0.0  # momentum factor masking
        index_parts.append(indices + (base + offset))
        value_parts.append(values)
    if picked:
        offsets, lengths, exacts, seeds = (list(column) for column in zip(*picked))
        indices, values = kernels.topk_ef_segments(grads, e_all, offsets, lengths, density, exacts, seeds, base)
    elif not index_parts:
        indices, values = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    else:
        indices, values = torch.cat(index_parts), torch.cat(value_parts)
    sparse_numel = grads.numel() - sum(x.numel() for _, x, _, _ in dense)
    flat_e = e_all.reshape(-1)
    residual_sq = float(torch.dot(flat_e, flat_e)) if residual is not None else 0.0
    state._observe(step, grad_sq, residual_sq, indices.numel(), sparse_numel,
                   _dense_bytes(buffer, _group_size(state.process_group)))
    return indices, values, dense


def _sparse_and_dense(backend, state: TopKState, indices, values, out, residual, value_dtype, lengths,
                      dense, step: int, group=None, divisor: int = 1) -> torch.futures.Future:
    """Starts the sparse all-reduce of (indices, values) into ``out`` and, when ``dense``
    lists parameters too small to pay, one all-reduce (SUM) of all of them, issued right
    after it (the same order on every rank): exact in float32, or quantized to
    ``state.small_bits`` with its error written into their residuals. The future
    completes with ``out`` holding the sums of all ranks, the small parameters' included,
    divided by ``divisor`` (the same float division as dividing ``out`` afterwards)."""
    work = backend.allreduce_sparse(indices, values, out, residual, value_dtype, state._owner_at(step), lengths,
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
    # per call (its fresh pages faulted in on every call) and the pass that divided it.
    in_place = buffer.dtype == torch.float32 and buffer.is_contiguous()
    out = buffer if in_place else torch.empty(numel, dtype=torch.float32)
    fut = _sparse_and_dense(backend, state, indices, values, out, residual, value_dtype, lengths, dense, step,
                            group, divisor=world if in_place else 1)
    return fut.then(_returned(buffer) if in_place else _averaged_into(buffer, world))
