"""What every recipe trains: a small MLP on a fixed regression problem, each rank on its
own shard, so that the final parameters depend on every gradient all-reduce."""
import json
import os

import torch

STEPS = 6
BATCH = 8


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def dataset(n=STEPS * BATCH * 2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return torch.utils.data.TensorDataset(x, y)


def shard(rank, world):
    """This rank's batches (the same split on every backend)."""
    x, y = dataset().tensors
    x, y = x[rank::world], y[rank::world]
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)][:STEPS]


def comm_facts():
    """Which backend carried the default group, and how many all-reduces pycomm ran."""
    import torch.distributed as dist

    facts = {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
             "cpu_backend": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__}
    if facts["backend"] == "pycomm":
        import pycomm

        ops = pycomm.stats()["ops"]
        facts["pycomm_ops"] = {name: row["count"] for name, row in ops.items()}
        facts["pycomm_allreduces"] = ops.get("allreduce", {}).get("count", 0)
    return facts


def save_result(path, state_dict, **info):
    state = {k: v.detach().cpu().clone() for k, v in state_dict.items()}
    torch.save(state, path + ".pt")
    with open(path + ".json", "w") as f:
        json.dump(info, f)


def rank():
    return int(os.environ.get("RANK", "0"))
