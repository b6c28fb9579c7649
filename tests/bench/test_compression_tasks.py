"""benchmarks/compression_tasks.py: the summary (gaps per seed, bytes over the whole run),
the movement figures (path, displacement, where the travel goes) and a smoke run of the real
thing (2 ranks, one task, a few steps)."""
import importlib.util
import json
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


def _record(config, seed, metric, sent, task="regression", opt="sgd", world=2):
    return {"task": task, "optimizer": opt, "world": world, "config": config, "seed": seed, "steps": 10,
            "metric": metric, "bytes_sent_all_ranks": sent, "replicas_identical": True}


def test_summary_pairs_each_seed_with_its_dense_run():
    bench = _bench()
    records = [_record("dense", 0, 90.0, 1000.0), _record("dense", 1, 80.0, 1000.0),
               _record("topk", 0, 89.5, 10.0), _record("topk", 1, 77.0, 30.0),
               _record("topk", 2, 50.0, 1.0)]  # seed 2 has no dense run: left out
    (row,) = bench.summarise(records, ["dense", "topk"])
    assert row["seeds"] == [0, 1]
    assert row["dense"] == pytest.approx(85.0) and row["compressed"] == pytest.approx(83.25)
    assert row["gaps"] == [pytest.approx(-0.5), pytest.approx(-3.0)]
    assert row["gap_mean"] == pytest.approx(-1.75) and row["gap_worst"] == pytest.approx(-3.0)
    assert row["bytes_ratio"] == pytest.approx(2000.0 / 40.0)  # sums over the seeds
    assert row["met"] is False  # -1.75 points
    v = bench.verdict([row])["topk"]
    assert v["missed"] == ["regression sgd 2"] and v["min_bytes_ratio"] == pytest.approx(50.0)


def test_parse_config():
    bench = _bench()
    assert bench.parse_config("dense") is None
    assert bench.parse_config("topk") == {"density": 0.01}
    assert bench.parse_config("topk density=0.02 value_dtype='float32'") == {"density": 0.02,
                                                                             "value_dtype": "float32"}
    with pytest.raises(ValueError):
        bench.parse_config("powersgd")


@pytest.mark.slow
def test_smoke_run(tmp_path):
    """Two ranks, the regression task, 6 steps, dense and top-k: a row with its dense
    reference, bytes counted from the first step, replicas identical, the health fields."""
    bench = _bench()
    out = str(tmp_path / "smoke")
    assert bench.main(["--tasks", "regression", "--optimizers", "sgd", "--worlds", "2", "--seeds", "0",
                       "--steps", "6", "--configs", "dense;topk", "--out", out]) == 0
    with open(out + ".json") as handle:
        result = json.load(handle)
    (row,) = result["rows"]
    assert (row["task"], row["optimizer"], row["world"], row["config"]) == ("regression", "sgd", 2, "topk")
    assert row["replicas_identical"]
    assert row["bytes_ratio"] > 10  # 1% of 70,401 parameters against all of them
    records = result["records"]
    assert sorted(r["config"] for r in records) == ["dense", "topk"]
    assert all(r["steps"] == 6 and r["bytes_sent_all_ranks"] > 0 for r in records)
    # the movement: the path is at least the displacement (triangle inequality)
    assert all(r["path"] >= r["displacement"] > 0 and 0.1 <= r["travel_share_top10"] <= 1.0 for r in records)
    assert 0 < row["path_ratio"] and 0 < row["displacement_ratio"]
    health = next(r for r in records if r["config"] == "topk")["health"]
    assert health["steps"] == 6 and 0.0 < health["effective_density"] < 0.05
    with open(out + ".md") as handle:
        assert "| regression | sgd | 2 | topk | 1 |" in handle.read()
    # a rerun reuses the records: nothing new runs, the same table
    assert bench.main(["--tasks", "regression", "--optimizers", "sgd", "--worlds", "2", "--seeds", "0",
                       "--steps", "6", "--configs", "dense;topk", "--out", out]) == 0
    with open(out + ".records.jsonl") as handle:
        assert len(handle.readlines()) == 2


def _moved(config, seed, metric, path=None, displacement=None, top10=None):
    """A record of the AdamW regression with the movement fields (path, displacement, the
    top 10% entries' share of the travel) where given."""
    r = _record(config, seed, metric, 100.0 if config == "dense" else 1.0, opt="adamw")
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
    records = [_moved("dense", 0, 90.0, 10.0, 4.0, 0.2), _moved("dense", 1, 90.0, 30.0, 4.0, 0.4),
               _moved("topk", 0, 80.0, 5.0, 1.0, 0.5), _moved("topk", 1, 80.0, 15.0, 3.0, 0.7)]
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
    records = [_moved("dense", 0, 90.0), _moved("topk", 0, 80.0, 5.0, 1.0, 0.5)]
    (row,) = bench.summarise(records, ["dense", "topk"])
    assert "path_ratio" not in row and "travel_top10" not in row
    head, _, line = bench.table([row])
    assert "path ratio" not in head
    assert line.endswith("| **no** |")
