"""DeepSpeed ZeRO on CPU on pycomm (docs/integrations.md). Run under a launcher, with
DeepSpeed's CPU accelerator:
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 deepspeed_train.py pycomm STAGE OUT"""
import sys

import deepspeed
import torch
import torch.distributed as dist

import common

backend, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deepspeed.init_distributed(dist_backend=backend)
rank, world = dist.get_rank(), dist.get_world_size()
model = common.model()
config = {
    "train_micro_batch_size_per_gpu": common.BATCH,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": stage},
    "zero_allow_untested_optimizer": True,
}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config=config)
for x, y in common.shard(rank, world):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()

if stage == 3:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
else:
    state = engine.module.state_dict()
facts = common.comm_facts()
if rank == 0:
    common.save_result(out, state, **facts)
dist.barrier()
