"""quantize_hook: blockwise quantization with error feedback, on the all_gather exchange
and on pycomm's two-phase quantized all-reduce."""
from typing import Any, Dict, Optional

import torch

from ..compression import SUPPORTED_BITS, QuantizedTensor, dequantize_blockwise, quantize_blockwise
from ._common import _aborts_group_on_error, _all_gather_bytes, _as_bytes, _averaged_into, _mix_seed
from .exchange import _HostGroups, _hosts_config, _hosts_exchange
from .state import _CompressionState, _start_compressed

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
                                                                   _quantize_pycomm)
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
