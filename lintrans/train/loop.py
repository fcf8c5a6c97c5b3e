"""The training loop behind ``lintrans train``: resumable, DDP-aware, stops cleanly on signals and NaNs."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lintrans._io import FileLock, atomic_write_text

from . import checkpoint as ckpt
from .config import TrainConfig, check_context_parallel, check_fsdp, padded_vocab, write_resolved
from .data import TokenData, WindowSampler, batch_layout, cache_folder, get_batch, prepare_data, resolve_source
from .distributed import (
    DistInfo, all_mean, any_flag, barrier, full_state_dicts, full_value, gather_objects, init_distributed, is_sharded,
    load_sharded_optimizer, local_tensor, no_gradient_sync, parallelize, peak_memory_bytes, shutdown,
)
from .precision import autocast, grad_scaler, resolve_precision
from .tokenizer import get_tokenizer

EXIT_NONFINITE = 1


@dataclass
class TrainResult:
    out_dir: Path
    step: int  # optimizer steps completed in total
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss, this invocation
    val_losses: dict[int, float] = field(default_factory=dict)
    stopped: str = "done"  # done | stop_after | signal | nonfinite | already_done (nothing was trained)
    exit_code: int = 0
    peak_memory: list[int] = field(default_factory=list)  # bytes, per process (peak_memory_bytes)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine/linear decay to min_lr at decay_steps (or constant)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    decay = o.decay_steps or cfg.train.max_steps
    if step >= decay:
        return o.min_lr
    ratio = (step - o.warmup_steps) / max(1, decay - o.warmup_steps)
    coeff = 0.5 * (1 + math.cos(math.pi * ratio)) if o.schedule == "cosine" else 1 - ratio
    return o.min_lr + coeff * (o.lr - o.min_lr)


def _exempt_from_decay(model: torch.nn.Module) -> set:
    """ids of the parameters a module names in its ``no_weight_decay`` (biases and norm gains that are
    2-D because they are stacked per head, as in ReBased and Hedgehog)."""
    return {id(p) for m in model.modules() for name in getattr(m, "no_weight_decay", ())
            if isinstance(p := getattr(m, name, None), torch.nn.Parameter)}


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                    exempt: bool = True) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings, linear weights, AFT's position biases) and none
    on biases and norm gains, also where those are stacked per head (``exempt=False``: by dimension
    only, as checkpoints before that was fixed grouped them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    skip = _exempt_from_decay(model) if exempt else set()
    decay = [p.dim() >= 2 and id(p) not in skip for p in params]
    groups = [
        {"params": [p for p, d in zip(params, decay) if d], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        fused=device.type == "cuda" or None,
    )


class MetricsLog:
    """metrics.jsonl (source of truth) and metrics.csv; on resume, rows after the checkpoint are dropped."""

    COLUMNS = ("step", "tokens", "lr", "loss", "grad_norm", "val_loss", "time_s")

    def __init__(self, out_dir: Path, start_step: int, say=print):
        self.jsonl, self.csv = out_dir / "metrics.jsonl", out_dir / "metrics.csv"
        rows = []
        if self.jsonl.is_file() and start_step > 0:
            rows = self._read(self.jsonl, say)
            rows = [r for r in rows if r["step"] <= start_step]
        self.rows = rows
        # rewritten atomically: a kill here keeps the old history rather than half of it
        atomic_write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in rows))
        atomic_write_text(self.csv, ",".join(self.COLUMNS) + "\n" + "".join(self._csv_line(r) for r in rows))
        log = out_dir / "train.log"  # its evaluation lines after the checkpoint go too: they are trained again
        if log.is_file():
            lines = log.read_text().splitlines(keepends=True)
            kept = [ln for ln in lines if not ((m := re.match(r"step (\d+)/", ln)) and int(m.group(1)) > start_step)]
            if len(kept) != len(lines):
                atomic_write_text(log, "".join(kept))

    @staticmethod
    def _read(path: Path, say) -> list:
        """The rows of metrics.jsonl; a line a crash cut short (the last one, appended when the process
        died) is left out with a note, not a failed resume."""
        rows, bad = [], 0
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:
                row = None
                bad += 1
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        if bad:
            say(f"resume: left out {bad} unreadable line(s) of {path} (cut short by a crash?)")
        return rows

    def _csv_line(self, row: dict) -> str:
        return ",".join("" if row.get(c) is None else f"{row[c]:.6g}" if isinstance(row[c], float) else str(row[c])
                        for c in self.COLUMNS) + "\n"

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.csv, "a") as f:
            f.write(self._csv_line(row))

    def plot(self, path: Path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [(r["step"], r["loss"]) for r in self.rows if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in self.rows if r.get("val_loss") is not None]
        if not train:
            return
        fig, ax = plt.subplots(figsize=(7, 4.2))
        s, l = np.array(train).T
        ax.plot(s, l, lw=0.8, alpha=0.35, color="C0", label="train (per step)")
        if len(l) >= 10:
            k = max(2, len(l) // 25)
            ax.plot(s[k - 1:], np.convolve(l, np.ones(k) / k, mode="valid"), color="C0", label=f"train ({k}-step mean)")
        if val:
            vs, vl = np.array(val).T
            ax.plot(vs, vl, "o-", color="C1", ms=3, label="validation")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy loss (nats/token)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = path.with_name(path.stem + ".tmp.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        tmp.replace(path)


class _StopSignal:
    """SIGTERM/SIGINT set a flag checked after each step; a second SIGINT aborts at once."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _check_resume(path: Path, saved: dict, cfg: TrainConfig, gpt_dict: dict) -> None:
    """A checkpoint made with another model, tokenizer or data would silently train the wrong thing."""
    diffs = [f"model.{k}: {saved['config']['model'].get(k)!r} in checkpoint, {v!r} now"
             for k, v in gpt_dict.items() if saved["config"].get("model", {}).get(k) != v]
    old_data = saved["train_config"].get("data", {})
    diffs += [f"data.{k}: {old_data.get(k)!r} in checkpoint, {getattr(cfg.data, k)!r} now"
              for k in ("source", "tokenizer", "val_fraction", "bin_dtype") if old_data.get(k) != getattr(cfg.data, k)
              and not (k == "source" and _same_path(old_data.get(k), cfg.data.source))]
    # the content of the same source is checked once it is read (load_data): a file may have changed
    if cfg.data.source.startswith("hf:"):  # which split and column are the text (keys older checkpoints lack)
        diffs += [f"data.{k}: {old_data[k]!r} in checkpoint, {getattr(cfg.data, k)!r} now"
                  for k in ("hf_split", "hf_text_column") if k in old_data and old_data[k] != getattr(cfg.data, k)]
    if diffs:
        raise ValueError(
            f"checkpoint {path} does not match this config ({'; '.join(diffs)}); to continue that run, pass "
            f"--config {path.parent / 'config.yaml'} (the config it was started with); for a new run, a new "
            "train.out_dir"
        )


