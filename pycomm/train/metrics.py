"""Observability: per-step records, a JSON-lines log and a progress bar (rank 0 only).

Record kinds written to the log (one JSON object per line, ``"event"`` says which):

``start``  the configuration, world size, backend, task sizes;
``step``   step, epoch, loss (rank 0's micro-batch mean), lr, samples_per_s (all ranks),
           step_s, comm_s (time inside pycomm collectives, from ``pycomm.stats()``; with
           DDP most of it overlaps the backward), compute_s (step_s minus the strategy's
           blocking communication), bytes_sent (this rank, from ``pycomm.stats()``) and
           elapsed_s (training wall-clock, continued across resumes);
``eval``   step, test_loss, test_accuracy (of the consensus model);
``end``    a summary (final accuracy, wall-clock, totals).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Optional

__all__ = ["CommMeter", "MetricsLogger"]


class CommMeter:
    """Deltas of ``pycomm.stats()`` between calls (zeros when the backend is not pycomm)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._pycomm = None
        if enabled:
            import pycomm

            self._pycomm = pycomm
        self._last = self._read()

    def _read(self) -> "tuple[int, int, float]":
        if self._pycomm is None:
            return 0, 0, 0.0
        stats = self._pycomm.stats()
        seconds = sum(op["seconds"] for op in stats["ops"].values())
        return stats["bytes_sent"], stats["bytes_received"], seconds

    def delta(self) -> Dict[str, float]:
        now = self._read()
        sent, received, seconds = (a - b for a, b in zip(now, self._last))
        self._last = now
        return {"bytes_sent": sent, "bytes_received": received, "comm_s": seconds}


class MetricsLogger:
    """Writes records to a JSON-lines file and drives a tqdm bar; silent off rank 0."""

    def __init__(self, path: Optional[str], enabled: bool, progress: bool, total_steps: int,
                 initial_step: int = 0, append: bool = False):
        self.enabled = enabled
        self._file = None
        self._bar = None
        if not enabled:
            return
        if path:
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            self._file = open(path, "a" if append else "w", buffering=1)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                             file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps(record, default=_jsonable) + "\n")
        if self._bar is not None:
            if record.get("event") == "step":
                self._bar.update(1)
                self._bar.set_postfix(loss=f"{record['loss']:.4f}",
                                      sps=f"{record['samples_per_s']:.0f}", refresh=False)
            elif record.get("event") == "eval":
                self._bar.write(f"step {record['step']}: test loss {record['test_loss']:.4f}, "
                                f"test accuracy {record['test_accuracy'] * 100:.2f}%")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
