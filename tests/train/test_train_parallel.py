"""pycomm-train --parallel (pycomm/train/parallel.py): FSDP2, DTensor tensor parallel,
pipelining (GPipe, 1F1B) and the 2 x 2 hybrids, each against single-process training of
the same model on the same data, on the pycomm backend; the memory report; the errors
for combinations that are not supported; the summary line.

A data-parallel degree of d draws ``batch_size`` samples per replica from a
DistributedSampler over d replicas, which is, step for step, the same set of samples as
one process with ``batch_size x d``: the single-process reference runs the ordinary
Trainer on a one-rank group with that batch. Each spawned group trains several modes in
sequence (starting ranks costs seconds); dropout is 0 so the runs are deterministic.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed as dist

from mp_util import spawn_run

from pycomm.train import ConfigError, TrainConfig, build_trainer, cli
from pycomm.train.parallel import check_world_size

BASE = dict(task="tinylm-mp", dropout=0.0, steps=3, batch_size=8, lr=0.05, momentum=0.9,
            schedule="constant", progress=False, seed=5)
RTOL, ATOL = 1e-4, 1e-5


def _cfg(**changes) -> TrainConfig:
    return TrainConfig.from_dict({**BASE, **changes})


def _train(cfg, group=None, control=None):
    trainer = build_trainer(cfg, group, control)
    initial = trainer.local_parameters()  # the model gathered whole, for the parallel modes
    result = trainer.fit()
    return {"params": result["params"], "initial": initial, "losses": [l for _, l in result["losses"]],
            "memory": result["memory"], "accuracy": result["final"]["test_accuracy"]}


def _singles(world_size):
    """A one-rank pycomm group and a one-rank gloo group per rank (new_group is collective)."""
    groups = [(dist.new_group([r]), dist.new_group([r], backend="gloo")) for r in range(world_size)]
    return groups[dist.get_rank()]


def parallel_worker(ctx, runs, references):
    """``runs``: name -> config changes, trained in order on all ranks. ``references``: rank ->
    list of (name, changes) this rank trains alone (the single-process runs)."""
    warnings.simplefilter("ignore")
    single, single_control = _singles(ctx.world_size)
    out = {}
    for name, changes in runs.items():
        ctx.progress(name)
        out[name] = _train(_cfg(**changes), control=ctx.ref)
    for name, changes in references.get(ctx.rank, []):
        ctx.progress(f"reference {name}")
        out[name] = _train(_cfg(**changes), single, single_control)
    dist.barrier()
    # The interpreter's last garbage collection at exit walks every object the engines
    # (DTensor, FSDP2, pipelining) imported and built; on 4 ranks sharing 2 busy cores it
    # took longer than mp_util's 10 s exit grace (py-spy: gc_collect_main at finalisation).
    # Frozen objects are left out of that collection.
    gc.freeze()
    return out


def _collect(rets, world_size):
    """Every rank's runs, with the references merged in (each trained on one rank)."""
    merged = {}
    for r in range(world_size):
        for name, value in rets[r].items():
            if name.startswith("ref"):
                merged[name] = value
    return merged


def _check_matches(rets, world_size, run, ref, losses):
    """``losses``: compare the logged losses too (they are rank 0's replica's: the whole
    batch's only where there is one data-parallel replica)."""
    problems = []
    want = ref["params"]
    for r in range(world_size):
        got = rets[r][run]
        assert got["params"].shape == want.shape, (run, got["params"].shape, want.shape)
        if not torch.allclose(got["params"], want, rtol=RTOL, atol=ATOL):
            problems.append(f"{run} rank {r}: parameters differ from the single-process run by up to "
                            f"{(got['params'] - want).abs().max().item():.3g}")
        if losses and not torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                         rtol=1e-4, atol=1e-5):
            problems.append(f"{run} rank {r}: losses {got['losses']} vs single-process {ref['losses']}")
        # not vacuous: training moved the weights, and from the same start
        assert torch.equal(got["initial"], ref["initial"]), run
        assert (got["params"] - got["initial"]).abs().max() > 1e-3, run
    return problems