def _same_path(old, new) -> bool:
    """Whether two data.source specs name one local file or folder (``./a.txt`` and ``a.txt``)."""
    if not isinstance(old, str) or ":" in old.split("/")[0] or ":" in new.split("/")[0]:  # builtin:, hf:
        return False
    return Path(old).resolve() == Path(new).resolve()


# keys a resumed run may change on purpose (a longer run, another schedule), but never silently
RESUME_NOTED = {"optim": ("lr", "min_lr", "warmup_steps", "decay_steps", "schedule"),
                "train": ("max_steps", "batch_size", "tokens_per_update", "micro_batch_size", "seed")}


def _resume_changes(saved: dict, cfg: TrainConfig, total: int, block: int) -> list[str]:
    """What the config changes against the checkpoint's in the keys of RESUME_NOTED: the learning-rate
    schedule follows the new keys from the resumed step on, a new batch draws another number of windows
    per update, and a new seed or global batch (``total`` sequences of ``block`` tokens now) picks other
    evaluation windows (the training stream's state is restored)."""
    lines = []
    for section, keys in RESUME_NOTED.items():
        old = saved["train_config"].get(section, {})
        for k in keys:
            new = getattr(getattr(cfg, section), k)
            if k in old and old[k] != new:
                lines.append(f"resume: {section}.{k} changed from {old[k]!r} in the checkpoint to {new!r}; using {new!r}")
    then = saved["train_config"].get("train", {})
    then_total = (batch_layout(then.get("tokens_per_update"), then.get("batch_size"), None, block, 1)[0]
                  if then.get("tokens_per_update") or then.get("batch_size") else None)
    if then.get("seed", cfg.train.seed) != cfg.train.seed or then_total not in (None, total):
        lines.append(f"resume: val_loss from step {saved['trainer_state']['step']} on is measured on other validation "
                     "windows (train.eval_batches global batches, drawn from train.seed)")
    return lines


