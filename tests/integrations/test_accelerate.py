"""Recipe: HF Accelerate on pycomm, 2 CPU processes, against the same run on gloo."""
import pytest

pytest.importorskip("accelerate")

from harness import assert_same_parameters, load_result, torchrun  # noqa: E402


def test_accelerate_matches_gloo(tmp_path):
    torchrun("accelerate_train.py", "pycomm", tmp_path / "pycomm")
    torchrun("accelerate_train.py", "gloo", tmp_path / "gloo")
    ours, info = load_result(tmp_path / "pycomm")
    ref, ref_info = load_result(tmp_path / "gloo")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["pycomm_allreduces"] > 0, info  # the gradients went through pycomm
    assert info["num_processes"] == 2 and "MULTI_CPU" in info["distributed_type"], info
    # What docs/integrations.md warns of: Accelerate names the backend it would have chosen.
    assert info["accelerate_backend"] == "gloo", info
    assert ref_info["backend"] == "gloo", ref_info
    assert_same_parameters(ours, ref)
