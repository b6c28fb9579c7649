"""Lightning on pycomm (docs/integrations.md), as a user writes it:
    python lightning_train.py pycomm ddp OUT            # DDPStrategy
    python lightning_train.py pycomm modelparallel OUT  # ModelParallelStrategy + fully_shard
Lightning starts the second process itself (devices=2) and creates the group with the
strategy's process_group_backend."""
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

import common

backend, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = common.model()

    def configure_model(self):
        if mode == "modelparallel":
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if mode == "ddp":
    strategy = DDPStrategy(process_group_backend=backend)
else:
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend=backend)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
loader = torch.utils.data.DataLoader(common.dataset(), batch_size=common.BATCH, shuffle=False)
module = Regressor()
trainer.fit(module, loader)

state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.net.state_dict().items()}
facts = common.comm_facts()
if trainer.global_rank == 0:
    facts["steps"] = trainer.global_step
    facts["strategy_backend"] = str(strategy._get_process_group_backend())
    common.save_result(out, state, **facts)
