"""DDP communication hooks (pycomm/hooks/topk.py holds them while the package is split)."""
from .topk import *  # noqa: F401,F403
from .topk import TopkState  # noqa: F401
from .topk import __all__  # noqa: F401
