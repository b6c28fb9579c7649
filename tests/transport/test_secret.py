"""The job secret outside the store (PYCOMM_SECRET / PYCOMM_SECRET_FILE).

* pycomm/config.py reads it (the only reader of PYCOMM_*), never shows it, and
  hands it to the C++ core as GroupConfig.secret.
* Multi-process (mp_util.py): ranks with the same secret form a group and the
  store holds no secret; a rank with another secret fails to join with a clear
  error, within the group timeout, and no message shows either secret.
The handshake itself is tested without torch in tests/cpp/transport_test.cc.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run
from pycomm import _C, config


def test_secret_from_the_environment():
    assert config.load_config({}).secret == ""
    assert config.load_config({"PYCOMM_SECRET": "s3cret value, long enough"}).secret == "s3cret value, long enough"
    with pytest.raises(ValueError, match="PYCOMM_SECRET is set but empty"):
        config.load_config({"PYCOMM_SECRET": ""})


def test_secret_from_a_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  from a file, long enough\n")
    path.chmod(0o600)
    assert config.load_config({"PYCOMM_SECRET_FILE": str(path)}).secret == "from a file, long enough"
    with pytest.raises(ValueError, match="not both"):
        config.load_config({"PYCOMM_SECRET_FILE": str(path), "PYCOMM_SECRET": "x"})
    with pytest.raises(ValueError, match="cannot be read"):
        config.load_config({"PYCOMM_SECRET_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ValueError, match="holds no secret"):
        config.load_config({"PYCOMM_SECRET_FILE": str(tmp_path / "empty")})


def test_secret_reaches_the_group_config_and_is_never_shown():
    cfg = config.load_config({"PYCOMM_SECRET": "never-show-me-secret"})
    assert "never-show-me-secret" not in repr(cfg)
    options = config.group_config(cfg, timeout=datetime.timedelta(seconds=5), bind_address="127.0.0.1",
                                  global_ranks=[0, 1], store_prefix="p/")
    assert isinstance(options, _C.GroupConfig) and options.secret == "never-show-me-secret"
    assert "PYCOMM_SECRET" in config.ENV_VARS and "PYCOMM_SECRET_FILE" in config.ENV_VARS


def store_worker(ctx):
    """An all-reduce, then what the rendezvous store (a FileStore) holds."""
    t = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(t)
    dist.barrier()
    with open(os.path.join(ctx.tmpdir, "rdzv_main"), "rb") as f:
        stored = f.read()
    return {"sum": t.tolist(), "group_key": b"pycomm/attempt0/group" in stored,
            "secret_key": b"pycomm/attempt0/secret" in stored, "secret_text": b"shared-secret-text" in stored}


@pytest.mark.parametrize("how", ["env", "file", "none"])
def test_same_secret_forms_a_group_and_the_store_holds_none(tmp_path, how):
    env = {}
    if how == "env":
        env["PYCOMM_SECRET"] = "shared-secret-text"
    elif how == "file":
        (tmp_path / "secret").write_text("shared-secret-text\n")
        (tmp_path / "secret").chmod(0o600)
        env["PYCOMM_SECRET_FILE"] = str(tmp_path / "secret")
    res = spawn_run(store_worker, 2, env=env, pg_timeout_s=30, make_ref=False, timeout_s=120).check()
    for rank in range(2):
        out = res.returns[rank]
        assert out["sum"] == [3.0] * 4
        assert out["group_key"], "the check cannot see pycomm's keys in the FileStore"
        assert not out["secret_text"]
        # Without a secret, rank 0 puts a random one in the store (the control).
        assert out["secret_key"] == (how == "none"), out


def never_reached_worker(ctx):
    return "joined"


def test_mismatched_secret_fails_clearly():
    timeout = 4.0
    res = spawn_run(never_reached_worker, 2, pg_timeout_s=timeout, make_ref=False, timeout_s=90,
                    rank_env=[{"PYCOMM_SECRET": "alpha-secret-of-the-job"}, {"PYCOMM_SECRET": "beta-secret-of-the-job"}])
    assert not res.returns, res.returns
    assert not res.hung and not res.crashed, res.failure_message()
    assert "rank 1 could not authenticate rank 0" in res.errors[1], res.errors[1]
    assert "PYCOMM_SECRET" in res.errors[1]
    assert "rank 0 timed out waiting for connections from rank 1" in res.errors[0], res.errors[0]
    assert "could not authenticate this rank" in res.errors[0], res.errors[0]
    for text in res.errors.values():
        assert "alpha-secret-of-the-job" not in text and "beta-secret-of-the-job" not in text
    # Both fail within the group timeout plus process start-up, not later.
    assert res.elapsed_s < timeout + 40, res.elapsed_s


def test_secret_on_one_rank_only_fails_clearly():
    res = spawn_run(never_reached_worker, 2, pg_timeout_s=4.0, make_ref=False, timeout_s=90,
                    rank_env=[{}, {"PYCOMM_SECRET": "only-here-secret-text"}])
    assert not res.returns and not res.hung, res.failure_message()
    assert "rank 1 has a job secret (PYCOMM_SECRET or PYCOMM_SECRET_FILE) but rank 0 has none" in res.errors[1]
    assert "only-here-secret-text" not in res.errors[1]
