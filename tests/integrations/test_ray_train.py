"""Recipe: Ray Train's TorchTrainer with TorchConfig(backend="pycomm") and no setup hook,
2 CPU workers, against the same run on gloo."""
import pytest

pytest.importorskip("ray.train.torch")

from harness import assert_same_parameters, load_result, python  # noqa: E402


def test_ray_train_matches_gloo(tmp_path):
    python("ray_train.py", "pycomm", tmp_path / "pycomm", tmp_path / "storage", timeout_s=400)
    python("ray_train.py", "gloo", tmp_path / "gloo", tmp_path / "storage", timeout_s=400)
    ours, info = load_result(tmp_path / "pycomm")
    ref, ref_info = load_result(tmp_path / "gloo")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["world_size"] == 2 and info["pycomm_allreduces"] > 0, info
    assert ref_info["backend"] == "gloo", ref_info
    assert_same_parameters(ours, ref)
