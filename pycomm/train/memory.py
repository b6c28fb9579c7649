"""Memory per rank, as ``pycomm-train`` reports it (every ``--parallel`` mode, ddp included).

Two figures, both per rank and measured on the CPU:

* model state: the bytes of parameters, gradients and optimizer state this rank holds
  after an optimizer step (for a DTensor, FSDP2's or tensor parallel's, its local shard;
  each tensor counted once). Exact; it leaves out activations, communication buffers
  (DDP's gradient buckets, FSDP2's all-gathered layers) and the allocator's slack.
* peak RSS growth: the process's peak resident set during the training steps (Linux
  VmHWM, reset through ``/proc/self/clear_refs`` once the model is built) minus its
  resident set just before the model was built (or once it was built, if that is lower:
  memory freed meanwhile). Everything is in it, activations and
  buffers too, and so is noise: allocator caching, thread pools, the pages of the
  shared-memory transport the rank touches (far more than a small model's own memory).
"""

from __future__ import annotations

import gc
import re
import sys
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["RssPeak", "memory_report", "format_bytes"]



class RssPeak:
    """Peak resident set of this process during training, from Linux's VmHWM.

    Made just before the model is built, it collects garbage (an earlier run's, in a
    process that trains more than once) and remembers the resident set then (``start``).
    :meth:`reset_peak`, called once the model is built and sharded (just before the first
    step), notes the resident set then and resets the high-water mark
    (``/proc/self/clear_refs`` 5), so the transient whole model a rank builds before
    sharding it is not counted. :meth:`growth` is the peak since the reset minus the lower
    of the two resident sets: memory held before the model was built and freed while it
    was built (a buffer of an earlier run, pages the allocator gave back) does not make the
    growth negative. Such memory also hides part of the build: freeing F bytes while the
    build adds M leaves min(F, M) of the model out of the figure (all of it once F >= M),
    while the training steps' own growth is always counted. None where /proc does not
    allow it."""

    def __init__(self) -> None:
        # An earlier run in this process (the test suite, a notebook) may have left garbage
        # that only the cyclic collector frees; freed later, during the model build, it took
        # the resident set below ``start`` and the growth came out negative.
        gc.collect()
        try:
            self.start: Optional[int] = self._read("VmRSS")
        except (OSError, AttributeError):
            self.start = None
        self.at_reset = self.start

    def reset_peak(self) -> None:
        if self.start is None:
            return
        try:
            self.at_reset = self._read("VmRSS")
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except (OSError, AttributeError):
            self.start = None

    @staticmethod
    def _read(field: str) -> int:
        with open("/proc/self/status") as handle:
            text = handle.read()
        return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024

    def growth(self) -> Optional[int]:
        if self.start is None:
            return None
        try:
            return self._read("VmHWM") - min(self.start, self.at_reset)
        except (OSError, AttributeError):
            return None


def _local_bytes(tensor: torch.Tensor) -> int:
    # a DTensor only exists once torch.distributed.tensor is imported: no need to import it
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer, rss: Optional[RssPeak]) -> Dict[str, Any]:
    """This rank's bytes of parameters, gradients and optimizer state (the local shard of a
    DTensor; each tensor counted once) and its peak-RSS growth since ``rss`` was made."""
    seen = set()
    counts = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, tensor) -> None:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            counts[kind] += _local_bytes(tensor)

    for param in model.parameters():
        add("params", param)
        if param.grad is not None:
            add("grads", param.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the step counters
                add("optimizer", value)
    counts["state"] = counts["params"] + counts["grads"] + counts["optimizer"]
    counts["rss_peak_growth"] = rss.growth() if rss is not None else None
    return counts


def format_bytes(count: Optional[float]) -> str:
    if count is None:
        return "n/a"
    return f"{count / 2 ** 20:.2f} MiB"
