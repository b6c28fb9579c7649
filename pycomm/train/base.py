"""The bottom of pycomm.train: the error prefix, ConfigError, and the registry of strategies
and trainers. It imports nothing else of pycomm.train, so every module can import it.

A strategy is registered once, by the module that implements it, with
:func:`register_strategy`: its name, how to build it (a :class:`~.strategies.Strategy` for
the DDP :class:`~.trainer.Trainer`, or a trainer with a loop of its own) and the checks of
its knobs. ``TrainConfig.validate``, ``build_strategy``, ``build_trainer`` and the command
line read the registry; no other module lists strategy names. ``import pycomm.train``
imports every module that registers one (pycomm/train/__init__.py), and importing any
module of the package imports the package first, so the registry is complete whenever a
configuration is checked.

Adding a strategy: a module with the strategy (or trainer) and one ``register_strategy``
call, imported by pycomm/train/__init__.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["PREFIX", "ConfigError", "StrategySpec", "register_strategy", "strategy_names", "strategy_spec",
           "register_trainer", "trainer_factory"]

PREFIX = "pycomm train:"
_PREFIX = PREFIX  # the name the modules of the package use


class ConfigError(ValueError):
    """A bad configuration value; the message starts with ``pycomm train:``."""


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """One strategy of ``TrainConfig.strategy``.

    ``strategy``: ``(cfg, group, control_group) -> Strategy`` for the DDP Trainer;
    ``trainer``: ``(cfg, group, control_group) -> trainer`` for a strategy with a loop of
    its own (its ``fit()`` takes no step limit); neither: not a process-group strategy,
    ``refusal`` says what to use instead. ``validate``: ``(cfg, bad) -> None``, the checks
    of the strategy's knobs (``bad(message)`` makes the ConfigError). ``run``: ``(cfg, nprocs,
    threads) -> summary`` for a strategy whose workers are not ranks of a process group
    (hogwild), which pycomm-train runs instead of launching ranks. ``describe``: ``cfg -> str
    or None``, what moved the gradients, for pycomm-train's summary. ``summary``: a few
    words for ``--help``."""

    name: str
    strategy: Optional[Callable[..., Any]] = None
    trainer: Optional[Callable[..., Any]] = None
    validate: Optional[Callable[[Any, Callable[[str], ConfigError]], None]] = None
    refusal: str = ""
    run: Optional[Callable[..., Any]] = None
    describe: Optional[Callable[[Any], Optional[str]]] = None
    summary: str = ""


_STRATEGIES: Dict[str, StrategySpec] = {}
_TRAINERS: Dict[str, Callable[..., Any]] = {}


def register_strategy(spec: StrategySpec) -> None:
    """Adds ``spec`` to the registry (in registration order, which error messages list)."""
    if spec.name in _STRATEGIES:
        raise ValueError(f"{PREFIX} strategy {spec.name!r} is registered twice")
    if spec.strategy is not None and spec.trainer is not None:
        raise ValueError(f"{PREFIX} strategy {spec.name!r}: give a strategy or a trainer, not both")
    _STRATEGIES[spec.name] = spec


def strategy_names() -> Tuple[str, ...]:
    return tuple(_STRATEGIES)


def strategy_spec(name: str) -> StrategySpec:
    spec = _STRATEGIES.get(name)
    if spec is None:
        raise ValueError(f"{PREFIX} unknown strategy {name!r}")
    return spec


def register_trainer(kind: str, factory: Callable[..., Any]) -> None:
    """A trainer other than the DDP Trainer's, by kind (``"parallel"``: the model-parallel
    modes of ``TrainConfig.parallel``)."""
    _TRAINERS[kind] = factory


def trainer_factory(kind: str) -> Callable[..., Any]:
    factory = _TRAINERS.get(kind)
    if factory is None:
        raise ValueError(f"{PREFIX} no trainer registered for {kind!r} (import pycomm.train)")
    return factory
