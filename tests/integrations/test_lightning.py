"""Recipes: Lightning's DDPStrategy and ModelParallelStrategy (fully_shard) on pycomm,
2 CPU processes started by Lightning, against the same runs on gloo."""
import pytest

pytest.importorskip("lightning")

from harness import assert_same_parameters, load_result, python  # noqa: E402


@pytest.mark.parametrize("mode", ["ddp", "modelparallel"])
def test_lightning_matches_gloo(tmp_path, mode):
    python("lightning_train.py", "pycomm", mode, tmp_path / "pycomm")
    python("lightning_train.py", "gloo", mode, tmp_path / "gloo")
    ours, info = load_result(tmp_path / "pycomm")
    ref, ref_info = load_result(tmp_path / "gloo")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["world_size"] == 2 and info["steps"] == ref_info["steps"] > 0, (info, ref_info)
    if mode == "ddp":
        assert info["pycomm_allreduces"] > 0, info
    else:  # fully_shard: parameters all-gathered, gradients reduce-scattered, by pycomm
        ops = info["pycomm_ops"]
        gathers = sum(n for op, n in ops.items() if op.startswith("allgather"))
        scatters = sum(n for op, n in ops.items() if op.startswith("reduce_scatter"))
        assert gathers > 0 and scatters > 0, ops
    assert ref_info["backend"] == "gloo", ref_info
    assert_same_parameters(ours, ref)
