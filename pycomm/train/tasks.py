"""Built-in tasks that need no download.

A task is data (in-memory tensors, identical on every rank) plus a model factory, a
loss and a metric:

* ``digits-mlp`` / ``digits-cnn``: scikit-learn's 8x8 handwritten digits (1797 images,
  10 classes; shipped inside scikit-learn), a fixed 1500 / 297 train / test split.
* ``tinylm``: a character-level Transformer language model on English-like text
  generated from a small grammar with a fixed seed (:func:`generate_text`); the
  metric is next-character accuracy.
* ``tinylm-mp``: the same data and the same kind of model, written for model
  parallelism (:class:`SplitTransformerLM`: separate q / k / v / out projections and MLP
  Linear layers that tensor-parallel plans can name, and blocks that a pipeline can
  cut between). Its numerics differ from ``tinylm``'s (another initialisation and
  parameter layout), which stays as it was.

Tasks are deterministic: every rank builds the same data from the same seed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import random
from typing import Callable, Dict, Optional

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Task", "BinaryTask", "TASKS", "get_task", "generate_text", "TinyTransformerLM", "SplitTransformerLM",
           "LM_DIM", "LM_LAYERS"]

from .base import _PREFIX
_DATA_SEED = 1234  # the train/test split and the generated text never depend on the run's seed


@dataclasses.dataclass
class Task:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    make_model: Callable[[int], nn.Module]   # seed -> model
    metric: str = "accuracy"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (per sample for the classifiers, per position for the LM)."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    @torch.no_grad()
    def score(self, output: torch.Tensor, target: torch.Tensor) -> "tuple[float, float, int]":
        """(summed loss, number correct, number of predictions) of one batch."""
        logits = output.reshape(-1, output.shape[-1]).float()
        target = target.reshape(-1)
        loss = F.cross_entropy(logits, target, reduction="sum").item()
        correct = (logits.argmax(dim=1) == target).sum().item()
        return loss, correct, target.numel()


# ---------------------------------------------------------------------------
# digits
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _digits_arrays():
    """(images, labels) of scikit-learn's digits. Read straight from the CSV that ships inside
    scikit-learn when it is there (importing sklearn costs seconds per rank), else load_digits()."""
    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            table = np.loadtxt(path, delimiter=",", dtype=np.float32)
            return torch.from_numpy(table[:, :-1].copy()), torch.from_numpy(table[:, -1].astype(np.int64))
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError(f"{_PREFIX} the digits tasks need scikit-learn (pip install scikit-learn)") from None
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target, dtype=torch.int64)


def _digits(test_size: int = 297):
    images, labels = _digits_arrays()
    x = images / 16.0
    y = labels.clone()
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(_DATA_SEED))
    x, y = x[order], y[order]
    x = (x - 0.3) / 0.4  # roughly zero mean, unit scale
    return x[test_size:], y[test_size:], x[:test_size], y[:test_size]


def _digits_mlp(dropout: float) -> Task:
    x_train, y_train, x_test, y_test = _digits()

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(128, 64), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(64, 10),
        )

    return Task("digits-mlp", x_train, y_train, x_test, y_test, make_model)


def _digits_cnn(dropout: float) -> Task:
    x_train, y_train, x_test, y_test = _digits()
    x_train, x_test = x_train.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )

    return Task("digits-cnn", x_train, y_train, x_test, y_test, make_model)


class BinaryTask(Task):
    """Labels +1 / -1 and one output per sample: the logistic loss log(1 + exp(-y f(x)))."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.softplus(-target.reshape(-1) * output.reshape(-1).float()).mean()

    @torch.no_grad()
    def score(self, output: torch.Tensor, target: torch.Tensor) -> "tuple[float, float, int]":
        margin = target.reshape(-1) * output.reshape(-1).float()
        return F.softplus(-margin).sum().item(), (margin > 0).sum().item(), target.numel()


def _digits_logreg(dropout: float) -> Task:
    """Binary digits: 0-4 (label -1) against 5-9 (label +1); the features get a constant 1
    appended, so a bias-free linear model has a (regularised) intercept. The convex task of
    ``--strategy cocoa``; any other strategy trains it as well."""
    x_train, y_train, x_test, y_test = _digits()
    ones = torch.ones

    def features(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, ones(x.shape[0], 1)], dim=1)

    def labels(y: torch.Tensor) -> torch.Tensor:
        return torch.where(y >= 5, 1.0, -1.0)

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Linear(65, 1, bias=False)
        nn.init.zeros_(model.weight)
        return model

    return BinaryTask("digits-logreg", features(x_train), labels(y_train), features(x_test), labels(y_test),
                      make_model)


# ---------------------------------------------------------------------------
# tiny language model
# ---------------------------------------------------------------------------

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher",
             "her brother", "the robot", "a farmer", "the children"]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "remembers", "builds"]
_OBJECTS = ["a red ball", "the river", "an apple", "the green door", "a long letter",
            "the quiet town", "some bread", "a wooden box", "the blue sky"]
_ENDINGS = ["today", "at night", "in the morning", "with care", "again", "slowly", "near the house"]


def generate_text(chars: int = 60000, seed: int = _DATA_SEED) -> str:
    """Deterministic English-like text from a small grammar (subject verb object [ending])."""
    rng = random.Random(seed)
    parts, total = [], 0
    while total < chars:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            sentence += " " + rng.choice(_ENDINGS)
        sentence += ". " if rng.random() < 0.8 else ", and "
        parts.append(sentence)
        total += len(sentence)
    return "".join(parts)[:chars]


