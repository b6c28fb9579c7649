"""Harness of the integration recipes (docs/integrations.md): each test runs a recipe
script (recipes/) with the client's real package on 2 CPU processes, once on pycomm and
once on gloo, and compares the final parameters. `make test-integrations` installs the
clients (requirements.txt, pinned in constraints.txt) in .venv-integrations and runs
these with PYCOMM_INTEGRATIONS=1; the main suite does not collect this folder."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(HERE, "recipes")
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_env(**extra):
    env = dict(os.environ)
    # the checkout under test first (its pycomm and pycomm_autoload); the entry point
    # torch calls comes from the installed metadata (make install)
    # (and recipes/, for processes that import the recipes' common module by name: Ray's)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, RECIPES] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYCOMM_AUTOLOAD", None)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_command(argv, timeout_s, env=None, cwd=None):
    """Runs argv in a session of its own; at the deadline kills the whole session
    (launchers' workers included) and fails. Returns (stdout, stderr) on exit code 0."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env or recipe_env(), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # a process outside the session (a daemon that called setsid) still holds the
            # pipes: report what had arrived at the deadline
            proc.kill()
            out, err = (_text(expired.output), _text(expired.stderr))
        pytest.fail(f"{' '.join(argv)} still running after {timeout_s} s\n--- stdout\n{out[-4000:]}\n"
                    f"--- stderr\n{err[-8000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers a launcher left behind
        except ProcessLookupError:
            pass
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode} after {seconds:.0f} s\n--- stdout\n"
                    f"{out[-4000:]}\n--- stderr\n{err[-12000:]}")
    return out, err


def torchrun(script, *args, nproc=2, extra=(), timeout_s=300, env=None):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *extra,
            os.path.join(RECIPES, script), *map(str, args)]
    return run_command(argv, timeout_s, env=env)


def python(script, *args, timeout_s=300, env=None):
    return run_command([sys.executable, os.path.join(RECIPES, script), *map(str, args)], timeout_s, env=env)


def load_result(path):
    """What a recipe's rank 0 saved (recipes/common.py: save_result)."""
    import torch

    with open(str(path) + ".json") as f:
        info = json.load(f)
    return torch.load(str(path) + ".pt"), info


def assert_same_parameters(ours, ref):
    import torch

    assert ours.keys() == ref.keys()
    for name in ours:
        assert torch.equal(ours[name], ref[name]), (
            f"{name}: max difference {(ours[name] - ref[name]).abs().max().item()}")
