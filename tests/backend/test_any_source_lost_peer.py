"""A receive from any source (``dist.recv`` without ``src``) on a group whose only other
rank is gone raises naming that rank, well before the group timeout (issue #40's
fuzzing found that the TCP transport kept such a receive posted until the caller's
timeout; tests/transport/test_any_source_cpp.py checks the transport alone)."""
import datetime
import os
import queue
import signal
import tempfile
import time

import pytest

from mp_util import in_environment, process_context

WAIT_LIMIT_S = 120  # hard wall-clock bound on the spawned run
GROUP_TIMEOUT_S = 60


def _worker(rank, world, q, rdzv):
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401  (the backend)

    dist.init_process_group("pycomm", init_method=rdzv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(4)
    start = time.monotonic()
    try:
        dist.recv(t)
        q.put((rank, ("received", time.monotonic() - start)))
    except Exception as exc:  # noqa: BLE001  (the test checks what it was)
        q.put((rank, (str(exc), time.monotonic() - start)))


def test_any_source_recv_fails_when_the_only_peer_is_gone():
    ctx = process_context()  # fresh processes: forked from mp_util's server (or spawned)
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=in_environment, args=(dict(os.environ), _worker, r, 2, q, rdzv), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            rank, (message, elapsed) = q.get(timeout=WAIT_LIMIT_S)
        except queue.Empty:
            pytest.fail(f"rank 0 reported nothing within {WAIT_LIMIT_S} s")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    assert rank == 0
    assert "rank 1" in message, message
    assert elapsed < GROUP_TIMEOUT_S / 2, f"failed after {elapsed:.1f} s (timeout {GROUP_TIMEOUT_S} s): {message}"
    assert procs[0].exitcode == 0
