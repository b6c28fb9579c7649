"""The transformers Trainer on pycomm (docs/integrations.md). Run under a launcher:
    torchrun --nproc-per-node 2 trainer_train.py pycomm OUT
TrainingArguments(ddp_backend="pycomm") fails on CPU (the Trainer goes through
Accelerate, which rewrites the backend to gloo and then refuses pycomm): make the group
first, on pycomm, and leave ddp_backend unset."""
import sys

import torch
from transformers import Trainer, TrainingArguments

import common

backend, out = sys.argv[1], sys.argv[2]
if backend == "pycomm":
    import pycomm

    pycomm.init_process_group()  # before TrainingArguments: they set up the distributed state


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = common.model()

    def forward(self, x, labels=None):
        pred = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(pred, labels), "logits": pred}


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = common.dataset().tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


args = TrainingArguments(
    output_dir=out + ".trainer", use_cpu=True, per_device_train_batch_size=common.BATCH,
    num_train_epochs=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
    weight_decay=0.0, warmup_steps=0, seed=0, report_to=[], save_strategy="no",
    logging_strategy="no", disable_tqdm=True,
)
trainer = Trainer(model=Regressor(), args=args, train_dataset=Rows())
trainer.train()

facts = common.comm_facts()
if trainer.is_world_process_zero():
    common.save_result(out, trainer.model.net.state_dict(), **facts,
                       world_size_seen=args.world_size, parallel_mode=str(args.parallel_mode))
torch.distributed.barrier()
