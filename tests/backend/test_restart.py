"""torchrun --max-restarts with examples/torchrun_restart.py (see docs/failures.md):
a rank SIGKILLs itself once mid-training; torchrun restarts the workers, which
resume from rank 0's last checkpoint, and the final parameters equal those of
an uninterrupted run."""

from __future__ import annotations

import os
import pathlib
import re
import sys

import torch

from netns_util import run_bounded

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torchrun_restart.py"
STEPS, EVERY, KILL_AT = 24, 5, 12  # last checkpoint before the kill: step 10


def _torchrun(tmp, name, kill_at=None, timeout=90):
    d = tmp / name
    d.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RESTART_DEMO_KILL_AT_STEP", None)
    if kill_at is not None:
        env.update(RESTART_DEMO_KILL_AT_STEP=str(kill_at), RESTART_DEMO_KILL_RANK="1")
    rc, out = run_bounded(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--max-restarts", "1", str(EXAMPLE), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
         "--ckpt", str(d / "ckpt.pt"), "--out", str(d / "final.pt")],
        timeout, env=env, cwd=d,
    )
    assert rc == 0, f"torchrun ({name}) exited {rc}:\n{out[-4000:]}"
    return out, torch.load(d / "final.pt", weights_only=True), d


def test_restart_resumes_from_checkpoint(tmp_path):
    ref_out, ref_params, _ = _torchrun(tmp_path, "uninterrupted")
    assert "attempt 1" not in ref_out, ref_out[-3000:]
    out, params, d = _torchrun(tmp_path, "killed", kill_at=KILL_AT)
    tail = out[-4000:]
    # the failure happened once, on the first attempt
    assert out.count("SIGKILL at step") == 1 and f"[rank 1] attempt 0: SIGKILL at step {KILL_AT}" in out, tail
    assert (d / "ckpt.pt.killed").exists()
    # torchrun restarted the workers, which resumed from the checkpoint written at step 10
    last_ckpt = (KILL_AT // EVERY) * EVERY
    for rank in (0, 1):
        assert f"[rank {rank}] attempt 1: resumed from checkpoint at step {last_ckpt}" in out, tail
        assert f"[rank {rank}] attempt 1: done, {STEPS} steps" in out, tail
    assert not re.search(r"attempt 1: no checkpoint", out), tail
    # steps after the kill were not completed by attempt 0
    assert f"attempt 0: step {last_ckpt + EVERY}:" not in out, tail
    # same result as the uninterrupted run, bit for bit
    assert params.keys() == ref_params.keys()
    for k in params:
        assert torch.equal(params[k], ref_params[k]), \
            f"{k}: max |diff| {(params[k] - ref_params[k]).abs().max().item():.3g} vs the uninterrupted run"
    # and training did something
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    assert not torch.equal(fresh.state_dict()["0.weight"], params["0.weight"])
