"""Recipe: tensor-parallel inference with transformers' tp_plan="auto" on pycomm, 2
processes under torchrun (docs/inference.md): the logits of a prompt and of greedy decode
steps equal the one-process logits within bfloat16 tolerance."""
import pytest

pytest.importorskip("transformers")

from harness import load_result, python, recipe_env, torchrun  # noqa: E402


def test_tp2_logits_match_one_process(tmp_path):
    import torch

    model = tmp_path / "model"
    python("tp_inference_logits.py", "make", model)
    python("tp_inference_logits.py", "one", model, tmp_path / "one")
    torchrun("tp_inference_logits.py", "tp", model, tmp_path / "tp", "pycomm", env=recipe_env(), timeout_s=300)
    ref, _ = load_result(tmp_path / "one")
    ours, info = load_result(tmp_path / "tp")
    assert info["backend"] == "pycomm" and info["cpu_backend"] == "ProcessGroupPycomm", info
    assert info["world_size"] == 2, info
    # q_proj is column-parallel: each rank holds half of its 256 output rows
    assert info["sharded_q_proj"] == [128, 256], info
    # 2 row-parallel all-reduces per layer (o_proj, down_proj), 2 layers, 5 forwards
    assert info["allreduce_calls"] >= 2 * 2 * 5, info
    assert ours.shape == ref.shape == (12 + 4, 512)
    # each rank rounds its partial sums to bfloat16 before the all-reduce (one process
    # rounds the whole sum once): differences of a few bfloat16 ulps of the logits
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0.05, atol=0.02 * scale)
    # and the greedy choices agree wherever the reference's top two are further apart
    # than that tolerance
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * 0.02 * scale
    assert clear.sum() >= 8, "too few positions to compare the greedy choices"
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
