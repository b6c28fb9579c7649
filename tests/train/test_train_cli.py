"""pycomm-train end to end, launched by torchrun as users do: a YAML config, the JSON-lines
log, the plot subcommand, and the failure/restart path (--max-restarts + --resume auto).
Each subprocess has a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pycomm.train.plot import read_log

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_TIMEOUT_S = 180


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    return env


def _run(args, cwd, timeout=_TIMEOUT_S):
    try:
        proc = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(args)} hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}", pytrace=False)
    return proc


def _torchrun(extra, train_args, cwd):
    return _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *extra,
                 "-m", "pycomm.train", *train_args], cwd)


def _main_here(args, cwd, monkeypatch, capfd):
    """``python -m pycomm.train ARGS`` outside torchrun, its main() in this process
    (mp_util.run_main_here): no interpreter to start for a plot or a usage error."""
    from mp_util import run_main_here

    from pycomm.train import cli

    return run_main_here(cli.main, args, cwd=cwd, monkeypatch=monkeypatch, capfd=capfd, timeout_s=_TIMEOUT_S,
                         name="pycomm.train")


def _describe(proc):
    return f"exit {proc.returncode}\n--- stdout:\n{proc.stdout[-4000:]}\n--- stderr:\n{proc.stderr[-4000:]}"


@pytest.mark.slow
def test_torchrun_yaml_log_and_plot(tmp_path, monkeypatch, capfd):
    (tmp_path / "run.yaml").write_text(
        "task: digits-mlp\nstrategy: local_sgd\nlocal_sgd_period: 2\nlocal_sgd_warmup: 4\n"
        "steps: 30\nbatch_size: 16\naccum_steps: 2\nprecision: bf16\nclip_grad_norm: 5.0\n"
        "eval_every: 10\nlog_file: logs/run.jsonl\n")
    proc = _torchrun([], ["--config", "run.yaml", "--lr", "0.1", "--no-progress"], tmp_path)
    assert proc.returncode == 0, _describe(proc)
    assert "pycomm-train: digits-mlp local_sgd" in proc.stdout and "on 2 ranks: 30 steps" in proc.stdout
    events = read_log(str(tmp_path / "logs" / "run.jsonl"))
    start = events["start"][0]
    assert start["world_size"] == 2 and start["backend"] == "pycomm"
    assert start["config"]["lr"] == 0.1 and start["config"]["precision"] == "bf16"  # flag over YAML
    steps = events["step"]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for record in steps:
        assert record["samples_per_s"] > 0 and record["step_s"] > 0 and record["comm_s"] >= 0
        assert record["compute_s"] <= record["step_s"]
    # warm-up steps all-reduce gradients; afterwards only every 2nd step averages the model
    assert all(r["bytes_sent"] > 0 for r in steps[:4])
    assert [r["bytes_sent"] > 0 for r in steps[4:10]] == [False, True] * 3
    assert [r["step"] for r in events["eval"]] == [10, 20, 30]
    assert events["end"][0]["test_accuracy"] > 0.8

    proc = _main_here(["plot", "logs/run.jsonl", "-o", "plot.png"], tmp_path, monkeypatch, capfd)
    assert proc.returncode == 0, _describe(proc)
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_torchrun_restart_resumes_from_checkpoint(tmp_path):
    args = ["--task", "digits-mlp", "--steps", "24", "--checkpoint-dir", "ckpt", "--checkpoint-every", "5",
            "--resume", "auto", "--log-file", "run.jsonl", "--no-progress", "--fail-at-step", "12"]
    proc = _torchrun(["--max-restarts", "1", "--monitor-interval", "0.5"], args, tmp_path)
    assert proc.returncode == 0, _describe(proc)
    assert "injected failure on rank 1 at step 12" in proc.stderr, _describe(proc)
    events = read_log(str(tmp_path / "run.jsonl"))
    # the first attempt logged steps 1..12 (the last rank failed at the start of step 13),
    # the second resumed from the step-10 checkpoint and ran to the end
    assert [r["step"] for r in events["resume"]] == [10]
    assert [r["step"] for r in events["step"]] == list(range(1, 13)) + list(range(11, 25))
    assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == "step_00000024.pt"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000024.pt"
    assert "on 2 ranks: 24 steps" in proc.stdout, _describe(proc)


def test_cli_spawn_usage_error(tmp_path, monkeypatch, capfd):
    proc = _main_here(["--strategy", "async"], tmp_path, monkeypatch, capfd)
    assert proc.returncode == 2, _describe(proc)
    assert "pycomm train: strategy must be one of sync, local_sgd, easgd" in proc.stderr
