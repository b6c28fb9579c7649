"""powersgd_hook: low-rank (PowerSGD) compression."""
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._common import _aborts_group_on_error, _check_state, _completed, _dense_allreduce, _group_size, _mix_seed
from .state import _CompressionState

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
