"""pycomm.train: strategies on 2-3 ranks, accumulation, checkpoint/resume, config, logs, plots.

Multi-process checks run through tests/mp_util.py (hard timeouts); each spawned run
groups several trainings, because starting ranks costs seconds.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist

from mp_util import run_multiprocess

from pycomm.train import ConfigError, TrainConfig, Trainer
from pycomm.train import checkpoint as ckpt
from pycomm.train import cli, strategies, tasks
from pycomm.train.plot import plot_runs, read_log

RUN_TIMEOUT_S = 150

# Small, fast runs on the digits MLP; constant LR so that short runs move steadily.
BASE = dict(task="digits-mlp", steps=40, batch_size=32, lr=0.05, momentum=0.9, schedule="constant",
            progress=False, seed=3)


def _cfg(**changes) -> TrainConfig:
    return TrainConfig.from_dict({**BASE, **changes})


def _fit(ctx, **changes):
    """Train with the run's pycomm default group; gloo (ctx.ref) carries eval/checkpoint traffic."""
    trainer = Trainer(_cfg(**changes), control_group=ctx.ref)
    initial = strategies.flat_parameters(trainer.model)
    result = trainer.fit()
    losses = [loss for _, loss in result["losses"]]
    return {"losses": losses, "acc": result["final"]["test_accuracy"], "params": result["params"],
            "local": result["local_params"], "distance": result["worker_distance"],
            "bytes": result["bytes_sent"], "travel": float((result["params"] - initial).norm())}


def _went_down(losses, factor=0.5) -> bool:
    head = sum(losses[:5]) / 5
    tail = sum(losses[-5:]) / 5
    return tail < factor * head


def _strategies_worker(ctx):
    import pycomm

    out = {}
    ctx.progress("sync allreduce")
    out["sync"] = _fit(ctx)
    ctx.progress("sync fp16 hook")
    out["fp16"] = _fit(ctx, hook="fp16")
    ctx.progress("local sgd H=1")
    out["local1"] = _fit(ctx, strategy="local_sgd", local_sgd_period=1)
    ctx.progress("local sgd H=4, warm-up 6")
    out["local4"] = _fit(ctx, strategy="local_sgd", local_sgd_period=4, local_sgd_warmup=6)
    ctx.progress("easgd")
    out["easgd"] = _fit(ctx, strategy="easgd", easgd_period=2)
    ctx.progress("easgd without elastic force")
    out["easgd0"] = _fit(ctx, strategy="easgd", easgd_period=2, easgd_alpha=0.0)
    # accumulation: 4 micro-steps of 8 under no_sync == one batch of 32
    for name, changes in (("big", dict(batch_size=32, accum_steps=1)),
                          ("accum", dict(batch_size=8, accum_steps=4))):
        ctx.progress(f"accumulation {name}")
        pycomm.reset_stats()
        out[name] = _fit(ctx, steps=15, **changes)
        out[name]["allreduce_calls"] = pycomm.stats()["ops"].get("allreduce", {}).get("count", 0)
    return out


def _assert_same_on_ranks(results, key, run):
    first = results[0][run][key]
    for rank, res in enumerate(results[1:], 1):
        assert torch.equal(res[run][key], first), f"{run}: {key} differs between rank 0 and rank {rank}"


