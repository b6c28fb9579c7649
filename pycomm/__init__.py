"""pycomm: collective communication for PyTorch.

`import torch` registers the "pycomm" torch.distributed backend where pycomm is
installed (pycomm_autoload, torch's device-backend autoload), and so does
`import pycomm`::

    import torch.distributed as dist
    dist.init_process_group("pycomm")

`pycomm.init_process_group()` does the same, and returns quietly when a pycomm
group exists already (for frameworks that create the group themselves).
"""
import os as _os
import warnings as _warnings

import torch  # loads libc10/libtorch, which _C links against (and runs pycomm_autoload)

from . import _C

if _os.path.dirname(_os.path.realpath(_C.__file__)) != _os.path.dirname(_os.path.realpath(__file__)):
    # pycomm_autoload loaded _C at `import torch` from the pycomm found then; a module
    # search path changed since makes this package run with another tree's _C.
    _warnings.warn(f"pycomm: this package ({_os.path.dirname(__file__)}) runs with the pycomm._C "
                   f"loaded at import torch from {_C.__file__}", RuntimeWarning, stacklevel=2)
from ._backend import (
    BACKEND_NAME,
    get_algorithm,
    init_process_group,
    last_algorithm,
    monitored_barrier,
    register,
    select_algorithm,
    set_algorithm,
)
from .config import Config, load_config
from .observability import CommSummary, comm_summary, flight_recorder


def stats() -> dict:
    """This process's pycomm counters since start (or the last reset_stats()):
    ``bytes_sent`` / ``bytes_received`` (payload bytes through every transport),
    ``buckets`` (the same per op, group size and power-of-two size bucket: what
    comm_summary() tabulates),
    ``bytes_buffered`` (received bytes that arrived before their receive was posted,
    so were copied once more),
    ``ops``: per operation name, ``count``, ``failures``, ``seconds`` (time on the
    worker thread) and ``bytes`` (size of the tensors the op was called with),
    and ``hooks``: the health of every live compressed-hook state whose hook has run
    (``kind``, then pycomm.hooks.TopKState.health()'s fields; kept in the state, so
    reset_stats() does not zero them)."""
    result = _C._stats()
    from .hooks.topk import _health_report

    result["hooks"] = _health_report()
    return result


def built_with_cuda() -> bool:
    """True when pycomm._C was built with its CUDA sources (a CUDA build of torch and
    nvcc at build time; see setup.py): collectives and pycomm._C.kernels then accept
    CUDA tensors."""
    return bool(_C._built_with_cuda())


def cuda_available() -> bool:
    """True when CUDA tensors can be used with pycomm here: built with CUDA
    (built_with_cuda()) and torch sees a GPU."""
    return built_with_cuda() and torch.cuda.is_available()


def reset_stats() -> None:
    """Zeroes the counters stats() reports (the hooks' health stays with their states)."""
    from .hooks.topk import _reset_stats

    _reset_stats(_C._reset_stats)


__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "CommSummary",
    "Config",
    "built_with_cuda",
    "comm_summary",
    "compression",
    "cuda_available",
    "flight_recorder",
    "get_algorithm",
    "hooks",
    "init_process_group",
    "last_algorithm",
    "load_config",
    "monitored_barrier",
    "reset_stats",
    "select_algorithm",
    "set_algorithm",
    "stats",
]

register()

from . import compression, hooks  # noqa: E402  (pure Python; after the backend is registered)