def _apply_optim_config(optimizer: torch.optim.AdamW, cfg: TrainConfig) -> list[str]:
    """Loading an optimizer state restores the hyper-parameters it was saved with; the run's config
    is what the run folder records, so apply it and say what changed."""
    o = cfg.optim
    wanted = {"betas": (o.beta1, o.beta2), "eps": o.eps}
    changed = []
    for i, group in enumerate(optimizer.param_groups):
        decay = o.weight_decay if i == 0 else 0.0  # group 0 holds the matrices (build_optimizer)
        for key, value in {**wanted, "weight_decay": decay}.items():
            old = tuple(group[key]) if key == "betas" else group[key]
            if old != value:
                name = {"betas": "beta1/beta2", "eps": "eps", "weight_decay": "weight_decay"}[key]
                changed.append(f"resume: optim.{name} changed from {old} in the checkpoint to {value}; using {value}")
                group[key] = value
    return list(dict.fromkeys(changed))


def _initial_model(cfg: TrainConfig, tokenizer, say):
    """The model of ``train.init_from`` with the weight-preserving model keys of the config applied
    (e.g. ``model.attention=linear`` linearises it, as ``from_pretrained(..., attention=...)`` does)."""
    import warnings

    from lintrans.models.hf import WEIGHT_PRESERVING, AttentionSwapWarning, from_pretrained, trained_tokenizer

    theirs = trained_tokenizer(cfg.train.init_from)  # from their config.json: before the weights are read
    if theirs is not None and theirs != tokenizer.name:  # its embeddings would read another tokenizer's ids
        raise ValueError(f"train.init_from {cfg.train.init_from} was trained with the {theirs} tokenizer, "
                         f"data.tokenizer is {tokenizer.name!r}: set data.tokenizer={theirs}")
    overrides = {k: v for k, v in cfg.model.items() if k in WEIGHT_PRESERVING}
    ignored = sorted(k for k in cfg.model if k not in WEIGHT_PRESERVING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = from_pretrained(cfg.train.init_from, **overrides)
        except FileNotFoundError as e:  # say which setting named it
            raise FileNotFoundError(f"train.init_from: {e}") from None
    trained_with = None
    for w in caught:
        # the swap warning tells a sampler to fine-tune; this run is that fine-tuning, so it is news only
        if isinstance(w.message, AttentionSwapWarning):
            trained_with = w.message.trained_with
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if ignored:
        say(f"train.init_from: the model's shape comes from {cfg.train.init_from}; the config's "
            f"{['model.' + k for k in ignored]} are not used (only {list(WEIGHT_PRESERVING)} apply)")
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"train.init_from {cfg.train.init_from} has {model.config.vocab_size} tokens, fewer than "
                         f"the {tokenizer.name} tokenizer's {tokenizer.vocab_size}: set data.tokenizer to its own")
    if theirs is None and model.config.vocab_size >= 2 * tokenizer.vocab_size + 64:
        # far more rows than the tokenizer has ids (beyond the padding to a multiple of 64): weights
        # whose own tokenizer is unknown, likely another one's
        say(f"train.init_from {cfg.train.init_from} has {model.config.vocab_size} token rows, the {tokenizer.name} "
            f"tokenizer uses {tokenizer.vocab_size}: if the weights were trained with another tokenizer, set "
            "data.tokenizer to it")
    swap = f" (they were trained with {trained_with} attention: this run fine-tunes them for it)" if trained_with else ""
    say(f"initial weights from {cfg.train.init_from}, run with {model.config.attention} attention{swap}")
    return model


LOCK_NAME = ".lock"  # in a run's folder while a run trains there