class TinyTransformerLM(nn.Module):
    """Decoder-only character model: embeddings + pre-norm Transformer layers with a causal mask."""

    def __init__(self, vocab: int, block: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(block, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        nn.init.normal_(self.position, std=0.02)
        # The causal mask is made in forward, not kept as a buffer: DDP (broadcast_buffers=True,
        # its default) would send a buffer from rank 0 to every rank at every step
        # (block x block float32: 4 KiB for 32 characters, more than top-k 1%'s gradient pairs).

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written while the mask was a buffer carry it under "mask": a constant,
        # dropped here, so they still load with strict=True.
        state_dict.pop(prefix + "mask", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.token(tokens) + self.position[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.layers(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


LM_DIM = 64      # tinylm-mp's default width (tinylm's, fixed)
LM_LAYERS = 2    # tinylm-mp's default depth (tinylm's, fixed)


class _SplitAttention(nn.Module):
    """Causal multi-head self-attention with separate q / k / v / out Linear layers.

    The head count is taken from the width of q's output, so the same code runs on a
    tensor-parallel shard (q, k, v column-split: each rank holds whole heads)."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.head_dim = dim // heads
        self.dropout = dropout
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class _SplitMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)))


class _SplitBlock(nn.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _SplitAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _SplitMLP(dim, 2 * dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class _Embed(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int):
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(block, dim))
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token(tokens) + self.position[: tokens.shape[1]]


class _Output(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class SplitTransformerLM(nn.Module):
    """The model of ``tinylm-mp``: a decoder-only character model like :class:`TinyTransformerLM`
    (pre-norm blocks, causal attention, MLP of twice the width), built from named parts that
    model parallelism can address: ``embed``, ``blocks[i].attn.{q,k,v,out}``,
    ``blocks[i].mlp.{fc,proj}``, ``output``. :meth:`pipeline_stages` cuts it between blocks."""

    def __init__(self, vocab: int, block: int, dim: int = LM_DIM, heads: int = 4, layers: int = LM_LAYERS,
                 dropout: float = 0.1):
        super().__init__()
        self.embed = _Embed(vocab, block, dim)
        self.blocks = nn.ModuleList(_SplitBlock(dim, heads, dropout) for _ in range(layers))
        self.output = _Output(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.output(hidden)

    def pipeline_stages(self, count: int) -> "list[nn.Module]":
        """``count`` consecutive pieces (embed + first blocks, ..., last blocks + output) whose
        composition is this model; they share its parameter objects. Needs count <= layers."""
        layers = len(self.blocks)
        if not 1 <= count <= layers:
            raise ValueError(f"{_PREFIX} a pipeline of {count} stages needs at least {count} blocks "
                             f"(the model has {layers}; raise --lm-layers)")
        bounds = [layers * i // count for i in range(count + 1)]
        stages = []
        for i in range(count):
            parts = [self.embed] if i == 0 else []
            parts += list(self.blocks[bounds[i]: bounds[i + 1]])
            if i == count - 1:
                parts.append(self.output)
            stages.append(nn.Sequential(*parts))
        return stages


def _tinylm_data(block: int):
    text = generate_text()
    vocab = sorted(set(text))
    codes = torch.tensor([vocab.index(c) for c in text], dtype=torch.int64)
    windows = codes[: (codes.numel() - 1) // block * block + 1]
    count = (windows.numel() - 1) // block
    x = windows[:-1].reshape(count, block)
    y = windows[1:].reshape(count, block)
    test = max(1, count // 10)
    return len(vocab), x[test:], y[test:], x[:test], y[:test]


def _tinylm_mp(dropout: float, block: int = 32, dim: int = LM_DIM, layers: int = LM_LAYERS) -> Task:
    vocab, x_train, y_train, x_test, y_test = _tinylm_data(block)

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return SplitTransformerLM(vocab, block, dim=dim, layers=layers, dropout=dropout)

    return Task("tinylm-mp", x_train, y_train, x_test, y_test, make_model, metric="next-char accuracy")


def _tinylm(dropout: float, block: int = 32) -> Task:
    vocab, x_train, y_train, x_test, y_test = _tinylm_data(block)

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TinyTransformerLM(vocab, block, dropout=dropout)

    return Task("tinylm", x_train, y_train, x_test, y_test, make_model, metric="next-char accuracy")


_FACTORIES: Dict[str, "tuple[Callable[[float], Task], float]"] = {
    "digits-mlp": (_digits_mlp, 0.0),
    "digits-cnn": (_digits_cnn, 0.0),
    "digits-logreg": (_digits_logreg, 0.0),
    "tinylm": (_tinylm, 0.1),
    "tinylm-mp": (_tinylm_mp, 0.1),
}
TASKS = tuple(_FACTORIES)


def get_task(name: str, dropout: Optional[float] = None, lm_dim: int = LM_DIM, lm_layers: int = LM_LAYERS) -> Task:
    """Build the task ``name`` (one of :data:`TASKS`); ``dropout=None`` uses its default.
    ``lm_dim`` / ``lm_layers``: width and depth of ``tinylm-mp``'s model (only)."""
    if name not in _FACTORIES:
        raise ValueError(f"{_PREFIX} unknown task {name!r} (choose from {', '.join(TASKS)})")
    factory, default_dropout = _FACTORIES[name]
    dropout = default_dropout if dropout is None else float(dropout)
    if name == "tinylm-mp":
        task = factory(dropout, dim=int(lm_dim), layers=int(lm_layers))
    else:
        task = factory(dropout)
    assert math.isfinite(float(task.x_train.float().sum()))
    return task
