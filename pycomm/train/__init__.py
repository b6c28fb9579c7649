"""pycomm.train: a small trainer around DistributedDataParallel on the pycomm backend.

Strategies: synchronous data parallel with any DDP comm hook, local SGD, EASGD; with loops
of their own (``build_trainer``), asynchronous SGD with parameter servers and CoCoA+; model
parallelism (``--parallel``: FSDP2, tensor parallel, pipelining) in :mod:`.parallel`.
Checkpoint / resume, JSON-lines metrics, a progress bar, plots, and the
``pycomm-train`` command (``python -m pycomm.train``). See docs/training.md.

Inside an initialised process group::

    from pycomm.train import TrainConfig, Trainer
    result = Trainer(TrainConfig(task="digits-mlp", strategy="local_sgd")).fit()
"""

from .config import ConfigError, TrainConfig
from .strategies import (EASGDStrategy, LocalSGDStrategy, Strategy, SyncStrategy, allreduce_hook,
                         register_hook, resolve_hook)
from .tasks import TASKS, get_task
from .trainer import Trainer, build_trainer, train
from .async_ps import AsyncPSTrainer
from .cocoa import CoCoATrainer
from .parallel import ParallelTrainer
from . import gossip, fedavg, hogwild  # noqa: F401,E402  (they register their strategies; in this order)

__all__ = [
    "AsyncPSTrainer",
    "CoCoATrainer",
    "build_trainer",
    "ConfigError",
    "EASGDStrategy",
    "LocalSGDStrategy",
    "ParallelTrainer",
    "Strategy",
    "SyncStrategy",
    "TASKS",
    "TrainConfig",
    "Trainer",
    "allreduce_hook",
    "get_task",
    "register_hook",
    "resolve_hook",
    "train",
]