TWO_RANK_RUNS = {
    "ddp": dict(),
    "fsdp": dict(parallel="fsdp"),
    # AdamW on digits-mlp: tinylm-mp's attention key bias has a gradient of exactly 0 in
    # theory (softmax ignores a shift shared by all keys), so in practice rounding noise that
    # Adam's normalisation blows up to a step of size lr
    "fsdp_adamw": dict(parallel="fsdp", task="digits-mlp", optimizer="adamw", lr=0.01, accum_steps=2,
                       batch_size=4),
    "tp": dict(parallel="tp"),
    "pp_gpipe": dict(parallel="pp", pp_schedule="gpipe", microbatches=4),
    "pp_1f1b": dict(parallel="pp", pp_schedule="1f1b", microbatches=2),
    "tp_mlp": dict(parallel="tp", task="digits-mlp", batch_size=16),
    "pp_mlp": dict(parallel="pp", task="digits-mlp", batch_size=16),
}
# run -> the single-process run it must equal (batch_size x data-parallel replicas)
TWO_RANK_REFS = {
    "ddp": "ref16", "fsdp": "ref16", "fsdp_adamw": "ref_mlp16_adamw", "tp": "ref8", "pp_gpipe": "ref8",
    "pp_1f1b": "ref8", "tp_mlp": "ref_mlp16", "pp_mlp": "ref_mlp16",
}
TWO_RANK_REFERENCES = {
    0: [("ref16", dict(batch_size=16)),
        ("ref_mlp16_adamw", dict(task="digits-mlp", optimizer="adamw", lr=0.01, batch_size=16))],
    1: [("ref8", dict(batch_size=8)), ("ref_mlp16", dict(task="digits-mlp", batch_size=16))],
}


def test_fsdp_tp_pp_match_single_process_on_two_ranks():
    rets = spawn_run(parallel_worker, 2, args=(TWO_RANK_RUNS, TWO_RANK_REFERENCES), timeout_s=240,
                     pg_timeout_s=60, env={"OMP_NUM_THREADS": "1"}).check().returns
    refs = _collect(rets, 2)
    problems = []
    for run, ref in TWO_RANK_REFS.items():
        problems += _check_matches(rets, 2, run, refs[ref], losses=ref in ("ref8", "ref_mlp16"))
    assert not problems, "\n".join(problems)

    # memory per rank: ddp holds the whole model on each rank; FSDP2 and the pipeline split
    # it (the shards add up to the model); tensor parallel splits the attention and MLP
    # weights and replicates the rest
    full = refs["ref16"]["params"].numel() * 4
    memory = {run: rets[0][run]["memory"] for run in ("ddp", "fsdp", "tp", "pp_gpipe")}
    assert [m["params"] for m in memory["ddp"]] == [full, full]
    assert [m["grads"] for m in memory["ddp"]] == [full, full]
    assert [m["optimizer"] for m in memory["ddp"]] == [full, full]  # SGD momentum
    for run in ("fsdp", "pp_gpipe"):
        assert sum(m["params"] for m in memory[run]) == full, (run, memory[run])
        assert all(m["params"] < 0.6 * full and m["state"] == 3 * m["params"] for m in memory[run]), memory[run]
    assert all(0.5 * full < m["params"] < full for m in memory["tp"]), memory["tp"]
    adamw = rets[0]["fsdp_adamw"]["memory"]
    mlp = refs["ref_mlp16_adamw"]["params"].numel() * 4
    assert sum(m["optimizer"] for m in adamw) == 2 * mlp  # exp_avg and exp_avg_sq, sharded
    # peak-RSS growth (measured, tests/train/test_train_memory.py): ddp, the first run in the
    # process, touches the shared-memory arena's pages for the first time; a later run of 3
    # steps may reuse pages an earlier one left resident and add none (never below 0, by
    # construction); every rank reports it, in bytes (under 1 GiB for this 0.3 MiB model)
    growth = {run: [m["rss_peak_growth"] for m in mem] for run, mem in memory.items()}
    if growth["ddp"][0] is not None:  # Linux /proc
        assert all(g > full for g in growth["ddp"]), growth
        assert all(g is not None and g < 2 ** 30 for gs in growth.values() for g in gs), growth
    # every rank gathered the same memory table
    assert rets[1]["fsdp"]["memory"] == memory["fsdp"]


FOUR_RANK_RUNS = {
    "dp_tp": dict(parallel="dp_tp", steps=2),
    "dp_pp": dict(parallel="dp_pp", steps=2, pp_schedule="1f1b", microbatches=2),
}
FOUR_RANK_REFERENCES = {0: [("ref16", dict(batch_size=16, steps=2))]}


@pytest.mark.slow  # 4 ranks on 2 cores: 25 s at load average 5-9, 50 s at 24
def test_hybrids_match_single_process_on_four_ranks():
    rets = spawn_run(parallel_worker, 4, args=(FOUR_RANK_RUNS, FOUR_RANK_REFERENCES), timeout_s=240,
                     pg_timeout_s=90, env={"OMP_NUM_THREADS": "1"}).check().returns
    ref = _collect(rets, 4)["ref16"]
    problems = _check_matches(rets, 4, "dp_tp", ref, False) + _check_matches(rets, 4, "dp_pp", ref, False)
    assert not problems, "\n".join(problems)
    full = ref["params"].numel() * 4
    for run in ("dp_tp", "dp_pp"):
        mem = rets[0][run]["memory"]
        assert all(m["params"] < 0.4 * full for m in mem), (run, mem)


