"""Reference gradient codecs in plain torch: top-k sparsification and blockwise quantization.

These are the definitions the DDP hooks (:mod:`pycomm.hooks`) use and the references the
C++ kernels (csrc/kernels/) are tested against. Every function takes a 1-D tensor of a
floating dtype (float32, float64, float16, bfloat16); arithmetic is done in float32.

Top-k (sparsification)
    :func:`topk_exact` keeps the k entries of largest ``|x|`` (``torch.topk``; ties broken
    arbitrarily, the order of the result is unspecified: compare as sets).
    :func:`topk_approx` is the one-pass selection of Deep Gradient Compression (Lin et al.
    2018): estimate the threshold as the k_s-th largest ``|x|`` of a random sample of s
    elements (k_s = ceil(s k / n)), keep every element with ``|x| >= threshold``, and when
    that keeps more than ``max_k`` take the exact top ``max_k`` of those. The number kept
    is k in expectation, not exactly.
    Result: ``(indices, values)``, int64 positions into ``x`` and ``x``'s values there.
    On the wire (hooks) indices are int32 and values keep the gradient's dtype:
    ``k * (4 + value_bytes)`` bytes.

Blockwise quantization (:func:`quantize_blockwise` / :func:`dequantize_blockwise`)
    ``x`` is cut into blocks of ``block`` consecutive elements (the last one may be
    shorter); every block has one float32 scale.

    * 8 and 4 bits (QSGD-style, Alistarh et al. 2017): ``L = 2**(bits-1) - 1`` levels per
      sign (127 or 7), ``scale = max |x|`` over the block, code ``q = round(L x / scale)``
      in ``[-L, L]``; decoded value ``q * scale / L``. Deterministic rounding is
      round-half-to-even, error ``<= scale / (2L)``. Stochastic rounding is
      ``q = floor(L x / scale + u)`` with ``u ~ U[0, 1)`` drawn as
      ``torch.rand(n, generator=generator)`` (element i takes the i-th draw): unbiased,
      ``E[decoded] = x``, error ``< scale / L``. An all-zero block has scale 0 and codes 0.
    * 1 bit (sign with scale, as in EF-signSGD, Karimireddy et al. 2019): bit = ``x >= 0``,
      ``scale = mean |x|`` over the block, decoded value ``+scale`` or ``-scale``. Always
      deterministic (``stochastic`` is ignored): the scaled sign is biased by design and
      relies on error feedback.

    Packed codes (``codes``, uint8, ``ceil(n * bits / 8)`` bytes):

    * 8 bits: the int8 code of element i is byte i (two's complement).
    * 4 bits: ``q + 8`` (1..15) of element 2j is the low nibble of byte j, element 2j+1
      the high nibble; an odd n leaves the last high nibble 0.
    * 1 bit: the bit of element 8j+b is bit b (value ``1 << b``) of byte j; unused bits 0.

    ``scales``: float32, ``ceil(n / block)`` values. Total ``compressed_nbytes``:
    ``ceil(n * bits / 8) + 4 * ceil(n / block)``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

__all__ = [
    "QuantizedTensor",
    "topk_exact",
    "topk_approx",
    "estimate_topk_threshold",
    "quantize_blockwise",
    "dequantize_blockwise",
    "pack_bits",
    "unpack_bits",
    "compressed_nbytes",
    "topk_count",
    "SUPPORTED_BITS",
]

SUPPORTED_BITS = (8, 4, 1)
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Default sample size of the threshold estimate: at least this many elements, or 1% of n.
_MIN_SAMPLE = 1024
_SAMPLE_FRACTION = 0.01


def _check_input(op: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"pycomm {op}: expected a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"pycomm {op}: expected a floating tensor (float32/64, float16, bfloat16), "
                        f"got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"pycomm {op}: expected a 1-D tensor, got shape {tuple(x.shape)} "
                         f"(flatten it first)")


# ---------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------

def topk_exact(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest ``|x|`` (``k`` is clamped to ``[0, n]``):
    ``(indices int64, values)``, order unspecified."""
    _check_input("topk", x)
    k = max(0, min(int(k), x.numel()))
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device), x.new_empty(0)
    _, indices = torch.topk(x.abs(), k, sorted=False)
    return indices, x[indices]