def test_strategies_two_ranks():
    results = run_multiprocess(_strategies_worker, 2, timeout_s=RUN_TIMEOUT_S)
    r0 = results[0]
    for run in ("sync", "fp16", "local1", "local4", "easgd"):
        assert _went_down(r0[run]["losses"]), (run, r0[run]["losses"])
        # the EASGD centre trails the workers in a run this short (chance is 10%)
        assert r0[run]["acc"] > (0.7 if run == "easgd" else 0.85), (run, r0[run]["acc"])
    # synchronous runs keep the replicas identical; local SGD averages at the end
    for run in ("sync", "fp16", "local1", "local4"):
        _assert_same_on_ranks(results, "local", run)
    assert r0["sync"]["bytes"] > 0 and r0["fp16"]["bytes"] < 0.75 * r0["sync"]["bytes"], \
        (r0["sync"]["bytes"], r0["fp16"]["bytes"])
    # local SGD with H=1 is synchronous SGD (parameters are linear in the averaged gradients)
    assert torch.allclose(r0["local1"]["params"], r0["sync"]["params"], rtol=0, atol=1e-5), \
        float((r0["local1"]["params"] - r0["sync"]["params"]).abs().max())
    assert torch.allclose(torch.tensor(r0["local1"]["losses"]), torch.tensor(r0["sync"]["losses"]), atol=1e-5)
    # ...while H=4 is not (the test can tell them apart)
    assert not torch.allclose(r0["local4"]["params"], r0["sync"]["params"], atol=1e-5)
    # EASGD: workers stay close to the centre; without the elastic force they drift apart
    assert r0["easgd"]["distance"] < 0.1 * r0["easgd0"]["distance"], (r0["easgd"]["distance"],
                                                                      r0["easgd0"]["distance"])
    # ...and are much closer to it than the centre is to where training started
    assert r0["easgd"]["distance"] < 0.2 * r0["easgd"]["travel"], (r0["easgd"]["distance"], r0["easgd"]["travel"])
    _assert_same_on_ranks(results, "params", "easgd")  # the centre, gathered from its shards
    # accumulation: same parameters as one big batch, and no_sync kept the all-reduces at one per step
    assert torch.allclose(r0["accum"]["params"], r0["big"]["params"], rtol=0, atol=1e-6), \
        float((r0["accum"]["params"] - r0["big"]["params"]).abs().max())
    assert r0["accum"]["allreduce_calls"] == r0["big"]["allreduce_calls"] > 0


def _three_ranks_worker(ctx):
    out = {}
    ctx.progress("sync")
    out["sync"] = _fit(ctx, steps=30)
    ctx.progress("local sgd H=2")
    out["local2"] = _fit(ctx, strategy="local_sgd", local_sgd_period=2, steps=30)
    ctx.progress("easgd cnn")  # 38282 parameters: the centre shards need padding on 3 ranks
    out["easgd"] = _fit(ctx, task="digits-cnn", strategy="easgd", easgd_period=3, steps=60, lr=0.1)
    return out


def test_strategies_three_ranks():
    results = run_multiprocess(_three_ranks_worker, 3, timeout_s=RUN_TIMEOUT_S)
    r0 = results[0]
    for run in ("sync", "local2", "easgd"):
        assert _went_down(r0[run]["losses"], 0.6), (run, r0[run]["losses"])
    _assert_same_on_ranks(results, "local", "sync")
    _assert_same_on_ranks(results, "local", "local2")
    _assert_same_on_ranks(results, "params", "easgd")
    assert r0["easgd"]["distance"] < 0.2 * r0["easgd"]["travel"], (r0["easgd"]["distance"], r0["easgd"]["travel"])
    assert any(not torch.equal(results[0]["easgd"]["local"], r["easgd"]["local"]) for r in results[1:])


# ---------------------------------------------------------------------------
# checkpoint / resume
# ---------------------------------------------------------------------------

RESUME_STEPS = 20
RESUME_RUNS = {
    # dropout exercises the RNG state, accumulation + clipping + cosine the rest of the loop
    "sync": dict(accum_steps=2, batch_size=16, dropout=0.2, clip_grad_norm=1.0, schedule="cosine",
                 warmup_steps=3),
    "local_sgd": dict(strategy="local_sgd", local_sgd_period=3, local_sgd_warmup=2, dropout=0.1),
    "easgd": dict(strategy="easgd", easgd_period=3, precision="bf16"),
    # error-feedback residuals and the hook's step counter travel in the (plain-data) checkpoint
    "topk": dict(hook="topk"),
}


