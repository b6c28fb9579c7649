"""Recipe: torchrun elastic (--max-restarts 1) on pycomm with a worker killed mid-run:
the restarted workers resume from the checkpoint and end where an uninterrupted gloo run
ends."""
from harness import assert_same_parameters, load_result, torchrun


def test_elastic_restart_matches_uninterrupted_gloo(tmp_path):
    torchrun("elastic_train.py", "pycomm", tmp_path / "pycomm", 3, extra=("--max-restarts", "1"))
    torchrun("elastic_train.py", "gloo", tmp_path / "gloo")
    ours, info = load_result(tmp_path / "pycomm")
    ref, ref_info = load_result(tmp_path / "gloo")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["attempt"] == 1 and info["resumed_from"] == 3, info  # the restart happened
    assert ref_info["attempt"] == 0 and ref_info["resumed_from"] == 0, ref_info
    assert_same_parameters(ours, ref)
