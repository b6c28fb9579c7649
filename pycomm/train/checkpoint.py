"""Checkpoint files: written atomically by one rank, found again after a restart.

A checkpoint is one ``torch.save`` file ``<dir>/step_<N>.pt`` holding the job-wide state
(step, sampler position, scheduler, the strategy's shared state such as the EASGD
centre) and a list with one entry per rank (model, optimizer, RNG states, hook state).
Rank 0 writes it to a temporary file in the same directory, flushes it to disk and
renames it into place, then replaces ``<dir>/latest`` (a one-line text file naming the
newest checkpoint) the same way. A crash at any moment leaves either the old or the new
checkpoint, never a torn one.

A checkpoint holds only tensors and plain Python values (the RNG states too, as tensors),
and :func:`load` reads it with ``torch.load(..., weights_only=True)``: a file that carries
any other object (which unpickling would construct by running code) is refused, not run.
``latest`` may only name a file in its own directory.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import tempfile
from typing import Any, Dict, Optional

import torch

from .base import _PREFIX

__all__ = ["atomic_save", "atomic_write_text", "checkpoint_path", "find_checkpoint", "load", "rng_state",
           "set_rng_state", "FORMAT_VERSION"]

# 2: RNG states stored as tensors (1 held a NumPy array and tuples, and needed full unpickling)
FORMAT_VERSION = 2


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` through a temporary file + rename."""
    _atomic(path, lambda handle: torch.save(obj, handle))


def atomic_write_text(text: str, path: str) -> None:
    _atomic(path, lambda handle: handle.write(text.encode()))


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.pt")


def find_checkpoint(spec: str, directory: Optional[str] = None) -> Optional[str]:
    """Resolve ``spec`` (a file, a directory, or ``"auto"`` meaning ``directory``) to a
    checkpoint file. ``"auto"`` with no checkpoint yet gives None (a fresh start); a
    named file or directory that holds none is an error."""
    if spec == "auto":
        if not directory:
            raise ValueError(f"{_PREFIX} resume: auto needs checkpoint_dir")
        return _latest_in(directory)
    if os.path.isdir(spec):
        found = _latest_in(spec)
        if found is None:
            raise FileNotFoundError(f"{_PREFIX} no checkpoint in {spec} (no 'latest' file)")
        return found
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"{_PREFIX} checkpoint {spec} does not exist")
    return spec


def _latest_in(directory: str) -> Optional[str]:
    pointer = os.path.join(directory, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as handle:
        name = handle.read().strip()
    # the writer stores a bare file name; anything else could point outside the directory
    if not name or name in (".", "..") or os.path.basename(name) != name or (os.altsep and os.altsep in name):
        raise ValueError(f"{_PREFIX} {pointer} names {name!r}, which is not a file in {directory} "
                         f"('latest' must hold the bare name of a checkpoint next to it)")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{_PREFIX} {pointer} names {name}, which does not exist")
    return path


def load(path: str) -> Dict[str, Any]:
    """Read a checkpoint written by :func:`atomic_save` onto the CPU, as plain data only
    (``torch.load(..., weights_only=True)``). A file holding any other object is refused
    with a ``RuntimeError`` naming it; nothing in it runs."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" ({found.group(1)})" if found else ""
        raise RuntimeError(f"{_PREFIX} {path} is not a plain-data checkpoint: it holds an object{what} that "
                           f"only full unpickling could build, which can run arbitrary code; refusing to load "
                           f"it (pycomm checkpoints hold tensors and plain Python values only)") from None


def rng_state() -> Dict[str, Any]:
    """Every random generator the trainer touches (torch CPU/CUDA, Python, NumPy), as
    tensors and plain values, so that :func:`load` can read it back without unpickling code."""
    version, words, gauss = random.getstate()  # words: 625 ints < 2**32
    state: Dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64),
                                        "gauss": gauss}}
    try:
        import numpy
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(int(w) for w in python["state"].tolist()), python["gauss"]))
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state((saved["kind"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