# -- errors --------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(parallel="zero"), "parallel must be one of ddp, fsdp, tp, pp, dp_tp, dp_pp"),
    (dict(parallel="fsdp", strategy="local_sgd"), "parallel fsdp trains synchronously: strategy must be sync"),
    (dict(parallel="tp", hook="fp16"), "parallel tp has no DDP comm hook"),
    (dict(parallel="tp", task="tinylm"), "tinylm's fused attention projection cannot be split"),
    (dict(parallel="pp", task="digits-logreg"), "parallel pp can cut the models of tasks"),
    (dict(parallel="pp", accum_steps=2), "use microbatches, not accum_steps"),
    (dict(parallel="pp", microbatches=3), "microbatches (3) must be at least 1 and divide batch_size (8)"),
    (dict(microbatches=2), "microbatches and pp_schedule apply to parallel pp and dp_pp"),
    (dict(parallel="pp", pp_schedule="interleaved"), "pp_schedule must be one of gpipe, 1f1b"),
    (dict(parallel="fsdp", checkpoint_dir="ckpt"), "parallel fsdp does not support checkpoint_dir"),
    (dict(parallel="fsdp", clip_grad_norm=1.0), "parallel fsdp does not support clip_grad_norm"),
    (dict(parallel="dp_pp", precision="bf16"), "parallel dp_pp runs in fp32 on the CPU"),
    (dict(task="digits-mlp", lm_dim=128), "lm_dim and lm_layers size task tinylm-mp"),
])
def test_bad_combinations_are_rejected(changes, message):
    with pytest.raises(ConfigError, match="^pycomm train: ") as info:
        _cfg(**changes)
    assert message in str(info.value)


@pytest.mark.parametrize("changes, world, message", [
    (dict(parallel="dp_tp"), 2, "parallel dp_tp runs on a 2 x 2 mesh: it needs exactly 4 ranks (got 2)"),
    (dict(parallel="dp_pp"), 8, "it needs exactly 4 ranks (got 8)"),
    (dict(parallel="pp"), 3, "3 pipeline stages need lm_layers >= 3 (got 2)"),
    (dict(parallel="tp"), 3, "3-way tensor parallel must divide the 4 heads"),
    (dict(parallel="fsdp"), 1, "parallel fsdp needs at least 2 ranks (got 1)"),
    (dict(parallel="pp", task="digits-mlp"), 4, "digits-mlp has 3 layers with parameters, too few for 4"),
])
def test_world_size_is_checked(changes, world, message):
    with pytest.raises(ValueError, match="^pycomm train: ") as info:
        check_world_size(_cfg(**changes), world)
    assert message in str(info.value)
    check_world_size(_cfg(**changes), {"dp_tp": 4, "dp_pp": 4, "pp": 2, "tp": 2, "fsdp": 2}[changes["parallel"]])


def test_cli_rejects_hybrid_on_two_ranks_before_spawning(capsys):
    code = cli.main(["-n", "2", "--task", "tinylm-mp", "--parallel", "dp_tp", "--no-progress"])
    assert code == 2
    assert "parallel dp_tp runs on a 2 x 2 mesh: it needs exactly 4 ranks (got 2)" in capsys.readouterr().err


# -- the summary line -------------------------------------------------------------------

def _summary(**fields):
    base = {"task": "digits-mlp", "world_size": 2, "steps": 3, "wall_s": 1.0, "bytes_sent": 0,
            "final": {"test_loss": 1.0, "test_accuracy": 0.5}}
    return {**base, **fields}


@pytest.mark.parametrize("changes, shown", [
    (dict(strategy="sync"), "digits-mlp sync (hook allreduce) on 2 ranks"),
    (dict(strategy="sync", hook="fp16"), "digits-mlp sync (hook fp16) on 2 ranks"),
    (dict(strategy="async_ps"), "digits-mlp async_ps on 2 ranks"),
    (dict(strategy="cocoa", task="digits-logreg"), "digits-mlp cocoa on 2 ranks"),
    (dict(strategy="easgd"), "digits-mlp easgd on 2 ranks"),
    (dict(strategy="local_sgd"), "digits-mlp local_sgd on 2 ranks"),
    (dict(strategy="local_sgd", local_sgd_warmup=3), "local_sgd (hook allreduce for 3 warm-up steps) on"),
    (dict(task="tinylm-mp", parallel="pp", pp_schedule="1f1b"), "sync (parallel pp (1f1b, 4 micro-batches))"),
])
def test_summary_names_what_moved_the_gradients(capsys, changes, shown):
    cfg = TrainConfig.from_dict(changes)
    cli._print_summary(_summary(strategy=cfg.strategy, hook=cfg.hook, comm=cli.describe_comm(cfg)))
    assert shown in capsys.readouterr().out


def test_summary_of_hogwild_names_no_hook(capsys):
    # run_hogwild's summary (pycomm/train/hogwild.py) carries hook None and no comm
    cli._print_summary(_summary(strategy="hogwild", hook=None))
    out = capsys.readouterr().out
    assert "digits-mlp hogwild on 2 ranks" in out and "hook" not in out
