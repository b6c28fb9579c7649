"""benchmarks/compression_digits.py: the seed means, the accuracy curve and what is read
off it (the figures of docs/compression.md's accuracy tables come from these)."""
import argparse
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "compression_digits", os.path.join(ROOT, "benchmarks", "compression_digits.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_seeds_are_averaged_and_curves_meet_on_common_steps():
    bench = _bench()
    args = argparse.Namespace(seeds="3,5", seed=0, repeat=1)
    seen = []

    def launch():
        seen.append(args.seed)
        acc = {3: 0.5, 5: 0.7}[args.seed]
        return [{"config": "dense", "test_accuracy": acc, "bytes_per_step": 100.0 * args.seed,
                 "median_step_s": 0.01 * args.seed, "replicas_identical": True,
                 # seed 5 was also scored at step 30; only the steps both have are kept
                 "curve": [(10, acc - 0.2), (20, acc)] + ([(30, acc)] if args.seed == 5 else [])}]

    (row,) = bench._seeded(args, launch)
    assert seen == [3, 5]
    assert row["test_accuracy"] == pytest.approx(0.6)
    assert row["test_accuracy_seeds"] == [0.5, 0.7]
    assert row["bytes_per_step"] == pytest.approx(400.0)
    assert row["seeds"] == [3, 5]
    assert [s for s, _ in row["curve"]] == [10, 20]
    assert row["curve"][0][1] == pytest.approx(0.4) and row["curve"][1][1] == pytest.approx(0.6)


def test_steps_to_reach_and_accuracy_at():
    bench = _bench()
    curve = [(100, 0.40), (200, 0.80), (300, 0.79), (400, 0.85)]
    assert bench.steps_to_reach(curve, 0.79) == 200
    assert bench.steps_to_reach(curve, 0.85) == 400
    assert bench.steps_to_reach(curve, 0.86) is None
    assert bench.accuracy_at(curve, 300) == 0.79
    assert bench.accuracy_at(curve, 250) is None


@pytest.mark.slow
def test_scoring_during_training_changes_nothing(tmp_path):
    """The curve is read off the run whose final figures the table gives: scoring the test
    set every few steps must not change the training (no RNG drawn, train mode restored),
    and the curve's last point is the final accuracy."""
    bench = _bench()
    launch = bench._launch
    bench._launch = lambda *a, **k: launch(*a, **dict(k, timeout=120))  # a hang fails in 2 min
    results = {}
    for every in (0, 5):
        out = str(tmp_path / f"every{every}")
        assert bench.main(["--tasks", "cnn", "--steps", "20", "--eval-every", str(every), "--worlds", "2",
                           "--configs", "dense,topk 1% EF", "--slow-rates", "", "--out", out]) == 0
        with open(out + ".json") as handle:
            results[every] = {r["config"]: r for r in json.load(handle)["settings"][0]["rows"]}
    for config in ("dense", "topk 1% EF"):
        plain, scored = results[0][config], results[5][config]
        assert scored["test_accuracy"] == plain["test_accuracy"]
        assert scored["bytes_per_step"] == plain["bytes_per_step"]
        assert [s for s, _ in scored["curve"]] == [5, 10, 15, 20]
        assert scored["curve"][-1][1] == scored["test_accuracy"]
        assert plain["curve"] == []
    assert os.path.exists(str(tmp_path / "every5_curves.png"))
    assert "## Accuracy over training" in open(str(tmp_path / "every5.md")).read()


def test_ablation_curve_ends_at_the_final_accuracy_and_does_not_change_it(capsys):
    """benchmarks/topk_ablation.py --eval-every: the accuracy-over-steps figures of
    docs/compression.md's simulation; scoring between steps leaves training alone."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import topk_ablation
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    common = ["--task", "cnn", "--steps", "20", "--only", "4"]
    plain, _ = topk_ablation.main(common)
    scored, _ = topk_ablation.main(common + ["--eval-every", "10"])
    assert plain[0]["accuracy"] == scored[0]["accuracy"]
    curve = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("seed 0:")]
    assert len(curve) == 1
    points = [tuple(p.split(":")) for p in curve[0].split(":", 1)[1].split()]
    assert [int(step) for step, _ in points] == [10, 20]
    assert float(points[-1][1]) == pytest.approx(scored[0]["accuracy"][0] * 100, abs=0.05)
