"""Recipe: the transformers Trainer on pycomm, 2 CPU processes, against gloo."""
import pytest

pytest.importorskip("transformers")

from harness import assert_same_parameters, load_result, torchrun  # noqa: E402


def test_trainer_matches_gloo(tmp_path):
    torchrun("trainer_train.py", "pycomm", tmp_path / "pycomm")
    torchrun("trainer_train.py", "gloo", tmp_path / "gloo")
    ours, info = load_result(tmp_path / "pycomm")
    ref, ref_info = load_result(tmp_path / "gloo")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["pycomm_allreduces"] > 0 and info["world_size_seen"] == 2, info
    assert ref_info["backend"] == "gloo", ref_info
    assert_same_parameters(ours, ref)
