"""torchrun elastic on pycomm (docs/integrations.md):
    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        elastic_train.py pycomm OUT [KILL_AT_STEP]
Rank 0 checkpoints after every step; with KILL_AT_STEP, rank 1 of the first attempt
SIGKILLs itself there, torchrun restarts both workers, and they resume from the checkpoint.
pycomm keeps each attempt's keys apart in the agent's store (TORCHELASTIC_RESTART_COUNT);
gloo needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for the same."""
import os
import signal
import sys

import torch
import torch.distributed as dist

import common

backend, out = sys.argv[1], sys.argv[2]
kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
ckpt = out + ".ckpt"

model = common.model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
start = 0
if os.path.exists(ckpt):
    saved = torch.load(ckpt)
    model.load_state_dict(saved["model"])
    start = saved["step"]
ddp = torch.nn.parallel.DistributedDataParallel(model)
for step, (x, y) in enumerate(common.shard(rank, world)):
    if step < start:
        continue
    if attempt == 0 and rank == 1 and step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        torch.save({"model": model.state_dict(), "step": step + 1}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()  # the checkpoint of this step exists before any rank goes on

facts = common.comm_facts()
if rank == 0:
    common.save_result(out, model.state_dict(), **facts, attempt=attempt, resumed_from=start)
dist.destroy_process_group()
