"""Recipe: DeepSpeed ZeRO (stages 1, 2 and 3) on CPU on pycomm, 2 processes, against
the same runs on gloo."""
import pytest

pytest.importorskip("deepspeed")

from harness import assert_same_parameters, load_result, recipe_env, torchrun  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_matches_gloo(tmp_path, stage):
    env = recipe_env(DS_ACCELERATOR="cpu")
    torchrun("deepspeed_train.py", "pycomm", stage, tmp_path / "pycomm", env=env, timeout_s=400)
    torchrun("deepspeed_train.py", "gloo", stage, tmp_path / "gloo", env=env, timeout_s=400)
    ours, info = load_result(tmp_path / "pycomm")
    ref, ref_info = load_result(tmp_path / "gloo")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["world_size"] == 2 and info["pycomm_ops"], info
    assert ref_info["backend"] == "gloo", ref_info
    assert_same_parameters(ours, ref)
