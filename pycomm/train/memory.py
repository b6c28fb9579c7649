"""Memory per rank, as ``pycomm-train`` reports it (every ``--parallel`` mode, ddp included).

Two figures, both per rank and measured on the CPU:

* model state: the bytes of parameters, gradients and optimizer state this rank holds
  after an optimizer step (for a DTensor, FSDP2's or tensor parallel's, its local shard;
  each tensor counted once). Exact; it leaves out activations, communication buffers
  (DDP's gradient buckets, FSDP2's all-gathered layers) and the allocator's slack.
* peak RSS growth: the process's peak resident set during training minus its resident set
  just before the model was built (Linux VmHWM, reset through ``/proc/self/clear_refs``).
  Everything is in it, activations and buffers too, and so is noise (allocator caching,
  thread stacks, the pages of shared-memory transport the rank touches).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["RssPeak", "memory_report", "format_bytes"]



class RssPeak:
    """This process's peak resident set from now on, from Linux's VmHWM: created, it resets
    the high-water mark (``/proc/self/clear_refs`` 5) and remembers the current RSS;
    :meth:`growth` is the peak since then minus that. None where /proc does not allow it."""

    def __init__(self) -> None:
        self.start: Optional[int] = None
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.start = self._read("VmRSS")
        except OSError:
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
            return self._read("VmHWM") - self.start
        except OSError:
            return None


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
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
