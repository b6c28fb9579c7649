"""_CompressionState: the state every compressed hook shares (group, step counter,
per-parameter residuals and velocities, seeding, checkpoints), and the start of a compressed hook."""
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._common import (_STATE_VERSION, _check_kind, _check_state, _completed, _copied_into, _dense_allreduce,
                      _group_size, _mix_seed, _pycomm_backend)

# "auto": pycomm's compressed collectives on pycomm groups, all_gather elsewhere;
# "allgather": the all_gather exchange everywhere (the reference path).
_EXCHANGES = ("auto", "allgather")


def _compressed_collective(group, fn: Callable) -> Optional[Callable]:
    """THE plug-in point for pycomm's compressed collectives.

    For a pycomm ``group``, returns ``fn(state, buffer, world, step, segments) ->
    Future[Tensor]`` that encodes the bucket with the C++ kernels (``pycomm._C.kernels``)
    and averages it with the C++ collective: ``fn(backend, state, buffer, world, step,
    segments)``, the hook's pycomm path (topk.py's sparse all-reduce, quantize.py's
    two-phase quantized all-reduce). Returns None for any other backend; the hooks then
    use the all_gather exchange.

    The compressed collectives run on host memory. A CUDA bucket is staged: copied to
    the host (which waits for the stream that produced it), compressed and reduced
    there, and the result copied back, so the error-feedback residuals of a CUDA model
    live on the host. The result equals the same bucket's on CPU bit for bit."""
    backend = _pycomm_backend(group)
    if backend is None:
        return None
    def run(state, buffer, world, step, segments):
        if buffer.device.type == "cpu":
            return fn(backend, state, buffer, world, step, segments)
        host = buffer.to("cpu")
        return fn(backend, state, host, world, step, segments).then(_copied_into(buffer))

    return run


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


def _start_compressed(name, state, state_class, bucket, fast_path: Callable):
    """The start every compressed hook shares: counts the step and numbers the
    bucket's parameters (also during warm-up, which fixes their ordinals). Returns
    (buffer, group, world, step, segments, done); `done` is a future when this step
    needs nothing more from the hook: an empty bucket, a dense warm-up step, or the
    group's compressed collective (`fast_path`: the hook's pycomm path) under exchange="auto"."""
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
    fast = _compressed_collective(group, fast_path) if state.exchange == "auto" else None
    done = fast(state, buffer, world, step, segments) if fast is not None else None
    return buffer, group, world, step, segments, done
