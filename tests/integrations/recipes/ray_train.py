"""Ray Train on pycomm (docs/integrations.md), as a user writes it:
    python ray_train.py pycomm OUT STORAGE
TorchConfig(backend="pycomm") with no hook: Ray's workers create the group before the
training function runs, and `import torch` in them has registered the backend (pycomm's
torch.backends entry point)."""
import sys

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

backend, out, storage = sys.argv[1], sys.argv[2], sys.argv[3]


def train_loop(config):
    import ray.train
    import ray.train.torch

    import common

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = ray.train.torch.prepare_model(common.model())  # DDP over Ray's group
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in common.shard(rank, world):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    facts = common.comm_facts()
    if rank == 0:
        common.save_result(config["out"], model.module.state_dict(), **facts)


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
trainer = TorchTrainer(
    train_loop, train_loop_config={"out": out},
    scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
    torch_config=TorchConfig(backend=backend),
    run_config=RunConfig(storage_path=storage, name=backend),
)
trainer.fit()
ray.shutdown()
