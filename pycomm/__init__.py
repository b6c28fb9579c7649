"""pycomm: collective communication for PyTorch.

`import pycomm` registers the "pycomm" torch.distributed backend::

    import pycomm, torch.distributed as dist
    dist.init_process_group("pycomm")
"""
import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

from . import _C
from ._backend import (
    BACKEND_NAME,
    get_algorithm,
    last_algorithm,
    register,
    select_algorithm,
    set_algorithm,
)
from .config import Config, load_config

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "Config",
    "get_algorithm",
    "last_algorithm",
    "load_config",
    "select_algorithm",
    "set_algorithm",
]

register()
