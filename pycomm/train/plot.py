"""A PNG comparing logged runs: training loss against step and against wall-clock."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

__all__ = ["read_log", "plot_runs"]

from .base import _PREFIX


def read_log(path: str) -> Dict[str, list]:
    """The records of one JSON-lines log, grouped by ``event`` (step, eval, start, end, ...)."""
    events: Dict[str, list] = {}
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{_PREFIX} {path}:{number} is not JSON ({exc.msg})") from None
            events.setdefault(record.get("event", "?"), []).append(record)
    if not events.get("step"):
        raise ValueError(f"{_PREFIX} {path} holds no step records")
    return events


def _label(path: str, events: Dict[str, list]) -> str:
    start = (events.get("start") or [{}])[0]
    if start.get("run_name"):
        return start["run_name"]
    cfg = start.get("config") or {}
    if cfg:
        return f"{cfg.get('strategy')}/{cfg.get('hook')} n={start.get('world_size')}"
    return os.path.splitext(os.path.basename(path))[0]


def _smooth(values: List[float], window: int) -> List[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(paths: Sequence[str], output: str, title: Optional[str] = None,
              labels: Optional[Sequence[str]] = None, smooth: int = 10) -> str:
    """Write ``output`` (PNG): loss vs step (left) and vs training wall-clock (right), one
    line per log (a moving average over ``smooth`` steps); without ``labels`` the legend names
    each run (run_name, or strategy/hook/world size) with its final test accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, path in enumerate(paths):
        events = read_log(path)
        # a resumed run repeats no steps, but keep the last record per step to be safe
        steps = {r["step"]: r for r in events["step"]}
        records = [steps[k] for k in sorted(steps)]
        label = labels[i] if labels else _label(path, events)
        if events.get("end") and not labels:
            label += f" (acc {events['end'][-1]['test_accuracy'] * 100:.1f}%)"
        loss = _smooth([r["loss"] for r in records], smooth)
        line, = by_step.plot([r["step"] for r in records], loss, label=label)
        by_time.plot([r["elapsed_s"] for r in records], loss, color=line.get_color(), label=label)
    for axis, xlabel in ((by_step, "optimizer step"), (by_time, "training wall-clock (s)")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(f"training loss (rank 0, mean of {smooth} steps)")
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
    by_step.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
