"""Recipe: a small Llama-shaped model (random weights, bfloat16) loaded with transformers'
`from_pretrained(..., tp_plan="auto")` under torchrun; rank 0 saves the logits of a prompt
(one forward) and of 4 greedy decode steps on the cache, and which backend carried them.

    python tp_inference_logits.py make MODEL_DIR
    python tp_inference_logits.py one MODEL_DIR OUT          # one process, the reference
    torchrun --nproc-per-node 2 tp_inference_logits.py tp MODEL_DIR OUT pycomm
"""
import json
import sys

import torch

PROMPT = 12
STEPS = 4


def make(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def _local(weight):
    """This rank's shard of a parameter (transformers keeps sharded ones as DTensors)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def run(model):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=g)
    logits = []
    with torch.inference_mode():
        o = model(prompt, use_cache=True)
        logits.append(o.logits[0].float().clone())
        cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
        for _ in range(STEPS):
            o = model(tok, past_key_values=cache, use_cache=True)
            logits.append(o.logits[0].float().clone())
            cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
    return torch.cat(logits)


def main():
    from transformers import AutoModelForCausalLM

    what, path = sys.argv[1], sys.argv[2]
    if what == "make":
        return make(path)
    out = sys.argv[3]
    info = {}
    if what == "one":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        import torch.distributed as dist

        backend = sys.argv[4]
        if backend == "pycomm":
            import pycomm
            pycomm.reset_stats()
        dist.init_process_group(backend)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, tp_plan="auto")
        info = {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                "cpu_backend": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__,
                "tp_size": getattr(model, "tp_size", None),
                "sharded_q_proj": list(_local(model.model.layers[0].self_attn.q_proj.weight).shape)}
        if backend == "pycomm":
            info["allreduce_calls"] = pycomm.stats()["ops"].get("allreduce", {}).get("count", 0)
    model.eval()
    logits = run(model)
    if what == "tp":
        import torch.distributed as dist

        if backend == "pycomm":
            info["allreduce_calls"] = pycomm.stats()["ops"].get("allreduce", {}).get("count", 0) - info["allreduce_calls"]
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return
    torch.save(logits, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
