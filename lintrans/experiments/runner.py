"""Train one small model per attention kind on a synthetic task and evaluate it on a held-out set.

Every kind starts from the same seed and sees the same training batches, so the curves differ only
by the attention mechanism. Evaluation data is drawn from a different seed than training data.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from lintrans.models.config import GPTConfig
from lintrans.models.gpt import GPT
from lintrans.ops._validate import check_positive_int

from .models import VectorGPT, parse_attention
from .tasks import least_squares_errors, recall_batch, regression_batch, regression_tokens

TASKS = ("regression", "recall")


@dataclass
class ExperimentConfig:
    task: str
    attention: list = field(default_factory=lambda: ["softmax", "linear:elu"])
    steps: int = 500
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    eval_batch: int = 512
    n_layer: int = 2
    n_head: int = 4  # head size 16: the based feature map then has 273 features, not 1057
    n_embd: int = 64
    device: str = "cpu"
    # regression: vector dimension n and points per sequence (the last is a query with P - 1 examples)
    dim: int = 2  # small enough to be learned in minutes on a CPU (Garg et al. use 20)
    points: int = 9
    # recall: key-value pairs, queries, and how many key and value ids exist
    pairs: int = 8
    queries: int = 8
    keys: int = 32
    values: int = 32

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {self.task!r}")
        if not isinstance(self.attention, (list, tuple)) or not self.attention:
            raise ValueError(f"attention must be a non-empty list of specs, got {self.attention!r}")
        if len(set(self.attention)) != len(self.attention):
            raise ValueError(f"attention specs must be distinct, got {list(self.attention)}")
        for spec in self.attention:
            parse_attention(spec)
        for name in ("steps", "batch_size", "eval_batch", "n_layer", "n_head", "n_embd",
                     "dim", "points", "pairs", "queries", "keys", "values"):
            check_positive_int(name, getattr(self, name))
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < 1:
            raise ValueError(f"lr must be a number in (0, 1), got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.task == "recall":
            if self.pairs > self.keys:
                raise ValueError(f"pairs ({self.pairs}) must be <= keys ({self.keys}): keys in a sequence are distinct")
            if self.queries > self.pairs:
                raise ValueError(f"queries ({self.queries}) must be <= pairs ({self.pairs})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RegressionTask:
    """Predict y at every x; loss and error are squared error divided by n (1.0 = predicting 0)."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.seq_len = 2 * cfg.points - 1

    def build(self, config: GPTConfig) -> torch.nn.Module:
        return VectorGPT(config, in_dim=self.cfg.dim)

    def vocab_size(self) -> int:
        return 1

    def batch(self, n: int, generator: torch.Generator):
        xs, ys, _ = regression_batch(n, self.cfg.points, self.cfg.dim, generator)
        return xs.to(self.cfg.device), ys.to(self.cfg.device)

    def _errors(self, model, data) -> torch.Tensor:
        xs, ys = data
        pred = model(regression_tokens(xs, ys))[:, ::2, 0]  # [B,P] read at x positions
        return (pred - ys) ** 2 / self.cfg.dim

    def loss(self, model, data) -> torch.Tensor:
        return self._errors(model, data).mean()

    def evaluate(self, model, data) -> dict:
        by_k = self._errors(model, data).mean(0).tolist()
        return {"loss": sum(by_k) / len(by_k), "error_by_examples": by_k}

    def baselines(self, data) -> dict:
        xs, ys = (t.cpu() for t in data)
        n = self.cfg.dim
        return {
            "least_squares": (least_squares_errors(xs, ys) / n).mean(0).tolist(),
            "zero": (ys.double() ** 2 / n).mean(0).tolist(),
        }


class RecallTask:
    """MQAR with the GPT's token model: cross-entropy and accuracy at query keys only."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.seq_len = 2 * (cfg.pairs + cfg.queries)

    def build(self, config: GPTConfig) -> torch.nn.Module:
        return GPT(config)

    def vocab_size(self) -> int:
        return self.cfg.keys + self.cfg.values

    def batch(self, n: int, generator: torch.Generator):
        c = self.cfg
        return tuple(t.to(c.device) for t in recall_batch(n, c.pairs, c.queries, c.keys, c.values, generator))

    def loss(self, model, data) -> torch.Tensor:
        return model(*data)[1]

    def evaluate(self, model, data) -> dict:
        idx, targets = data
        logits, loss = model(idx, targets)
        asked = targets >= 0
        correct = (logits.argmax(-1) == targets)[asked]
        return {"loss": loss.item(), "accuracy": correct.float().mean().item()}

    def baselines(self, data) -> dict:
        return {"chance_accuracy": 1.0 / self.cfg.values}


def _lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 5% of the steps, then cosine down to 10% of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def run_experiment(cfg: ExperimentConfig, on_step: Optional[Callable[[str, int, float], None]] = None) -> dict:
    """Train and evaluate every attention kind in ``cfg.attention``; returns a JSON-ready dict."""
    task = (RegressionTask if cfg.task == "regression" else RecallTask)(cfg)
    configs = {}
    for spec in cfg.attention:  # build every config first so a bad spec fails before any training
        name, options = parse_attention(spec)
        if name == "linear":  # same function; the quadratic form is the fastest at these short lengths
            options.setdefault("form", "attention")
        configs[spec] = GPTConfig(
            n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=task.seq_len,
            vocab_size=task.vocab_size(), dropout=0.0, attention=name, attention_options=options,
        )
    eval_data = task.batch(cfg.eval_batch, torch.Generator().manual_seed(cfg.seed + 1))
    runs = []
    for spec, config in configs.items():
        torch.manual_seed(cfg.seed)
        model = task.build(config).to(cfg.device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.steps))
        generator = torch.Generator().manual_seed(cfg.seed)
        losses = []
        t0 = time.perf_counter()
        model.train()
        for step in range(cfg.steps):
            loss = task.loss(model, task.batch(cfg.batch_size, generator))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(spec, step, losses[-1])
        train_s = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            metrics = task.evaluate(model, eval_data)
        runs.append({
            "attention": spec, "gpt_config": config.to_dict(),
            "params": sum(p.numel() for p in model.parameters()),
            "train_seconds": train_s, "train_loss": losses, "eval": metrics,
        })
    return {"task": cfg.task, "config": cfg.to_dict(), "runs": runs, "baselines": task.baselines(eval_data)}


def smooth(values: list, window: int) -> list:
    """Trailing mean over ``window`` values (for readable learning curves)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
