"""pycomm.init_process_group: creates the pycomm default group, returns quietly when a
pycomm one exists, and refuses one of another backend, naming it. Fresh interpreters
(the default group is per process); 2 ranks over env://, as a launcher sets it up."""
import os
import subprocess
import sys
import textwrap

import pytest
from mp_util import communicate_all, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    import pycomm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    case = sys.argv[1]
    if case == "other":
        dist.init_process_group("gloo")
        try:
            pycomm.init_process_group()
        except RuntimeError as e:
            print("ERROR", e)
        sys.exit(0)
    pycomm.init_process_group(timeout=60)  # env:// from the launcher's variables
    world_group = dist.group.WORLD
    pycomm.init_process_group()  # a framework's second call: nothing happens
    pycomm.init_process_group(world_size=world, rank=rank)  # agrees with the group: nothing happens
    assert dist.group.WORLD is world_group
    try:
        pycomm.init_process_group(world_size=world + 1)
    except ValueError as e:
        print("MISMATCH", e)
    x = torch.ones(3) * (rank + 1)
    dist.all_reduce(x)
    print("BACKEND", dist.get_backend(), type(world_group._get_backend(torch.device("cpu"))).__name__)
    print("RESULT", x.tolist())
    dist.destroy_process_group()
"""


def _run(case, world, timeout_s=120):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT), case], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for returncode, out, err in communicate_all(procs, timeout_s):
        assert returncode == 0, err[-3000:]
        results.append(out)
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_creates_the_group_once(world):
    for rank, out in enumerate(_run("create", world)):
        assert "BACKEND pycomm ProcessGroupPycomm" in out, out
        assert f"RESULT {[float(sum(range(1, world + 1)))] * 3}" in out, out
        assert (f"MISMATCH pycomm init_process_group: the pycomm default group exists with "
                f"world_size={world}, not the world_size={world + 1} asked for") in out, out


def test_refuses_a_group_of_another_backend():
    (out,) = _run("other", 1)
    assert ("ERROR pycomm init_process_group: the default process group already exists with backend "
            "'gloo', not 'pycomm'") in out, out
