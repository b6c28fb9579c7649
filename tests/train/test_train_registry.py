"""pycomm.train's registry of strategies (pycomm/train/base.py): the one place that lists
them; TrainConfig, build_strategy, build_trainer and pycomm-train read it."""
import pytest

from pycomm.train import ConfigError, TrainConfig, base, cli
from pycomm.train.strategies import build_strategy


def test_every_strategy_is_registered_once_in_order():
    assert base.strategy_names() == ("sync", "local_sgd", "easgd", "async_ps", "cocoa", "gossip", "fedavg",
                                     "hogwild")
    from pycomm.train.config import STRATEGIES  # the old name reads the registry

    assert STRATEGIES == base.strategy_names()
    with pytest.raises(ValueError, match="registered twice"):
        base.register_strategy(base.StrategySpec("sync"))


def test_what_the_registry_says_is_what_runs():
    with pytest.raises(ValueError, match="async_ps has a trainer of its own"):
        build_strategy(TrainConfig(strategy="async_ps"))
    with pytest.raises(ValueError, match="hogwild is not a process-group strategy"):
        build_strategy(TrainConfig(strategy="hogwild"))
    with pytest.raises(ConfigError, match="cocoa solves the convex task"):  # cocoa's own validator
        TrainConfig(strategy="cocoa", task="digits-mlp").validate()
    assert cli.describe_comm(TrainConfig(strategy="local_sgd", local_sgd_warmup=3)) == \
        "hook allreduce for 3 warm-up steps"
    assert cli.describe_comm(TrainConfig(strategy="easgd")) is None
    assert "hogwild (one host)" in cli._strategy_help()


def test_a_new_strategy_is_one_registration():
    seen = []

    def validate(cfg, bad):
        seen.append(cfg.strategy)
        if cfg.lr > 1.0:
            raise bad("mine wants lr <= 1")

    base.register_strategy(base.StrategySpec("mine", strategy=lambda cfg, g, c: ("built", cfg.strategy),
                                             validate=validate, summary="a test"))
    try:
        cfg = TrainConfig(strategy="mine")
        cfg.validate()
        assert seen == ["mine"]
        with pytest.raises(ConfigError, match="pycomm train: mine wants lr <= 1"):
            TrainConfig(strategy="mine", lr=2.0).validate()
        assert build_strategy(cfg) == ("built", "mine")
        assert "mine (a test)" in cli._strategy_help()
    finally:
        base._STRATEGIES.pop("mine")
    with pytest.raises(ConfigError, match="strategy must be one of sync, local_sgd"):
        TrainConfig(strategy="mine").validate()
