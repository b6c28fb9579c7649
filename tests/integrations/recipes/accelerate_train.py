"""HF Accelerate on pycomm (docs/integrations.md). Run under a launcher:
    torchrun --nproc-per-node 2 accelerate_train.py pycomm OUT
On multi-CPU Accelerate rewrites every backend but mpi to gloo, so the group is made
first, on pycomm; Accelerate then uses it (and still reports state.backend "gloo")."""
import sys

import torch
from accelerate import Accelerator

import common

backend, out = sys.argv[1], sys.argv[2]
if backend == "pycomm":
    import pycomm

    pycomm.init_process_group()  # before Accelerator(): Accelerate takes the existing group
accelerator = Accelerator(cpu=True)  # gloo run: Accelerate creates its gloo group itself

model = common.model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(common.dataset(), batch_size=common.BATCH, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

facts = common.comm_facts()
if accelerator.is_main_process:
    common.save_result(out, accelerator.unwrap_model(model).state_dict(), **facts,
                       accelerate_backend=str(accelerator.state.backend),
                       distributed_type=str(accelerator.distributed_type),
                       num_processes=accelerator.num_processes)
accelerator.wait_for_everyone()
accelerator.end_training()
