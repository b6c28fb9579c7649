"""Launching through torchrun (env:// rendezvous), as users do."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    import pycomm
    dist.init_process_group("pycomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == int(os.environ["WORLD_SIZE"])
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == world * (world + 1) / 2), t[:4]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    dist.destroy_process_group()
    print(f"rank {rank} of {world}: ok", flush=True)
    """
)


def test_torchrun_standalone(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 of 2: ok" in proc.stdout and "rank 1 of 2: ok" in proc.stdout
