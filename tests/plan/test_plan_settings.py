"""python -m pycomm.plan hands the benchmark a settings object (BenchConfig.settings), which
reaches the ranks' pycomm group as pg_options, instead of rewriting os.environ (#39 item 3)."""
import os

import pytest
import torch.distributed as dist

import pycomm  # noqa: F401  (registers the backend)
from pycomm.config import load_config, with_settings


def test_plan_sweeps_pass_settings_not_the_environment(monkeypatch):
    import pycomm.bench
    from pycomm.plan import calibration, validation

    seen = []
    before = dict(os.environ)

    class Result:
        rows = [{"size_bytes": 8, "time_us": 1.0, "algo": "ring", "name": "ring"}]

    def fake_run(cfg):
        seen.append((cfg.settings, dict(os.environ)))
        return Result()

    monkeypatch.setattr(pycomm.bench, "run_benchmark", fake_run)
    calibration._sweep("ring", "tcp", 1 << 10, 1, sockets=2)
    validation._host_rows(2, None, ("ring",), 8, 1 << 10, 1, 0, cost_path="/tmp/x.json")
    assert seen[0][0] == {"PYCOMM_TRANSPORT": "tcp", "PYCOMM_SOCKETS_PER_PEER": "2", "PYCOMM_IO_THREADS": "2"}
    assert seen[1][0] == {"PYCOMM_COST_MODEL": "/tmp/x.json"}
    for _, environ in seen:
        assert environ == before  # the caller's environment, untouched during the run
    assert dict(os.environ) == before


def test_with_settings_overrides_and_checks(monkeypatch):
    monkeypatch.setenv("PYCOMM_ALGO", "tree")
    assert with_settings(None) is os.environ
    assert load_config(with_settings({"PYCOMM_ALGO": "ring"})).algorithm == "ring"
    assert load_config(with_settings({})).algorithm == "tree"
    with pytest.raises(ValueError, match="PYCOMM_"):
        with_settings({"ALGO": "ring"})
    with pytest.raises(TypeError):
        with_settings(["PYCOMM_ALGO"])


def test_pg_options_reach_the_group(tmp_path, monkeypatch):
    """A one-rank pycomm group made with pg_options uses them: the algorithm it starts with
    is the settings', not the environment's."""
    monkeypatch.delenv("PYCOMM_ALGO", raising=False)
    dist.init_process_group("pycomm", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            pg_options={"PYCOMM_ALGO": "ring"})
    try:
        assert pycomm.get_algorithm() == "ring"
        assert "PYCOMM_ALGO" not in os.environ
    finally:
        dist.destroy_process_group()
