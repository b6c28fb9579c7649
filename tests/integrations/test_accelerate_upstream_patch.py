"""docs/upstream/accelerate-keep-registered-backend.patch, applied to a copy of the
installed Accelerate: its own test passes, and Accelerate then creates and reports a
pycomm group for InitProcessGroupKwargs(backend="pycomm") on 2 CPU processes."""
import os
import shutil
import subprocess
import sys

import pytest

accelerate = pytest.importorskip("accelerate")

from harness import ROOT, load_result, recipe_env, run_command, torchrun  # noqa: E402

PATCH = os.path.join(ROOT, "docs", "upstream", "accelerate-keep-registered-backend.patch")


@pytest.fixture
def patched(tmp_path):
    tree = tmp_path / "accelerate-src"
    shutil.copytree(os.path.dirname(accelerate.__file__), tree / "src" / "accelerate",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "tests").mkdir()
    done = subprocess.run(["git", "apply", "--verbose", PATCH], cwd=tree, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"the patch no longer applies to accelerate {accelerate.__version__}:\n" \
                                 f"{done.stderr}"
    return tree


def test_patch_own_test_passes(patched):
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(patched / "src"), env["PYTHONPATH"]])
    run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_multi_cpu_backend.py"],
                timeout_s=300, env=env, cwd=str(patched))


def test_patched_accelerate_keeps_pycomm(patched, tmp_path):
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(patched / "src"), env["PYTHONPATH"]])
    torchrun("accelerate_named_backend.py", "pycomm", tmp_path / "named", env=env)
    result, info = load_result(tmp_path / "named")
    assert info["accelerate_backend"] == "pycomm" and info["backend"] == "pycomm", info
    assert info["cpu_backend"] == "ProcessGroupPycomm" and info["pycomm_allreduces"] > 0, info
    assert result["x"].tolist() == [3.0] * 4
