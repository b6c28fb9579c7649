"""Accelerate with the backend named as Accelerate documents it, which needs the
upstream fix of docs/upstream/accelerate-keep-registered-backend.patch:
    torchrun --nproc-per-node 2 accelerate_named_backend.py pycomm OUT"""
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

import common

backend, out = sys.argv[1], sys.argv[2]
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=backend)])
x = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(x)
facts = common.comm_facts()
if accelerator.is_main_process:
    common.save_result(out, {"x": x}, **facts, accelerate_backend=str(accelerator.state.backend))
accelerator.wait_for_everyone()
