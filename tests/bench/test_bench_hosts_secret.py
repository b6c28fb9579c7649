"""``pycomm-bench --hosts``: the ranks rendezvous with a job secret drawn for the run
(``PYCOMM_SECRET``, as pycomm.launch draws one), so joining takes the secret, not
only access to the tcp:// store; a secret the user set is kept.

* the ranks' environment (in process, anywhere);
* end to end on 2 namespace hosts: every rank has the same 64-hex-digit secret, which
  the parent never had, and a pycomm group forms with it (skips where namespaces cannot
  be made).
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest

from pycomm.bench import hosts
from pycomm.bench.config import BenchConfig
from pycomm.netns import netns_unavailable_reason

_UNAVAILABLE = netns_unavailable_reason()


def test_rank_env_draws_a_fresh_secret(monkeypatch):
    monkeypatch.delenv("PYCOMM_SECRET", raising=False)
    monkeypatch.delenv("PYCOMM_SECRET_FILE", raising=False)
    first = hosts._rank_env("veth-x")
    second = hosts._rank_env("veth-x")
    assert re.fullmatch(r"[0-9a-f]{64}", first["PYCOMM_SECRET"])
    assert first["PYCOMM_SECRET"] != second["PYCOMM_SECRET"]
    assert "PYCOMM_SECRET" not in os.environ  # only the ranks get it


def test_rank_env_keeps_the_users_secret(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOMM_SECRET", "a secret the user chose, long enough")
    assert hosts._rank_env("veth-x")["PYCOMM_SECRET"] == "a secret the user chose, long enough"
    monkeypatch.delenv("PYCOMM_SECRET")
    monkeypatch.setenv("PYCOMM_SECRET_FILE", str(tmp_path / "secret"))
    env = hosts._rank_env("veth-x")
    assert "PYCOMM_SECRET" not in env  # both set would be refused by every rank
    assert env["PYCOMM_SECRET_FILE"] == str(tmp_path / "secret")


def secret_worker(rank, world_size, init_method, cfg):
    """A rank of the end-to-end test: its secret's digest, all-gathered over pycomm."""
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401  (the backend)

    secret = os.environ.get("PYCOMM_SECRET", "")
    dist.init_process_group("pycomm", init_method=init_method, rank=rank, world_size=world_size)
    try:
        digest = torch.tensor(list(hashlib.sha256(secret.encode()).digest()), dtype=torch.int64)
        gathered = [torch.zeros_like(digest) for _ in range(world_size)]
        dist.all_gather(gathered, digest)
    finally:
        dist.destroy_process_group()
    return {"length": len(secret), "digests": [bytes(g.tolist()).hex() for g in gathered]}


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"--hosts needs network namespaces: {_UNAVAILABLE}")
def test_hosts_ranks_share_a_drawn_secret(monkeypatch):
    monkeypatch.delenv("PYCOMM_SECRET", raising=False)
    monkeypatch.delenv("PYCOMM_SECRET_FILE", raising=False)
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    cfg = BenchConfig(nprocs=2, hosts=2, ranks_per_host=1, min_bytes=8, max_bytes=8, timeout_s=60.0)
    result = hosts.run_on_hosts(cfg, secret_worker)
    assert result["length"] == 64
    assert len(result["digests"]) == 2 and len(set(result["digests"])) == 1
    assert result["digests"][0] != hashlib.sha256(b"").hexdigest()
