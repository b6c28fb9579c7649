"""benchmarks/compression_tasks.py: the movement figures (path, displacement, where the
travel goes) that tell a top-k run's trajectory from dense's."""
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "compression_tasks", os.path.join(ROOT, "benchmarks", "compression_tasks.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _record(config, seed, metric, path=None, displacement=None, top10=None):
    r = {"task": "regression", "optimizer": "adamw", "world": 2, "config": config, "seed": seed, "steps": 10,
         "metric": metric, "bytes_sent_all_ranks": 100.0 if config == "dense" else 1.0,
         "replicas_identical": True}
    if path is not None:
        r.update(path=path, displacement=displacement)
    if top10 is not None:
        r["travel_share_top10"] = top10
    return r


def test_top_share():
    bench = _bench()
    assert bench._top_share(torch.ones(1000), 0.10) == pytest.approx(0.10)
    one = torch.zeros(1000)
    one[17] = 3.0
    assert bench._top_share(one, 0.01) == pytest.approx(1.0)
    ramp = torch.arange(1, 11, dtype=torch.float32)  # 1..10: the top 10% is the 10, of 55
    assert bench._top_share(ramp, 0.10) == pytest.approx(10.0 / 55.0)
    assert bench._top_share(torch.zeros(10), 0.10) == 0.0


def test_movement_ratios_sum_over_seeds_and_show_in_the_table():
    bench = _bench()
    records = [_record("dense", 0, 90.0, 10.0, 4.0, 0.2), _record("dense", 1, 90.0, 30.0, 4.0, 0.4),
               _record("topk", 0, 80.0, 5.0, 1.0, 0.5), _record("topk", 1, 80.0, 15.0, 3.0, 0.7)]
    (row,) = bench.summarise(records, ["dense", "topk"])
    assert row["path_ratio"] == pytest.approx(20.0 / 40.0)
    assert row["displacement_ratio"] == pytest.approx(4.0 / 8.0)
    assert row["travel_top10_dense"] == pytest.approx(0.3) and row["travel_top10"] == pytest.approx(0.6)
    head, _, line = bench.table([row])
    assert "path ratio" in head and "top 10% travel share" in head
    assert "| 0.50 | 0.50 | 0.300 / 0.600 |" in line


def test_records_without_movement_give_the_old_table():
    """Records made before the movement was recorded (a dense run of an older records file
    reused) leave the columns out instead of failing."""
    bench = _bench()
    records = [_record("dense", 0, 90.0), _record("topk", 0, 80.0, 5.0, 1.0, 0.5)]
    (row,) = bench.summarise(records, ["dense", "topk"])
    assert "path_ratio" not in row and "travel_top10" not in row
    head, _, line = bench.table([row])
    assert "path ratio" not in head
    assert line.endswith("| **no** |")
