"""The job secret's policy (issue #40, finding 4): a short secret is refused naming
the knob, a PYCOMM_SECRET_FILE that group or others may read is refused (as ssh
refuses such a key), and the local launcher gives its ranks a secret of their own
and a store only this user can read, with no port picked before it is bound."""
from __future__ import annotations

import os

import pytest

from pycomm import config
from pycomm.launch import launch_workers


def test_short_secret_is_refused_naming_the_knob():
    with pytest.raises(ValueError, match=r"PYCOMM_SECRET is 15 bytes; at least 16 are required") as info:
        config.load_config({"PYCOMM_SECRET": "fifteen bytes!!"})
    assert "fifteen" not in str(info.value)
    assert config.load_config({"PYCOMM_SECRET": "sixteen bytes!!!"}).secret == "sixteen bytes!!!"


def test_short_secret_file_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="PYCOMM_SECRET_FILE's secret is 5 bytes"):
        config.load_config({"PYCOMM_SECRET_FILE": str(path)})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_secret_file_others_may_read_is_refused(tmp_path, mode):
    path = tmp_path / "secret"
    path.write_text("a secret that is long enough\n")
    path.chmod(mode)
    with pytest.raises(ValueError, match=f"group or others \\(mode {mode:04o}\\); chmod 600"):
        config.load_config({"PYCOMM_SECRET_FILE": str(path)})
    path.chmod(0o600)
    assert config.load_config({"PYCOMM_SECRET_FILE": str(path)}).secret == "a secret that is long enough"


def environment_worker(rank, world_size, init_method, payload):
    """What a launched rank sees: its secret and where it rendezvous (no process group)."""
    store_dir = os.path.dirname(init_method[len("file://"):]) if init_method.startswith("file://") else ""
    return {"secret": os.environ.get("PYCOMM_SECRET"), "init_method": init_method,
            "store_dir_mode": os.stat(store_dir).st_mode & 0o777 if store_dir else None}


def test_launcher_draws_a_secret_and_a_private_store(monkeypatch):
    monkeypatch.delenv("PYCOMM_SECRET", raising=False)
    monkeypatch.delenv("PYCOMM_SECRET_FILE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    first = launch_workers(environment_worker, 1, None)
    second = launch_workers(environment_worker, 1, None)
    assert first["secret"] and len(first["secret"]) >= config.MIN_SECRET_BYTES
    assert first["secret"] != second["secret"], "each launch draws its own secret"
    assert first["init_method"].startswith("file://"), first["init_method"]
    assert first["store_dir_mode"] == 0o700, oct(first["store_dir_mode"])


def test_launcher_keeps_the_users_secret(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("PYCOMM_SECRET_FILE", raising=False)
    monkeypatch.setenv("PYCOMM_SECRET", "the user's own secret text")
    assert launch_workers(environment_worker, 1, None)["secret"] == "the user's own secret text"
