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
so its modules do not use ``from __future__ import annotations``.

Checkpoints: ``state.state_dict()`` holds plain Python values and tensors (torch.save-able,
read back with ``torch.load(..., weights_only=True)``), each rank's tensors under a key
naming the rank; ``load_state_dict`` restores residuals and the step counter, and refuses
another rank's state or one saved at another world size.
"""

from .dense import AllreduceState, allreduce_hook
from .powersgd import PowerSGDState, powersgd_hook
from .quantize import QuantizeState, quantize_hook
from .state import rank_state
from .topk import TopKState, TopkState, topk_hook  # noqa: F401  (TopkState: the name pycomm.train derives)
from .wrappers import bf16_wrapper, fp16_wrapper

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