def _resume_first_worker(ctx, root):
    out = {}
    for name, changes in RESUME_RUNS.items():
        ctx.progress(f"{name}: straight")
        straight = _fit(ctx, steps=RESUME_STEPS, **changes)
        ctx.progress(f"{name}: first half + checkpoint")
        directory = os.path.join(root, name)
        cfg = _cfg(steps=RESUME_STEPS, checkpoint_dir=directory, checkpoint_every=RESUME_STEPS // 2,
                   log_file=os.path.join(directory, "log.jsonl"), **changes)
        trainer = Trainer(cfg, control_group=ctx.ref)
        half = trainer.fit(max_steps=RESUME_STEPS // 2)
        out[name] = {"straight": straight, "half": [loss for _, loss in half["losses"]],
                     "half_eval": trainer.evaluate()}
    return out


def _resume_second_worker(ctx, root):
    out = {}
    for name, changes in RESUME_RUNS.items():
        ctx.progress(f"{name}: resume")
        directory = os.path.join(root, name)
        cfg = _cfg(steps=RESUME_STEPS, checkpoint_dir=directory, resume="auto",
                   log_file=os.path.join(directory, "log.jsonl"), **changes)
        trainer = Trainer(cfg, control_group=ctx.ref)
        assert trainer.step == RESUME_STEPS // 2, trainer.step
        result = trainer.fit()
        out[name] = {"losses": [loss for _, loss in result["losses"]], "params": result["params"],
                     "local": result["local_params"], "steps": [s for s, _ in result["losses"]]}
    return out


def test_resume_gives_the_same_curve(tmp_path):
    first = run_multiprocess(_resume_first_worker, 2, args=(str(tmp_path),), timeout_s=RUN_TIMEOUT_S)
    assert (tmp_path / "sync" / "latest").read_text().strip() == f"step_{RESUME_STEPS // 2:08d}.pt"
    second = run_multiprocess(_resume_second_worker, 2, args=(str(tmp_path),), timeout_s=RUN_TIMEOUT_S)
    half = RESUME_STEPS // 2
    for rank in range(2):
        for name in RESUME_RUNS:
            straight = first[rank][name]["straight"]
            resumed = second[rank][name]
            assert first[rank][name]["half"] == straight["losses"][:half], name
            assert resumed["steps"] == list(range(half + 1, RESUME_STEPS + 1)), name
            # bit for bit: same data order, RNG (dropout), momentum, schedule and strategy state
            assert resumed["losses"] == straight["losses"][half:], (name, rank)
            for key in ("params", "local"):
                assert torch.equal(resumed[key], straight[key]), \
                    (name, rank, key, float((resumed[key] - straight[key]).abs().max()))
    # the log of the stopped + resumed run holds every step exactly once, and a resume record
    events = read_log(str(tmp_path / "sync" / "log.jsonl"))
    assert [r["step"] for r in events["step"]] == list(range(1, RESUME_STEPS + 1))
    assert events["resume"][0]["step"] == half and len(events["end"]) == 1
    elapsed = [r["elapsed_s"] for r in events["step"]]
    assert elapsed == sorted(elapsed)  # wall-clock continues across the restart


def _resume_resized_worker(ctx, root):
    out = {}
    for name in ("sync", "easgd"):
        directory = os.path.join(root, name)
        cfg = _cfg(steps=RESUME_STEPS, resume=directory, **RESUME_RUNS[name])
        trainer = Trainer(cfg, control_group=ctx.ref)
        first_eval = trainer.evaluate()
        result = trainer.fit()
        out[name] = {"step0": trainer.resumed_from, "acc_at_resume": first_eval["test_accuracy"],
                     "acc": result["final"]["test_accuracy"], "local": result["local_params"]}
    return out


@pytest.mark.slow
def test_resume_on_another_world_size(tmp_path):
    first = run_multiprocess(_resume_first_worker, 2, args=(str(tmp_path),), timeout_s=RUN_TIMEOUT_S)
    results = run_multiprocess(_resume_resized_worker, 3, args=(str(tmp_path),), timeout_s=RUN_TIMEOUT_S)
    for name in ("sync", "easgd"):
        # the consensus model (sync replicas / re-sharded EASGD centre) came back unchanged...
        saved = first[0][name]["half_eval"]
        assert results[0][name]["acc_at_resume"] == saved["test_accuracy"], (name, results[0][name], saved)
        assert saved["test_accuracy"] > 0.2  # better than chance (10%): a real model was restored
        # ...and training went on from there on 3 ranks
        assert results[0][name]["acc"] > saved["test_accuracy"], (name, results[0][name], saved)
    _assert_same_on_ranks(results, "local", "sync")


# ---------------------------------------------------------------------------
# in-process pieces
# ---------------------------------------------------------------------------

def test_config_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("strategy: local_sgd\nlocal-sgd-period: 8\nlr: 0.1\nsteps: 50\n")
    cfg, launcher = cli.parse_config(["--config", str(path), "--lr", "0.2", "--no-progress", "-n", "3"])
    assert (cfg.strategy, cfg.local_sgd_period, cfg.lr, cfg.steps, cfg.progress) == ("local_sgd", 8, 0.2, 50, False)
    assert launcher["nprocs"] == 3
    assert cli.parse_config([])[0] == TrainConfig()


@pytest.mark.parametrize("values, match", [
    ({"stratgy": "sync"}, "unknown key"),
    ({"strategy": "async"}, "strategy must be one of"),
    ({"accum_steps": 0}, "accum_steps must be at least 1"),
    ({"precision": "fp16"}, "fp16 needs device cuda"),
    ({"checkpoint_every": 5}, "needs checkpoint_dir"),
    ({"easgd_alpha": 1.5}, "easgd_alpha"),
])
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match="^pycomm train: .*" + match):
        TrainConfig.from_dict(values)