def estimate_topk_threshold(x: torch.Tensor, k: int, sample_size: Optional[int] = None,
                            generator: Optional[torch.Generator] = None) -> float:
    """DGC's threshold estimate: the ceil(s k / n)-th largest ``|x|`` of ``s`` elements
    drawn uniformly with replacement (``torch.randint(n, (s,), generator=generator)``).
    ``s`` defaults to ``max(1024, ceil(0.01 n))``; when ``s >= n`` the exact k-th largest
    ``|x|`` is returned."""
    _check_input("topk", x)
    n = x.numel()
    k = max(1, min(int(k), n))
    if sample_size is None:
        sample_size = max(_MIN_SAMPLE, math.ceil(_SAMPLE_FRACTION * n))
    if sample_size >= n:
        return float(torch.topk(x.abs().float(), k, sorted=True).values[-1])
    positions = torch.randint(n, (int(sample_size),), generator=generator).to(x.device)  # drawn on the host
    sample = x[positions].abs().float()
    k_sample = max(1, min(sample.numel(), math.ceil(sample.numel() * k / n)))
    return float(torch.topk(sample, k_sample, sorted=True).values[-1])


def topk_approx(x: torch.Tensor, k: int, *, sample_size: Optional[int] = None,
                generator: Optional[torch.Generator] = None,
                max_k: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Approximate top-k (DGC): every element with ``|x| >=`` the sampled threshold
    (:func:`estimate_topk_threshold`), at most ``max_k`` of them (the exact top ``max_k``
    of the selection when it is larger). Returns ``(indices int64 ascending, values)``;
    the count is about ``k``, not exactly."""
    _check_input("topk", x)
    n = x.numel()
    k = max(0, min(int(k), n))
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device), x.new_empty(0)
    threshold = estimate_topk_threshold(x, k, sample_size, generator)
    magnitude = x.abs()
    indices = torch.nonzero(magnitude >= threshold, as_tuple=False).flatten()
    if max_k is not None and indices.numel() > max_k:
        keep = torch.topk(magnitude[indices].float(), int(max_k), sorted=False).indices
        indices = indices[keep].sort().values
    return indices, x[indices]


# ---------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------

class QuantizedTensor(NamedTuple):
    """A blockwise-quantized 1-D tensor (format in the module docstring)."""

    codes: torch.Tensor  # uint8, ceil(numel * bits / 8) bytes
    scales: torch.Tensor  # float32, ceil(numel / block)
    numel: int
    bits: int
    block: int

    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()


def _check_format(op: str, bits: int, block: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pycomm {op}: bits must be 8, 4 or 1 (got {bits!r})")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"pycomm {op}: block must be a positive integer (got {block!r})")


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``values`` (< 2**bits) into uint8, ``8 // bits`` per byte, element i
    in bits ``[(i % per) * bits, ...)`` of byte ``i // per`` (low bits first). bits: 8, 4, 1."""
    if bits == 8:
        return values.to(torch.uint8)
    per = 8 // bits
    n = values.numel()
    padded = values.new_zeros(math.ceil(n / per) * per, dtype=torch.uint8)
    padded[:n] = values.to(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=values.device)
    return (padded.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` unsigned values (uint8)."""
    if bits == 8:
        return packed[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).flatten()[:numel]


def _block_view(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    nblocks = math.ceil(n / block)
    if nblocks * block == n:
        return x.view(nblocks, block)
    padded = x.new_zeros(nblocks * block)
    padded[:n] = x
    return padded.view(nblocks, block)


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = 256, stochastic: bool = False,
                       generator: Optional[torch.Generator] = None) -> QuantizedTensor:
    """Quantize 1-D ``x`` to ``bits`` (8, 4 or 1) with one float32 scale per ``block``
    elements; stochastic rounding (8 and 4 bits) draws from ``generator``."""
    op = "quantize"
    _check_input(op, x)
    _check_format(op, bits, block)
    n = x.numel()
    xf = x.float()
    blocks = _block_view(xf, block)
    if bits == 1:
        counts = torch.full((blocks.shape[0],), float(block), device=x.device)
        if n % block:
            counts[-1] = n % block
        scales = blocks.abs().sum(dim=1) / counts
        codes = pack_bits((xf >= 0).to(torch.uint8), 1)
        return QuantizedTensor(codes, scales, n, bits, block)
    levels = (1 << (bits - 1)) - 1
    scales = blocks.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = (blocks * (levels / safe).unsqueeze(1)).flatten()[:n]
    if stochastic:
        y = torch.floor(y + torch.rand(n, generator=generator).to(x.device))  # drawn on the host
    else:
        y = torch.round(y)
    q = y.clamp_(-levels, levels).to(torch.int8)
    if bits == 8:
        codes = q.view(torch.uint8)
    else:
        codes = pack_bits((q + 8).to(torch.uint8), 4)
    return QuantizedTensor(codes, scales, n, bits, block)


def dequantize_blockwise(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The decoded 1-D tensor of :func:`quantize_blockwise`'s result, in ``dtype``."""
    _check_format("dequantize", q.bits, q.block)
    n, block = q.numel, q.block
    nblocks = math.ceil(n / block)
    if q.scales.numel() != nblocks or q.codes.numel() != math.ceil(n * q.bits / 8):
        raise ValueError(f"pycomm dequantize: {q.codes.numel()} code bytes and {q.scales.numel()} "
                         f"scales do not describe {n} elements at {q.bits} bits, block {block}")
    scales = q.scales.float()
    if q.bits == 1:
        signs = unpack_bits(q.codes, 1, n).float().mul_(2).sub_(1)
        values = signs
        per_element = scales
    else:
        levels = (1 << (q.bits - 1)) - 1
        if q.bits == 8:
            values = q.codes.view(torch.int8).float()
        else:
            values = unpack_bits(q.codes, 4, n).float().sub_(8)
        per_element = scales / levels
    out = _block_view(values, block) * per_element.unsqueeze(1)
    return out.flatten()[:n].to(dtype)


# ---------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------

def compressed_nbytes(numel: int, method: str = "quantize", *, bits: int = 8, block: int = 256,
                      k: Optional[int] = None, density: Optional[float] = None,
                      value_bytes: int = 4, index_bytes: int = 4) -> int:
    """Bytes of one compressed tensor of ``numel`` elements.

    * ``"dense"``: ``numel * value_bytes``;
    * ``"topk"``: ``k * (index_bytes + value_bytes)``, with ``k`` given or
      ``ceil(density * numel)`` (at least 1 when numel > 0);
    * ``"quantize"``: ``ceil(numel * bits / 8) + 4 * ceil(numel / block)``.
    """
    numel = int(numel)
    if numel < 0:
        raise ValueError(f"pycomm compressed_nbytes: numel must be >= 0 (got {numel})")
    if method == "dense":
        return numel * value_bytes
    if method == "topk":
        if k is None:
            if density is None:
                raise ValueError("pycomm compressed_nbytes: topk needs k or density")
            k = topk_count(numel, density)
        return int(k) * (index_bytes + value_bytes)
    if method == "quantize":
        _check_format("compressed_nbytes", bits, block)
        return math.ceil(numel * bits / 8) + 4 * math.ceil(numel / block)
    raise ValueError(f"pycomm compressed_nbytes: method must be 'dense', 'topk' or 'quantize' "
                     f"(got {method!r})")


def topk_count(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` elements at ``density``: ``ceil(density * numel)``,
    at least 1 and at most numel (0 for an empty tensor)."""
    if numel <= 0:
        return 0
    return max(1, min(numel, math.ceil(density * numel)))
