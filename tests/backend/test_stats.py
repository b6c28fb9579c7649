"""pycomm.stats() through the backend: payload bytes and per-op counts/times."""
import torch
import torch.distributed as dist

from mp_util import run_multiprocess


def _stats_worker(ctx):
    import pycomm

    pycomm.set_algorithm("ring")
    dist.barrier()
    pycomm.reset_stats()
    t = torch.ones(1 << 16)  # 256 KiB
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(t, src=0)
    return pycomm.stats()


def test_stats_report_bytes_and_ops():
    results = run_multiprocess(_stats_worker, 2, timeout_s=120)
    size = (1 << 16) * 4
    for stats in results:
        ops = stats["ops"]
        assert ops["allreduce"]["count"] == 3
        assert ops["allreduce"]["bytes"] == 3 * size
        assert ops["allreduce"]["failures"] == 0
        assert ops["allreduce"]["seconds"] > 0
        assert ops["broadcast"]["count"] == 1
    # Ring on 2 ranks: each all-reduce sends S per rank; the broadcast root sends S once.
    assert results[0]["bytes_sent"] == 3 * size + size
    assert results[1]["bytes_sent"] == 3 * size
    assert results[1]["bytes_received"] == 3 * size + size
