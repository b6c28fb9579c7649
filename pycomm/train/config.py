"""Configuration of a training run: one dataclass, filled from defaults, a YAML file and flags.

Precedence: built-in defaults < YAML file (``--config run.yaml``) < command-line flags.
Every key of the YAML file is a field of :class:`TrainConfig` (unknown keys are an error,
so a typo never silently falls back to a default).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

from .base import _PREFIX, ConfigError, strategy_names, strategy_spec
from .straggler import parse_straggler

__all__ = ["TrainConfig", "ConfigError", "load_yaml", "STRATEGIES", "PRECISIONS", "SCHEDULES",
           "OPTIMIZERS"]

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "cosine", "step")
OPTIMIZERS = ("sgd", "adamw")
TOPOLOGIES = ("ring", "exp")
# model parallelism (pycomm/train/parallel.py runs them; checked here, without a process group)
MODES = ("ddp", "fsdp", "tp", "pp", "dp_tp", "dp_pp")
PP_SCHEDULES = ("gpipe", "1f1b")
HYBRID_WORLD_SIZE = 4          # dp_tp / dp_pp: a 2 x 2 mesh
DEFAULT_MICROBATCHES = 4
TP_TASKS = ("tinylm-mp", "digits-mlp")
PP_TASKS = ("tinylm-mp", "digits-mlp", "digits-cnn")


def __getattr__(name: str):
    if name == "STRATEGIES":  # the registered strategies' names (pycomm.train.base)
        return strategy_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; picklable, so it travels to spawned ranks."""

    # what to train
    task: str = "digits-mlp"            # digits-mlp, digits-cnn, digits-logreg, tinylm, tinylm-mp
    dropout: Optional[float] = None      # None: the task's default
    lm_dim: int = 64                     # tinylm-mp: model width
    lm_layers: int = 2                   # tinylm-mp: Transformer blocks
    # model parallelism (pycomm/train/parallel.py): ddp (data parallel, the strategies below),
    # fsdp, tp, pp, dp_tp, dp_pp (the last two: a 2 x 2 DeviceMesh on 4 ranks)
    parallel: str = "ddp"
    microbatches: Optional[int] = None   # pp / dp_pp: micro-batches per step (None: 4)
    pp_schedule: Optional[str] = None    # pp / dp_pp: gpipe or 1f1b (None: gpipe)
    # how ranks communicate
    strategy: str = "sync"               # sync, local_sgd, easgd
    hook: str = "allreduce"              # sync / warm-up comm hook: allreduce, fp16, bf16, topk, quantize, powersgd, torch_powersgd, or pkg.mod:attr
    local_sgd_period: int = 4            # H: average the models every H optimizer steps
    local_sgd_warmup: int = 0            # synchronous steps before local SGD starts
    easgd_period: int = 4                # tau: elastic update every tau steps
    easgd_alpha: Optional[float] = None  # moving rate; None: 0.9 / world_size (beta = 0.9)
    # async_ps (pycomm/train/async_ps.py) and cocoa (pycomm/train/cocoa.py)
    servers: int = 1                     # async_ps: parameter-server ranks (the first ranks)
    max_staleness: int = 0               # async_ps: bound on a gradient's staleness, in versions
    cocoa_gamma: float = 1.0             # cocoa: aggregation parameter (sigma' = gamma * ranks)
    cocoa_lambda: float = 1e-3           # cocoa: L2 regularisation lambda of the objective
    cocoa_local_passes: float = 1.0      # cocoa: local coordinate steps per round, in passes over the partition
    backend: str = "pycomm"
    algorithm: Optional[str] = None      # pycomm all-reduce algorithm (auto, ring, tree, sharded)
    timeout_s: float = 120.0
    # optimisation
    steps: int = 200                     # optimizer steps (ignored when epochs is set)
    epochs: Optional[int] = None
    batch_size: int = 32                 # per rank and micro-step
    accum_steps: int = 1                 # micro-steps per optimizer step (no_sync on all but the last)
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: str = "cosine"
    warmup_steps: int = 0
    clip_grad_norm: Optional[float] = None
    precision: str = "fp32"              # fp32; bf16 (autocast; CPU and CUDA); fp16 (CUDA, grad scaler)
    device: str = "cpu"                  # cpu or cuda (cuda needs a backend that takes CUDA tensors)
    seed: int = 0
    rank_seeds: bool = False             # initialise each rank's model from seed + rank (DDP broadcasts rank 0's)
    # observability
    eval_every: int = 0                  # 0: evaluate only at the end
    log_file: Optional[str] = None       # JSON lines, written by rank 0
    progress: bool = True                # tqdm progress bar on rank 0
    run_name: Optional[str] = None
    # checkpoints
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0            # 0: only at the end (when checkpoint_dir is set)
    resume: Optional[str] = None         # a checkpoint file, a directory, or "auto" (latest in checkpoint_dir)
    # testing the failure path: raise on the last rank at this step (first attempt only)
    fail_at_step: Optional[int] = None
    # gossip (D-PSGD), fedavg, straggler injection (pycomm/train/gossip.py, fedavg.py, straggler.py)
    topology: str = "ring"               # gossip: ring or exp (peers at distance 2^k)
    consensus_every: int = 10            # gossip: consensus distance every K steps (one all-reduce; 0: never)
    local_epochs: int = 1                # fedavg: local epochs per round
    participation: float = 1.0           # fedavg: fraction of ranks that train in a round
    noniid: Optional[float] = None       # fedavg: Dirichlet alpha of a by-label split (None: IID)
    straggler: Optional[str] = None      # RANK:FACTOR: RANK's steps take FACTOR x its compute time

    # -- construction -------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> "TrainConfig":
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"{_PREFIX} unknown key(s) {', '.join(map(repr, unknown))} in {source} "
                              f"(known: {', '.join(sorted(names))})")
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def replace(self, **changes: Any) -> "TrainConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    # -- checks -----------------------------------------------------------------
    def validate(self) -> None:
        def bad(message: str) -> ConfigError:
            return ConfigError(f"{_PREFIX} {message}")

        if self.strategy not in strategy_names():
            raise bad(f"strategy must be one of {', '.join(strategy_names())} (got {self.strategy!r})")
        if self.precision not in PRECISIONS:
            raise bad(f"precision must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")
        if self.schedule not in SCHEDULES:
            raise bad(f"schedule must be one of {', '.join(SCHEDULES)} (got {self.schedule!r})")
        if self.optimizer not in OPTIMIZERS:
            raise bad(f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        if self.device not in ("cpu", "cuda"):
            raise bad(f"device must be cpu or cuda (got {self.device!r})")
        if self.precision == "fp16" and self.device != "cuda":
            raise bad("precision fp16 needs device cuda (on CPU use bf16)")
        for name in ("steps", "batch_size", "accum_steps", "local_sgd_period", "easgd_period"):
            if int(getattr(self, name)) < 1:
                raise bad(f"{name} must be at least 1 (got {getattr(self, name)})")
        for name in ("local_sgd_warmup", "warmup_steps", "eval_every", "checkpoint_every"):
            if int(getattr(self, name)) < 0:
                raise bad(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.epochs is not None and self.epochs < 1:
            raise bad(f"epochs must be at least 1 (got {self.epochs})")
        if self.lr <= 0:
            raise bad(f"lr must be positive (got {self.lr})")
        if self.easgd_alpha is not None and not 0.0 <= self.easgd_alpha <= 1.0:
            raise bad(f"easgd_alpha must be in [0, 1] (got {self.easgd_alpha})")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise bad(f"dropout must be in [0, 1) (got {self.dropout})")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise bad(f"clip_grad_norm must be positive (got {self.clip_grad_norm})")
        if self.timeout_s <= 0:
            raise bad(f"timeout_s must be positive (got {self.timeout_s})")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise bad("checkpoint_every needs checkpoint_dir")
        if self.resume == "auto" and not self.checkpoint_dir:
            raise bad("resume: auto needs checkpoint_dir")
        self._validate_decentralised(bad)
        self._validate_own_trainers(bad)
        check = strategy_spec(self.strategy).validate
        if check is not None:
            check(self, bad)
        validate_parallel(self, bad)

    def _validate_decentralised(self, bad) -> None:
        if self.topology not in TOPOLOGIES:
            raise bad(f"topology must be one of {', '.join(TOPOLOGIES)} (got {self.topology!r})")
        if int(self.consensus_every) < 0:
            raise bad(f"consensus_every must be >= 0 (got {self.consensus_every})")
        if int(self.local_epochs) < 1:
            raise bad(f"local_epochs must be at least 1 (got {self.local_epochs})")
        if not 0.0 < self.participation <= 1.0:
            raise bad(f"participation must be in (0, 1] (got {self.participation})")
        if self.noniid is not None and not 0.0 < self.noniid < float("inf"):
            raise bad(f"noniid (Dirichlet alpha) must be positive (got {self.noniid})")
        if self.strategy != "fedavg" and (self.noniid is not None or self.participation != 1.0):
            raise bad(f"noniid and participation apply to strategy fedavg (got strategy {self.strategy!r})")
        if self.straggler is not None:
            try:
                parse_straggler(self.straggler)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    def _validate_own_trainers(self, bad) -> None:
        """async_ps and cocoa: the knobs, and the trainer features they do not have."""
        if self.servers < 1:
            raise bad(f"servers must be at least 1 (got {self.servers})")
        if self.max_staleness < 0:
            raise bad(f"max_staleness must be >= 0 (got {self.max_staleness})")
        if not 0.0 < self.cocoa_gamma <= 1.0:
            raise bad(f"cocoa_gamma must be in (0, 1] (got {self.cocoa_gamma})")
        if self.cocoa_lambda <= 0:
            raise bad(f"cocoa_lambda must be positive (got {self.cocoa_lambda})")
        if self.cocoa_local_passes <= 0:
            raise bad(f"cocoa_local_passes must be positive (got {self.cocoa_local_passes})")


def check_own_loop(cfg, bad) -> None:
    """What a strategy with a loop of its own (async_ps, cocoa) does not have: checkpoints,
    the failure injection, a device other than the CPU."""
    for name, unsupported in (("checkpoint_dir", cfg.checkpoint_dir), ("resume", cfg.resume),
                              ("fail_at_step", cfg.fail_at_step)):
        if unsupported:
            raise bad(f"strategy {cfg.strategy} does not support {name} (it keeps no checkpoints)")
    if cfg.device != "cpu":
        raise bad(f"strategy {cfg.strategy} runs on the CPU only (got device {cfg.device!r})")


def validate_parallel(cfg, bad) -> None:
    """The checks of ``--parallel`` that need no process group (``bad(msg)`` makes the error)."""
    from .tasks import LM_DIM, LM_LAYERS

    if cfg.parallel not in MODES:
        raise bad(f"parallel must be one of {', '.join(MODES)} (got {cfg.parallel!r})")
    if cfg.task != "tinylm-mp" and (cfg.lm_dim != LM_DIM or cfg.lm_layers != LM_LAYERS):
        raise bad(f"lm_dim and lm_layers size task tinylm-mp (got task {cfg.task!r})")
    if cfg.lm_dim < 4 or cfg.lm_dim % 4 or cfg.lm_layers < 1:
        raise bad(f"lm_dim must be a positive multiple of 4 (4 heads) and lm_layers at least 1 "
                  f"(got {cfg.lm_dim}, {cfg.lm_layers})")
    pipeline = cfg.parallel in ("pp", "dp_pp")
    if cfg.pp_schedule is not None and cfg.pp_schedule not in PP_SCHEDULES:
        raise bad(f"pp_schedule must be one of {', '.join(PP_SCHEDULES)} (got {cfg.pp_schedule!r})")
    if not pipeline and (cfg.microbatches is not None or cfg.pp_schedule is not None):
        raise bad(f"microbatches and pp_schedule apply to parallel pp and dp_pp (got parallel {cfg.parallel!r})")
    if cfg.parallel == "ddp":
        return
    mode = f"parallel {cfg.parallel}"
    if cfg.strategy != "sync":
        raise bad(f"{mode} trains synchronously: strategy must be sync (got {cfg.strategy!r}); the other "
                  f"strategies are data-parallel, with parallel ddp")
    if cfg.hook != "allreduce":
        raise bad(f"{mode} has no DDP comm hook (gradients are reduced by the engine), so hook must be left "
                  f"at allreduce (got {cfg.hook!r})")
    for name, value in (("checkpoint_dir", cfg.checkpoint_dir), ("resume", cfg.resume),
                        ("clip_grad_norm", cfg.clip_grad_norm), ("rank_seeds", cfg.rank_seeds)):
        if value:
            raise bad(f"{mode} does not support {name} (only parallel ddp does)")
    if cfg.precision != "fp32" or cfg.device != "cpu":
        raise bad(f"{mode} runs in fp32 on the CPU (got precision {cfg.precision!r}, device {cfg.device!r})")
    if cfg.parallel in ("tp", "dp_tp") and cfg.task not in TP_TASKS:
        raise bad(f"{mode} has tensor-parallel plans for tasks {', '.join(TP_TASKS)} (got {cfg.task!r}; "
                  f"tinylm's fused attention projection cannot be split: use tinylm-mp)")
    if pipeline:
        if cfg.task not in PP_TASKS:
            raise bad(f"{mode} can cut the models of tasks {', '.join(PP_TASKS)} (got {cfg.task!r})")
        if cfg.accum_steps != 1:
            raise bad(f"{mode} accumulates over micro-batches: use microbatches, not accum_steps")
        micro = cfg.microbatches if cfg.microbatches is not None else DEFAULT_MICROBATCHES
        if micro < 1 or cfg.batch_size % micro:
            raise bad(f"microbatches ({micro}) must be at least 1 and divide batch_size ({cfg.batch_size})")


def load_yaml(path: str) -> Dict[str, Any]:
    """The mapping stored in a YAML file (keys as in :class:`TrainConfig`)."""
    import yaml

    try:
        with open(path) as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"{_PREFIX} cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_PREFIX} {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_PREFIX} {path} must hold a mapping of settings, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