def test_cli_usage_error_exit_code(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("strategy: [1, 2\n")
    assert cli.main(["--config", str(path)]) == 2
    assert "pycomm train:" in capsys.readouterr().err
    assert cli.main(["--strategy", "nope"]) == 2


def test_hooks_resolve():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert strategies.resolve_hook("fp16")[0] is default_hooks.fp16_compress_hook
    assert strategies.resolve_hook("bf16")[0] is default_hooks.bf16_compress_hook
    assert strategies.resolve_hook("allreduce")[0] is strategies.allreduce_hook
    hook, state = strategies.resolve_hook("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook")
    assert hook is default_hooks.allreduce_hook and state is None
    with pytest.raises(ValueError, match="^pycomm train: unknown hook 'topq'"):
        strategies.resolve_hook("topq")
    with pytest.raises(ValueError, match="^pycomm train: cannot import hook"):
        strategies.resolve_hook("no_such_module_xyz:hook")

    class CounterState:
        def __init__(self, group):
            self.group, self.calls = group, 0

    def counting_hook(state, bucket):
        state.calls += 1
        return default_hooks.allreduce_hook(state.group, bucket)

    strategies.register_hook("counting", counting_hook, CounterState)
    hook, state = strategies.resolve_hook("counting", group="G")
    assert hook is counting_hook and isinstance(state, CounterState) and state.group == "G"


def test_wrap_works_with_torch_2_11_ddp(monkeypatch):
    """torch 2.11 (the GPU machine's) has no DDP(forward_sync_buffers=...): wrap() raised
    TypeError there, which failed the demo and every pycomm-train run. A stand-in with
    2.11's parameter list gets broadcast_buffers=False; torch 2.13's DDP (this machine's,
    where broadcast_buffers is deprecated) gets forward_sync_buffers=False."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    got = {}

    class DDP211:  # torch 2.11.0's DistributedDataParallel.__init__ parameters
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                     init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                     check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                     delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                     device_mesh=None, skip_all_reduce_unused_params=False, bucket_cap_mb_list=None):
            got.update(module=module, broadcast_buffers=broadcast_buffers, process_group=process_group)

        def register_comm_hook(self, state, hook):
            got.update(state=state, hook=hook)

    monkeypatch.setattr(strategies, "DistributedDataParallel", DDP211)
    s = strategies.Strategy.__new__(strategies.Strategy)  # wrap() needs no process group
    s.group, s.hook_state, s.hook = "G", "state", strategies.allreduce_hook
    model = torch.nn.Linear(2, 2)
    assert isinstance(s.wrap(model), DDP211)
    assert got == {"module": model, "broadcast_buffers": False, "process_group": "G", "state": "state",
                   "hook": strategies.allreduce_hook}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        assert strategies._no_forward_buffer_sync(DistributedDataParallel) == {"forward_sync_buffers": False}


def test_register_hook_example_in_docs_runs():
    """docs/training.md's register_hook example, run as written (it passed ``ratio=``, which
    TopKState does not take)."""
    from pycomm.hooks import TopKState, topk_hook

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "training.md")).read()
    example = re.search(r"```python\n(from pycomm.train import register_hook\n.*?)```", text, re.S).group(1)
    builtin = strategies._BUILTIN_HOOKS["topk"]
    try:
        exec(example, {"topk_hook": topk_hook, "TopKState": TopKState})
        hook, state = strategies.resolve_hook("topk")
        assert hook is topk_hook and isinstance(state, TopKState) and state.density == 0.01
    finally:
        strategies.register_hook("topk", *builtin)


def test_registered_hook_keeps_the_builtins():
    """A hook registered before any lookup (as docs/training.md's example does) adds to the
    built-in names; it used to replace them all ("unknown hook 'allreduce'"). A new process:
    the table as a user's script first sees it."""
    import subprocess
    import sys

    code = ("from pycomm.train import register_hook, resolve_hook, allreduce_hook\n"
            "from pycomm.train.strategies import hook_names\n"
            "register_hook('mine', allreduce_hook)\n"
            "assert resolve_hook('allreduce')[0] is allreduce_hook\n"
            "assert {'allreduce', 'topk', 'mine'} <= set(hook_names()), hook_names()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_atomic_checkpoint_survives_a_failed_write(tmp_path, monkeypatch):
    path = ckpt.checkpoint_path(str(tmp_path), 7)
    ckpt.atomic_save({"step": 7}, path)
    ckpt.atomic_write_text("step_00000007.pt\n", str(tmp_path / "latest"))
    assert ckpt.find_checkpoint("auto", str(tmp_path)) == path
    assert ckpt.find_checkpoint(str(tmp_path)) == path

    def broken_save(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_save({"step": 8}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 7}
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000007.pt"]  # no temp file left behind
    assert ckpt.find_checkpoint("auto", str(tmp_path / "empty")) is None
    with pytest.raises(FileNotFoundError, match="^pycomm train:"):
        ckpt.find_checkpoint(str(tmp_path / "missing.pt"))


def test_rng_state_roundtrip(tmp_path):
    import random

    import numpy

    random.gauss(0.0, 1.0)  # leaves a cached second normal in both generators' states
    numpy.random.normal()
    path = str(tmp_path / "rng.pt")
    ckpt.atomic_save(ckpt.rng_state(), path)

    def draw():
        return (torch.rand(5).tolist(), random.random(), random.gauss(0.0, 1.0), numpy.random.normal(),
                numpy.random.rand(3).tolist())

    first = draw()
    ckpt.set_rng_state(ckpt.load(path))  # through a plain-data file (weights_only=True)
    assert draw() == first


class _RunsCode:
    """Unpickling this creates the marker file: a stand-in for a checkpoint that runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_latest_pointer_stays_in_its_directory(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    outside = tmp_path / "step_00000003.pt"
    ckpt.atomic_save({"step": 3}, str(outside))
    for name in ("../step_00000003.pt", str(outside), "sub/../../step_00000003.pt", "..", ""):
        (directory / "latest").write_text(name + "\n")
        for spec, where in (("auto", str(directory)), (str(directory), None)):
            with pytest.raises(ValueError, match=r"^pycomm train: .*latest names .*not a file in"):
                ckpt.find_checkpoint(spec, where)
    ckpt.atomic_save({"step": 4}, ckpt.checkpoint_path(str(directory), 4))
    (directory / "latest").write_text("step_00000004.pt\n")
    assert ckpt.find_checkpoint("auto", str(directory)) == ckpt.checkpoint_path(str(directory), 4)


def _resume_from_worker(ctx, path):
    try:
        Trainer(_cfg(resume=path), control_group=ctx.ref)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_checkpoint_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "marker"
    path = str(tmp_path / "step_00000005.pt")
    torch.save({"format": ckpt.FORMAT_VERSION, "task": "digits-mlp", "step": 5, "hook": _RunsCode(str(marker))},
               path)
    with pytest.raises(RuntimeError, match=r"^pycomm train: .*step_00000005\.pt is not a plain-data checkpoint"):
        ckpt.load(path)
    assert not marker.exists()
    # the trainer's resume path (rank 0 reads, every rank gets the error)
    messages = run_multiprocess(_resume_from_worker, 2, args=(path,), timeout_s=RUN_TIMEOUT_S)
    assert not marker.exists(), "loading the checkpoint ran code from it"
    for message in messages:
        assert message is not None and path in message and "not a plain-data checkpoint" in message, message
        assert re.search(r"\(\w+\.open\)", message), message  # names what it refused to build (io.open)


def test_tasks_are_deterministic():
    assert tasks.generate_text(500) == tasks.generate_text(500)
    first, second = tasks.get_task("digits-mlp"), tasks.get_task("digits-mlp")
    assert torch.equal(first.x_train, second.x_train) and first.x_train.shape == (1500, 64)
    assert set(first.y_test.tolist()) == set(range(10))
    lm = tasks.get_task("tinylm")
    assert torch.equal(lm.x_train[:, 1:], lm.y_train[:, :-1])  # targets are the next characters
    with pytest.raises(ValueError, match="^pycomm train: unknown task"):
        tasks.get_task("imagenet")


def test_tinylm_has_no_buffers_and_stays_causal():
    # DDP broadcasts every buffer from rank 0 at every step (broadcast_buffers=True): a
    # constant mask kept as a buffer cost 4 KiB per step, more than top-k 1%'s gradient pairs
    lm = tasks.get_task("tinylm")
    model = lm.make_model(0).eval()
    assert list(model.buffers()) == []
    tokens = lm.x_test[:2].clone()
    with torch.no_grad():
        before = model(tokens)
        tokens[:, 20:] = (tokens[:, 20:] + 1) % int(lm.y_train.max() + 1)
        after = model(tokens)
    assert torch.equal(before[:, :20], after[:, :20])  # earlier positions do not see later tokens
    assert not torch.allclose(before[:, 20:], after[:, 20:])
    # a checkpoint from when the mask was a buffer (key "mask") still loads strictly, also
    # nested as a DDP-style "module." prefix would put it
    old = dict(model.state_dict(), mask=torch.zeros(32, 32))
    fresh = lm.make_model(1)
    fresh.load_state_dict(old)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    wrapper = torch.nn.Sequential(lm.make_model(2))
    wrapper.load_state_dict({f"0.{k}": v for k, v in old.items()})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fresh.load_state_dict(dict(old, other=torch.zeros(1)))  # anything else still fails


def test_plot_runs(tmp_path):
    logs = []
    for name, scale in (("a", 1.0), ("b", 0.5)):
        path = tmp_path / f"{name}.jsonl"
        with open(path, "w") as handle:
            handle.write(json.dumps({"event": "start", "run_name": name, "config": {}}) + "\n")
            for step in range(1, 31):
                handle.write(json.dumps({"event": "step", "step": step, "loss": scale * 2.0 / step,
                                         "elapsed_s": 0.01 * step}) + "\n")
            handle.write(json.dumps({"event": "end", "test_accuracy": 0.9}) + "\n")
        logs.append(str(path))
    out = tmp_path / "cmp.png"
    plot_runs(logs, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    (tmp_path / "bad.jsonl").write_text('{"event": "start"}\n')
    with pytest.raises(ValueError, match="no step records"):
        read_log(str(tmp_path / "bad.jsonl"))
    assert cli.main(["plot", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.png")]) == 1


def test_trainer_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="^pycomm train: call dist.init_process_group"):
        Trainer(TrainConfig())
