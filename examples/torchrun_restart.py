"""Fault-tolerant training with torchrun --max-restarts on the pycomm backend.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 \\
        examples/torchrun_restart.py --ckpt /tmp/run/ckpt.pt --out /tmp/run/final.pt

Every --ckpt-every steps rank 0 writes a checkpoint (model, optimizer, next
step) atomically: to a temporary file in the same directory, then
os.replace(). On start, every rank resumes from the checkpoint if there is
one. When a rank dies, torchrun stops the others and starts all of them
again (at most --max-restarts times); they re-create the process group and
continue from the last checkpoint, so at most --ckpt-every - 1 steps are
repeated.

The data of step s on rank r is generated from (seed, s, r) alone, so a
resumed run computes exactly what an uninterrupted run computes: the final
parameters are bit-identical.

Failure injection (for the test): with RESTART_DEMO_KILL_AT_STEP=k, rank
RESTART_DEMO_KILL_RANK (default 1) sends itself SIGKILL at the start of step
k, once: it first creates the marker file <ckpt>.killed, and a later attempt
that finds the marker does not kill itself again.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm  # noqa: F401  (registers the "pycomm" backend)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt", required=True, help="checkpoint path (shared by all ranks)")
    p.add_argument("--out", help="rank 0 saves the final parameters here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend work per step")
    return p.parse_args()


def build_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(seed, step, rank):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(32, 4, generator=g)


def save_checkpoint(path, model, opt, next_step):
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"step": next_step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: readers see the old or the new checkpoint, never half of one


def digest(model):
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def init_process_group():
    """dist.init_process_group("pycomm") under torchrun.

    torchrun (torch 2.13) lets the workers of every attempt share the agent's
    TCPStore, so keys written by a failed attempt are still there when the next
    one starts. pycomm keeps each attempt's keys apart by itself (its store
    prefix includes TORCHELASTIC_RESTART_COUNT), so nothing special is needed
    here. (gloo has no such guard: with gloo, launch with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to give every attempt a fresh store.)"""
    dist.init_process_group("pycomm")


def main():
    args = parse_args()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = build_model(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        start = ckpt["step"]
        print(f"[rank {rank}] attempt {attempt}: resumed from checkpoint at step {start}", flush=True)
    else:
        print(f"[rank {rank}] attempt {attempt}: no checkpoint, starting at step 0", flush=True)
    ddp = DDP(model)

    kill_at = os.environ.get("RESTART_DEMO_KILL_AT_STEP")
    kill_rank = int(os.environ.get("RESTART_DEMO_KILL_RANK", "1"))
    marker = args.ckpt + ".killed"
    for step in range(start, args.steps):
        if kill_at is not None and rank == kill_rank and step == int(kill_at):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass  # already killed once: this is the restarted attempt
            else:
                print(f"[rank {rank}] attempt {attempt}: SIGKILL at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(args.seed, step, rank)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            if rank == 0:
                save_checkpoint(args.ckpt, model, opt, step + 1)
                print(f"[rank 0] attempt {attempt}: step {step + 1}: loss {loss.item():.5f}, checkpoint saved",
                      flush=True)
            dist.barrier()  # nobody runs ahead of the last checkpoint

    if rank == 0 and args.out:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    print(f"[rank {rank}] attempt {attempt}: done, {args.steps} steps, parameters {digest(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