def _uncreatable(path: Path) -> Optional[str]:
    """Why folder ``path`` could not be made (or written in, if it exists), without making it; None if it can."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the training described by ``cfg``; see docs/training.md."""
    cfg.validate()
    info = init_distributed(cfg.train.device, cfg.train.context_parallel)
    try:
        result = _train(cfg, info)
        barrier(info)  # every process done with its collectives before any tears its connections down
        return result
    finally:
        shutdown(info)


def _train(cfg: TrainConfig, info: DistInfo) -> TrainResult:
    run = _Run(cfg, info)
    try:
        done = run.plan()  # model config, batch layout, resume checks: before any data is read
        if done is not None:
            return done
        run.load_data()
        run.build()
        run.open_logs()
        return run.loop()
    finally:
        run.unlock()


class _Run:
    """One call of ``train``, in nanoGPT's order: plan, data, model and optimizer (or the checkpoint's),
    logs, then the loop of train steps with evaluations and saves."""

    def __init__(self, cfg: TrainConfig, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.out_dir = Path(cfg.train.out_dir)
        self.say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if info.is_main else (lambda *a: None)
        self.step, self.tokens, self.elapsed = 0, 0, 0.0
        self._lock = None

    def lock(self) -> None:
        """Rank 0 holds the run folder's lock for the whole run: a second run on the same folder (a
        relaunch while the first still runs, e.g. workers left by a killed torchrun) would mix its
        metrics and checkpoints with the first's. Collective: every rank calls it, and every rank
        raises when the folder is taken (the others would otherwise wait in their next collective)."""
        holder = None
        if self.info.is_main and self._lock is None and self.out_dir.is_dir():
            lock = FileLock(self.out_dir / LOCK_NAME, blocking=False)
            if lock.acquire():
                self._lock = lock
            else:
                holder = lock.holder()
        holder = gather_objects(self.info, holder)[0]  # rank 0's answer
        if holder is not None:
            raise ValueError(f"train.out_dir {self.out_dir} is in use by another run ({holder}); wait for it to "
                             "finish, stop it, or pick another out_dir")

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- set-up -----------------------------------------------------------------------------

    def plan(self) -> Optional[TrainResult]:
        """Tokenizer, model config, batch layout and the resume checks; a TrainResult if there is
        nothing to train."""
        cfg, info = self.cfg, self.info
        o = cfg.optim
        if o.schedule != "constant" and o.decay_steps is None and o.warmup_steps >= cfg.train.max_steps:
            self.say(f"warning: optim.warmup_steps ({o.warmup_steps}) >= train.max_steps ({cfg.train.max_steps}): "
                     f"the learning rate rises for the whole run (it ends at "
                     f"{lr_at(cfg.train.max_steps - 1, cfg):.3g} of {o.lr:g}) and never decays; set a shorter warm-up")
        self.tokenizer = get_tokenizer(cfg.data.tokenizer)
        if "vocab_size" in cfg.model and cfg.model["vocab_size"] < self.tokenizer.vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model['vocab_size']}) is smaller than the {self.tokenizer.name} tokenizer's "
                f"vocabulary ({self.tokenizer.vocab_size})"
            )
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"train.out_dir {self.out_dir} is a file; it must be a folder (made if missing)")
        if (self.out_dir / "trainer_state.json").is_file():  # a run's checkpoint given for the run
            raise ValueError(f"train.out_dir {self.out_dir} is a checkpoint, not a run's folder; set "
                             f"train.out_dir={self.out_dir.parent} to continue the run it belongs to")
        # what would fail only after the data is tokenised (hours on a large corpus): fails now. The folder
        # itself is made later (open_logs), so that a run stopped before it leaves none behind
        self.precision = resolve_precision(cfg.train.precision, info.device)
        problem = gather_objects(info, _uncreatable(self.out_dir) if info.is_main else None)[0]
        if problem is not None:
            raise ValueError(f"train.out_dir {str(self.out_dir)!r} cannot be created: {problem}")
        self.lock()  # before anything in the folder is read or removed
        if info.is_main:
            for path in ckpt.remove_abandoned(self.out_dir):
                self.say(f"removed {path}: the unfinished save of a run that was killed")
        self.found = ckpt.find_checkpoint(self.out_dir)
        if self.found is not None and cfg.train.resume == "never":
            raise ValueError(f"{self.out_dir} already holds a checkpoint; set train.resume=auto to continue it or "
                             "pick another out_dir")
        if self.found is None and cfg.train.resume == "must":
            raise ValueError(f"train.resume=must but {self.out_dir} holds no checkpoint")
        self.saved = ckpt.read_checkpoint(self.found) if self.found is not None else None
        self.initial = None
        if cfg.train.init_from and self.saved is not None:
            # resuming: the checkpoint's weights replace the initial ones, so those are not read; the
            # model is the checkpoint's, with the config's weight-preserving keys checked against it
            from lintrans.models.config import GPTConfig
            from lintrans.models.hf import WEIGHT_PRESERVING

            self.gpt_config = GPTConfig.from_dict(self.saved["config"]["model"])
            expected = {k: v for k, v in cfg.model.items() if k in WEIGHT_PRESERVING}
        elif cfg.train.init_from:
            torch.manual_seed(cfg.train.seed)  # the parameters an attention swap adds
            self.initial = _initial_model(cfg, self.tokenizer, self.say)
            self.gpt_config = self.initial.config
            expected = self.gpt_config.to_dict()
        else:
            self.gpt_config = cfg.gpt_config(vocab_size=padded_vocab(self.tokenizer.vocab_size))
            expected = self.gpt_config.to_dict()
        self.block = self.gpt_config.block_size
        if cfg.train.init_from:  # the model is the initial weights' or the checkpoint's: check it, not cfg.model
            if cfg.train.context_parallel > 1:
                check_context_parallel(self.gpt_config.attention, self.block, cfg.train.context_parallel)
            if cfg.train.parallel == "fsdp":
                check_fsdp(self.gpt_config)
        self.total, self.micro, self.accum = batch_layout(cfg.train.tokens_per_update, cfg.train.batch_size,
                                                          cfg.train.micro_batch_size, self.block, info.dp_size)
        if self.saved is not None:
            _check_resume(self.found, self.saved, cfg, expected)
            done = self.saved["trainer_state"]["step"]
            if done >= cfg.train.max_steps:
                self.say(f"nothing to train: the checkpoint in {self.found} is at step {done}, "
                         f"{'already at' if done == cfg.train.max_steps else 'past'} "
                         f"train.max_steps={cfg.train.max_steps}. To train further, raise it (e.g. --train.max_steps "
                         f"{2 * done}; the learning-rate schedule then stretches to the new end), or use a new "
                         "train.out_dir.")
                return TrainResult(self.out_dir, done, stopped="already_done")
        return None

    def load_data(self) -> None:
        cfg, info = self.cfg, self.info
        source = resolve_source(cfg.data.source, bin_dtype=cfg.data.bin_dtype, hf_split=cfg.data.hf_split,
                                hf_column=cfg.data.hf_text_column,
                                exclude=(cache_folder(cfg.data.cache_dir), self.out_dir))
        data: TokenData | None = None
        if info.is_main:  # rank 0 tokenises; the others then hit the cache
            data = prepare_data(source, self.tokenizer, val_fraction=cfg.data.val_fraction,
                                cache_dir=cfg.data.cache_dir, progress=cfg.train.progress)
        barrier(info)
        if data is None:
            data = prepare_data(source, self.tokenizer, val_fraction=cfg.data.val_fraction,
                                cache_dir=cfg.data.cache_dir, progress=False)
        data.check_block_size(self.block)
        self.data_identity = data.identity()  # recorded with every checkpoint
        recorded = self.saved["trainer_state"].get("data") if self.saved is not None else None
        if isinstance(recorded, dict) and recorded != self.data_identity:
            then = (f"{recorded.get('train_tokens', 0) + recorded.get('val_tokens', 0):,} tokens then, "
                    f"{len(data.train) + len(data.val):,} now, or other tokens")
            if cfg.data.source.startswith("builtin:"):  # read from the installed Python and NumPy: another
                self.say(f"resume: the embedded corpus differs from the checkpoint's ({then}: another Python "
                         "or NumPy); going on with this one")
            else:
                raise ValueError(
                    f"data.source {cfg.data.source!r} is not the data checkpoint {self.found} was trained on (its "
                    f"content changed: {then}); resuming would draw windows from other text. Restore that data, "
                    "or start a new train.out_dir")
        self.data = data

    def build(self) -> None:
        """Model, optimizer, data sampler and precision; the checkpoint's state when resuming."""
        from lintrans.models import GPT

        cfg, info = self.cfg, self.info
        torch.manual_seed(cfg.train.seed)  # same initial weights on every process
        self.model = (GPT(self.gpt_config) if self.initial is None else self.initial).to(info.device)
        if self.saved is not None:  # whole weights into the whole model, before any sharding
            ckpt.load_weights(self.found, self.model)
        # DDP or FSDP (sharded in place: the optimizer must see the sharded parameters), context parallelism
        self.forward = parallelize(self.model, info, cfg.train.parallel, cfg.train.compile)
        self.optimizer = build_optimizer(self.model, cfg, info.device)
        if self.saved is not None:
            def sizes(groups):
                return [len(g["params"]) for g in groups]

            saved_sizes = sizes(self.saved["trainer_state"]["optimizer"]["param_groups"])
            if saved_sizes != sizes(self.optimizer.param_groups):
                legacy = build_optimizer(self.model, cfg, info.device, exempt=False)
                if saved_sizes == sizes(legacy.param_groups):
                    self.optimizer = legacy
                    self.say("resume: this checkpoint's optimizer decays the per-head biases and norm gains of its "
                             "feature maps (grouped by dimension, before they were exempt); kept so that the run "
                             "goes on as it began")
        torch.manual_seed(cfg.train.seed + info.rank)  # per-process dropout streams
        self.sampler = WindowSampler(len(self.data.train), self.block, cfg.train.seed)
        if self.precision == "bf16" and info.device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            self.say("warning: train.precision=bf16 on a CPU without native bf16 (no AVX-512 BF16 / AMX): PyTorch's "
                     "bf16 matrix products run emulated here, many times slower than fp32 (a 1-layer linear GPT "
                     "step took 23x its fp32 time on an AVX2 EPYC); train.precision=fp32 is faster")
        self.scaler = grad_scaler(self.precision)
        if self.saved is not None:
            ckpt.load_optimizer(self.found, self.optimizer, load=(
                (lambda state: load_sharded_optimizer(self.model, self.optimizer, state))
                if is_sharded(self.model) else None))
            for line in _resume_changes(self.saved, cfg, self.total, self.block) + _apply_optim_config(self.optimizer, cfg):
                self.say(line)
            st = self.saved["trainer_state"]
            self.step, self.tokens, self.elapsed = st["step"], st["tokens"], st.get("time_s", 0.0)
            self.sampler.load_state_dict(st["sampler"])
            if len(st["rng"]) == info.world_size:
                ckpt.set_rng_state(st["rng"][info.rank])
            else:
                self.say(f"resume: the checkpoint has random states for {len(st['rng'])} process(es), this run "
                         f"has {info.world_size}: its random streams (dropout) start afresh")
            if st.get("scaler"):
                self.scaler.load_state_dict(st["scaler"])
            self.say(f"resuming from {self.found} at step {self.step}")
        self.autocast = autocast(self.precision, info.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        eval_rng = np.random.Generator(np.random.PCG64(cfg.train.seed + 1))
        # Fixed validation windows (comparable across evals), eval_batches global batches split like training ones.
        starts = eval_rng.integers(0, len(self.data.val) - self.block, size=cfg.train.eval_batches * self.total)
        starts = starts.reshape(cfg.train.eval_batches, self.accum, info.dp_size, self.micro)[:, :, info.dp_rank]
        self.eval_starts = starts.reshape(-1, self.micro)  # [eval_batches * accum, micro]

    def open_logs(self) -> None:
        cfg, info, g = self.cfg, self.info, self.gpt_config
        self.train_config = {**cfg.to_dict(), "model": g.to_dict()}
        self.log = None
        if info.is_main:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # name the key, not only the path
                raise ValueError(f"train.out_dir {str(self.out_dir)!r} cannot be created: {e.strerror or e}") from None
        self.lock()  # a folder new since plan(): locked now (every rank takes part)
        late = info.is_main and self.found is None and ckpt.find_checkpoint(self.out_dir) is not None
        if gather_objects(info, late)[0]:
            # another run made the folder and saved into it meanwhile: this one would start over on top
            raise ValueError(f"train.out_dir {self.out_dir} got a checkpoint from another run while this one "
                             "started; run the command again to continue it, or pick another out_dir")
        if not info.is_main:
            return
        write_resolved(cfg, g, self.out_dir / "config.yaml")
        self.log = MetricsLog(self.out_dir, self.step, self.say)
        self.say(f"model: {g.attention} attention, {self.model.get_num_params() / 1e6:.2f}M parameters "
                 f"(without position embeddings), {g.n_layer} layers, block_size {self.block}")
        self.say(f"data: {self.data.meta['source']}: {len(self.data.train):,} train / {len(self.data.val):,} val "
                 f"tokens ({self.tokenizer.name} tokenizer)")
        split = (f", each sequence split over {info.cp_size} processes ({self.block // info.cp_size} tokens each)"
                 if info.cp_size > 1 else "")
        self.say(f"batch: {self.total} sequences x {self.block} tokens = {self.total * self.block:,} tokens/update "
                 f"({info.dp_size} process(es) x {self.micro} micro-batch x {self.accum} accumulation{split}) on "
                 f"{info.device}, {self.precision}" + (", FSDP" if is_sharded(self.model) else ""))

    # -- the steps of the loop ----------------------------------------------------------------

    def batch(self, tokens, starts):
        """This process's inputs and targets for windows ``starts``: with context parallelism the
        slice [cp_rank * n, (cp_rank + 1) * n) of each window, n = block_size / cp_size."""
        n = self.block // self.info.cp_size
        return get_batch(tokens, starts + self.info.cp_rank * n, n, self.info.device)

    def train_step(self, lr: float) -> tuple[Optional[float], Optional[float]]:
        """One update (with gradient accumulation): (loss, grad norm), or (None, None) when the loss
        or the gradient is not finite, in which case nothing was applied."""
        info = self.info
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        starts = self.sampler.draw(self.total).reshape(self.accum, info.dp_size, self.micro)[:, info.dp_rank]
        loss_sum = torch.zeros((), device=info.device)
        for a in range(self.accum):
            x, y = self.batch(self.data.train, starts[a])
            with no_gradient_sync(self.model, self.forward, skip=a < self.accum - 1):
                with self.autocast:
                    _, loss = self.forward(x, y, return_logits=False)
                self.scaler.scale(loss / self.accum).backward()
            loss_sum += loss.detach().float()
        loss_value = all_mean(info, loss_sum.item() / self.accum)
        if not math.isfinite(loss_value):
            return None, None
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.params, clip)).item()
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():
            return None, None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, grad_norm

    def evaluate(self) -> float:
        model = self.model
        model.eval()
        losses = []
        with torch.no_grad(), self.autocast:
            for starts in self.eval_starts:
                x, y = self.batch(self.data.val, starts)
                losses.append(model(x, y, return_logits=False)[1].float().item())
        model.train()
        return all_mean(self.info, float(np.mean(losses)))

    def weights_finite(self) -> bool:
        bad = any(not torch.isfinite(local_tensor(p)).all() for p in self.model.parameters())
        return not any_flag(self.info, bad)

    def save(self) -> None:
        info = self.info
        rng = gather_objects(info, ckpt.rng_state())
        model_state = optimizer_state = None
        if is_sharded(self.model):  # gathered whole on rank 0: the checkpoint of an unsharded run
            model_state, optimizer_state = full_state_dicts(self.model, self.optimizer)
        if info.is_main:
            state = {"step": self.step, "tokens": self.tokens, "time_s": self.elapsed,
                     "lr": lr_at(max(self.step - 1, 0), self.cfg), "world_size": info.world_size,
                     "sampler": self.sampler.state_dict(), "rng": rng, "data": self.data_identity,
                     "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}
            ckpt.save_checkpoint(self.out_dir, self.model, self.optimizer, state, self.train_config,
                                 {"tokenizer": self.tokenizer.name}, model_state, optimizer_state)
        barrier(info)

    def report_eval(self, bar, loss: float, val_loss: float, tokens_per_s: float) -> None:
        """One readable line per evaluation, to stdout and train.log, with or without the progress bar."""
        if not self.info.is_main:
            return
        line = (f"step {self.step}/{self.cfg.train.max_steps}: train loss {loss:.4f}, val loss {val_loss:.4f}, "
                f"{tokens_per_s:,.0f} tokens/s, {self.elapsed:.0f} s")
        bar.write(line, file=sys.stdout)
        with open(self.out_dir / "train.log", "a") as f:
            f.write(line + "\n")

    def loop(self) -> TrainResult:
        cfg, info = self.cfg, self.info
        result = TrainResult(self.out_dir, self.step)
        stop_after = None if cfg.train.stop_after_steps is None else self.step + cfg.train.stop_after_steps
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.train.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (info.is_main and cfg.train.progress))
        tokens_this_run, elapsed_at_start = 0, self.elapsed
        lr = lr_at(self.step, cfg)
        self.model.train()
        with _StopSignal() as stop:
            while self.step < cfg.train.max_steps:
                t0 = time.perf_counter()
                lr = lr_at(self.step, cfg)
                loss, grad_norm = self.train_step(lr)
                if loss is None:
                    result.stopped, result.exit_code = "nonfinite", EXIT_NONFINITE
                    break
                self.step += 1
                self.tokens += self.total * self.block
                tokens_this_run += self.total * self.block
                self.elapsed += time.perf_counter() - t0
                result.losses[self.step] = loss
                row = {"step": self.step, "tokens": self.tokens, "lr": lr, "loss": loss, "grad_norm": grad_norm,
                       "time_s": round(self.elapsed, 3)}
                if self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.max_steps:
                    row["val_loss"] = result.val_losses[self.step] = self.evaluate()
                    rate = tokens_this_run / max(self.elapsed - elapsed_at_start, 1e-9)
                    self.report_eval(bar, loss, row["val_loss"], rate)
                if self.log is not None:
                    self.log.add(row)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}",
                                **({"val": f"{row['val_loss']:.4f}"} if "val_loss" in row else {}))
                if any_flag(info, stop.signum is not None):
                    result.stopped = "signal"
                    result.exit_code = 128 + (stop.signum or signal.SIGTERM)
                elif stop_after is not None and self.step >= stop_after:
                    result.stopped = "stop_after"
                if (self.step % cfg.train.checkpoint_interval == 0 or self.step == cfg.train.max_steps
                        or result.stopped != "done"):
                    if not self.weights_finite():  # a NaN/inf weight must never replace the last good checkpoint
                        result.stopped, result.exit_code = "nonfinite", EXIT_NONFINITE
                        break
                    self.save()
                    if self.log is not None:
                        self.log.plot(self.out_dir / "loss.png", f"{self.gpt_config.attention} GPT, "
                                      f"{self.data.meta['source']}")
                if result.stopped != "done":
                    break
        bar.close()
        result.step = self.step
        result.peak_memory = gather_objects(info, peak_memory_bytes(info.device))
        self.report_memory(result.peak_memory)
        self.say_outcome(result, lr)
        return result

    def report_memory(self, peaks: list[int]) -> None:
        if not self.info.is_main:
            return
        what = "CUDA allocator peak" if self.info.device.type == "cuda" else "peak resident set"
        line = (f"peak memory per process ({what}): "
                + ", ".join(f"{p / 2**20:,.0f}" for p in peaks) + " MiB")
        self.say(line)
        if self.out_dir.is_dir():
            with open(self.out_dir / "train.log", "a") as f:
                f.write(line + "\n")

    def say_outcome(self, result: TrainResult, lr: float) -> None:
        if result.stopped == "nonfinite":
            kept = ckpt.find_checkpoint(self.out_dir)
            self.say(f"stopped: the loss, a gradient or a weight became non-finite by step {self.step + 1} "
                     f"(lr {lr:.3g}); nothing was saved after it. The last good checkpoint is "
                     f"{kept or 'none (no checkpoint was written yet)'}. Lower optim.lr, raise optim.warmup_steps, "
                     "or use precision fp32.")
        elif result.stopped == "signal":
            self.say(f"stopped by signal at step {self.step}; checkpoint saved in "
                     f"{self.out_dir / ckpt.CHECKPOINT_NAME}. Run the same command again to continue.")
        else:
            self.say(f"{'paused' if result.stopped == 'stop_after' else 'finished'} at step {self.step}; "
                     f"checkpoint in {self.out_dir / ckpt.CHECKPOINT_NAME}, logs in {self.out_dir}")
