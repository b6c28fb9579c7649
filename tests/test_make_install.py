"""`make install` when the installed pycomm is stale: an editable install of a checkout
that was moved or deleted leaves a ``torch.backends`` entry point to a module that no
longer exists, and torch's autoload then fails every `import torch`, setup.py's
included. A "ghost" distribution on PYTHONPATH plays that stale install here."""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ghost(tmp_path):
    """PYTHONPATH holding a distribution whose torch.backends entry point names a module
    that is gone."""
    info = tmp_path / "ghost" / "pycomm_ghost-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pycomm-ghost\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nghost = pycomm_ghost_gone:register\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "ghost"))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-c", "import torch"], env=env, cwd="/", capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "pycomm_ghost_gone" in out.stderr, "the stale install breaks import torch"
    return env


def test_install_builds_past_a_stale_install(tmp_path, ghost):
    # pip replaced by a script that runs what pip's metadata step runs (setup.py, which
    # imports torch) under the environment make gives the `pip install -e .` line.
    fake_pip = tmp_path / "fake_pip"
    fake_pip.write_text(f"#!/bin/sh\ncase \"$*\" in *' -e .'*) exec {sys.executable} setup.py --name ;; esac\n")
    fake_pip.chmod(0o755)
    out = subprocess.run(["make", "-B", "install", f"PIP={fake_pip}", f"STAMP={tmp_path}/stamp"], cwd=ROOT,
                         env=ghost, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pycomm" in out.stdout.splitlines()


def test_stamp_does_not_hide_a_stale_install(tmp_path, ghost):
    """The stamp is newer than every source, yet make rebuilds where python's pycomm is not
    this checkout's (found first on the path: from this folder the checkout itself would
    shadow it) or where `import torch` fails."""
    stamp = tmp_path / "stamp"
    stamp.touch()
    future = time.time() + 3600  # newer than every source: only the import check can say "rebuild"
    os.utime(stamp, (future, future))
    clean = dict(os.environ)
    up_to_date = subprocess.run(["make", "-q", "install", f"STAMP={stamp}"], cwd=ROOT, env=clean,
                                capture_output=True, text=True, timeout=300)
    assert up_to_date.returncode == 0, "this checkout is the installed one: nothing to do"
    other = tmp_path / "other" / "pycomm"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "_C.py").write_text("")
    for env, why in ((dict(clean, PYTHONPATH=str(other.parent)), "pycomm installed from another folder"),
                     (ghost, "`import torch` fails")):
        stale = subprocess.run(["make", "-q", "install", f"STAMP={stamp}"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
        assert stale.returncode == 1, f"{why}: make must rebuild"
