"""The training loop behind ``lintrans train``: resumable, DDP-aware, stops cleanly on signals and NaNs."""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import checkpoint as ckpt
from .config import TrainConfig, padded_vocab, write_resolved
from .data import TokenData, WindowSampler, batch_layout, get_batch, prepare_data, resolve_source
from .distributed import DistInfo, all_mean, any_flag, barrier, gather_objects, init_distributed, shutdown
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


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings, linear weights) and none on biases/norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        fused=device.type == "cuda" or None,
    )


def _precision(name: str, device: torch.device) -> str:
    if name == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ValueError(f"train.precision 'fp16' needs a CUDA device (gradient scaling); got {device}")
    return name


class MetricsLog:
    """metrics.jsonl (source of truth) and metrics.csv; on resume, rows after the checkpoint are dropped."""

    COLUMNS = ("step", "tokens", "lr", "loss", "grad_norm", "val_loss", "time_s")

    def __init__(self, out_dir: Path, start_step: int):
        self.jsonl, self.csv = out_dir / "metrics.jsonl", out_dir / "metrics.csv"
        rows = []
        if self.jsonl.is_file() and start_step > 0:
            rows = [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if r["step"] <= start_step]
        self.rows = rows
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.csv.write_text(",".join(self.COLUMNS) + "\n" + "".join(self._csv_line(r) for r in rows))

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
              for k in ("source", "tokenizer", "val_fraction", "bin_dtype") if old_data.get(k) != getattr(cfg.data, k)]
    if diffs:
        raise ValueError(
            f"checkpoint {path} does not match this config ({'; '.join(diffs)}); use a new train.out_dir "
            "or set train.resume=never with a new out_dir"
        )


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
    from lintrans.models.hf import WEIGHT_PRESERVING, from_pretrained

    overrides = {k: v for k, v in cfg.model.items() if k in WEIGHT_PRESERVING}
    ignored = sorted(k for k in cfg.model if k not in WEIGHT_PRESERVING)
    model = from_pretrained(cfg.train.init_from, **overrides)
    if ignored:
        say(f"train.init_from: the model's shape comes from {cfg.train.init_from}; the config's "
            f"{['model.' + k for k in ignored]} are not used (only {list(WEIGHT_PRESERVING)} apply)")
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"train.init_from {cfg.train.init_from} has {model.config.vocab_size} tokens, fewer than "
                         f"the {tokenizer.name} tokenizer's {tokenizer.vocab_size}: set data.tokenizer to its own")
    say(f"initial weights from {cfg.train.init_from} ({model.config.attention} attention)")
    return model


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) the training described by ``cfg``; see docs/training.md."""
    cfg.validate()
    info = init_distributed(cfg.train.device)
    try:
        return _train(cfg, info)
    finally:
        shutdown(info)


def _train(cfg: TrainConfig, info: DistInfo) -> TrainResult:
    from lintrans.models import GPT

    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if info.is_main else (lambda *a: None)
    out_dir = Path(cfg.train.out_dir)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    if "vocab_size" in cfg.model and cfg.model["vocab_size"] < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size ({cfg.model['vocab_size']}) is smaller than the {tokenizer.name} tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )
    initial = None
    if cfg.train.init_from:
        initial = _initial_model(cfg, tokenizer, say)
        gpt_config = initial.config
    else:
        gpt_config = cfg.gpt_config(vocab_size=padded_vocab(tokenizer.vocab_size))
    block = gpt_config.block_size
    total, micro, accum = batch_layout(cfg.train.tokens_per_update, cfg.train.batch_size,
                                       cfg.train.micro_batch_size, block, info.world_size)

    # Resume checks come before any tokenising or training, so a mistake costs nothing.
    if info.is_main:
        for path in ckpt.remove_abandoned(out_dir):
            say(f"removed {path}: the unfinished save of a run that was killed")
    found = ckpt.find_checkpoint(out_dir)
    if found is not None and cfg.train.resume == "never":
        raise ValueError(f"{out_dir} already holds a checkpoint; set train.resume=auto to continue it or pick another out_dir")
    if found is None and cfg.train.resume == "must":
        raise ValueError(f"train.resume=must but {out_dir} holds no checkpoint")
    saved = None
    if found is not None:
        saved = ckpt.read_checkpoint(found)
        _check_resume(found, saved, cfg, gpt_config.to_dict())
        done = saved["trainer_state"]["step"]
        if done >= cfg.train.max_steps:
            say(f"nothing to train: the checkpoint in {found} is at step {done}, already at train.max_steps="
                f"{cfg.train.max_steps}. To train further, raise it (e.g. --train.max_steps {2 * done}; the "
                "learning-rate schedule then stretches to the new end), or use a new train.out_dir.")
            return TrainResult(out_dir, done, stopped="already_done")

    source = resolve_source(cfg.data.source, bin_dtype=cfg.data.bin_dtype,
                            hf_split=cfg.data.hf_split, hf_column=cfg.data.hf_text_column)
    data: TokenData | None = None
    if info.is_main:  # rank 0 tokenises; the others then hit the cache
        data = prepare_data(source, tokenizer, val_fraction=cfg.data.val_fraction,
                            cache_dir=cfg.data.cache_dir, progress=cfg.train.progress)
    barrier(info)
    if data is None:
        data = prepare_data(source, tokenizer, val_fraction=cfg.data.val_fraction,
                            cache_dir=cfg.data.cache_dir, progress=False)
    data.check_block_size(block)

    torch.manual_seed(cfg.train.seed)  # same initial weights on every process
    model = (GPT(gpt_config) if initial is None else initial).to(info.device)
    optimizer = build_optimizer(model, cfg, info.device)
    torch.manual_seed(cfg.train.seed + info.rank)  # per-process dropout streams
    sampler = WindowSampler(len(data.train), block, cfg.train.seed)
    precision = _precision(cfg.train.precision, info.device)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    step, tokens, elapsed = 0, 0, 0.0
    if saved is not None:
        ckpt.load_weights(found, model, optimizer)
        for line in _apply_optim_config(optimizer, cfg):
            say(line)
        st = saved["trainer_state"]
        step, tokens, elapsed = st["step"], st["tokens"], st.get("time_s", 0.0)
        sampler.load_state_dict(st["sampler"])
        if len(st["rng"]) == info.world_size:
            ckpt.set_rng_state(st["rng"][info.rank])
        if st.get("scaler"):
            scaler.load_state_dict(st["scaler"])
        say(f"resuming from {found} at step {step}")

    forward = torch.compile(model) if cfg.train.compile else model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(forward, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    autocast = (
        torch.autocast(info.device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
        if precision in ("bf16", "fp16") else contextlib.nullcontext()
    )

    train_config = cfg.to_dict()
    train_config["model"] = gpt_config.to_dict()
    extra_config = {"tokenizer": tokenizer.name}
    log = None
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_resolved(cfg, gpt_config, out_dir / "config.yaml")
        log = MetricsLog(out_dir, step)
        say(f"model: {gpt_config.attention} attention, {model.get_num_params() / 1e6:.2f}M parameters "
            f"(without position embeddings), {gpt_config.n_layer} layers, block_size {block}")
        say(f"data: {data.meta['source']}: {len(data.train):,} train / {len(data.val):,} val tokens "
            f"({tokenizer.name} tokenizer)")
        say(f"batch: {total} sequences x {block} tokens = {total * block:,} tokens/update "
            f"({info.world_size} process(es) x {micro} micro-batch x {accum} accumulation) on {info.device}, {precision}")
    eval_rng = np.random.Generator(np.random.PCG64(cfg.train.seed + 1))
    # Fixed validation windows (comparable across evals), eval_batches global batches split like training ones.
    eval_starts = eval_rng.integers(0, len(data.val) - block, size=cfg.train.eval_batches * total)
    eval_starts = eval_starts.reshape(cfg.train.eval_batches, accum, info.world_size, micro)[:, :, info.rank]
    eval_starts = eval_starts.reshape(-1, micro)  # [eval_batches * accum, micro]

    def evaluate() -> float:
        model.eval()
        losses = []
        with torch.no_grad(), autocast:
            for starts in eval_starts:
                x, y = get_batch(data.val, starts, block, info.device)
                losses.append(model(x, y, return_logits=False)[1].float().item())
        model.train()
        return all_mean(info, float(np.mean(losses)))

    def weights_finite() -> bool:
        bad = any(not torch.isfinite(p).all() for p in model.parameters())
        return not any_flag(info, bad)

    def save() -> None:
        rng = gather_objects(info, ckpt.rng_state())
        if info.is_main:
            state = {"step": step, "tokens": tokens, "time_s": elapsed, "lr": lr_at(max(step - 1, 0), cfg),
                     "world_size": info.world_size, "sampler": sampler.state_dict(), "rng": rng,
                     "scaler": scaler.state_dict() if scaler.is_enabled() else None}
            ckpt.save_checkpoint(out_dir, model, optimizer, state, train_config, extra_config)
            log.plot(out_dir / "loss.png", f"{gpt_config.attention} GPT, {data.meta['source']}")
        barrier(info)

    result = TrainResult(out_dir, step)
    stop_after = None if cfg.train.stop_after_steps is None else step + cfg.train.stop_after_steps
    params = [p for p in model.parameters() if p.requires_grad]
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.train.max_steps, initial=step, desc="train", unit="step",
               disable=not (info.is_main and cfg.train.progress))
    tokens_this_run, elapsed_at_start = 0, elapsed
    model.train()
    with _StopSignal() as stop:
        while step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            starts = sampler.draw(total).reshape(accum, info.world_size, micro)[:, info.rank]  # [accum, micro]
            loss_sum = torch.zeros((), device=info.device)
            for a in range(accum):
                x, y = get_batch(data.train, starts[a], block, info.device)
                sync = a == accum - 1 or not info.enabled
                with (contextlib.nullcontext() if sync else forward.no_sync()):
                    with autocast:
                        _, loss = forward(x, y, return_logits=False)
                    scaler.scale(loss / accum).backward()
                loss_sum += loss.detach().float()
            loss_value = all_mean(info, loss_sum.item() / accum)
            if not math.isfinite(loss_value):
                result.stopped, result.exit_code = "nonfinite", EXIT_NONFINITE
                break
            scaler.unscale_(optimizer)
            clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip).item()
            if not math.isfinite(grad_norm) and not scaler.is_enabled():
                result.stopped, result.exit_code = "nonfinite", EXIT_NONFINITE
                break
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += total * block
            tokens_this_run += total * block
            elapsed += time.perf_counter() - t0
            result.losses[step] = loss_value
            row = {"step": step, "tokens": tokens, "lr": lr, "loss": loss_value, "grad_norm": grad_norm,
                   "time_s": round(elapsed, 3)}
            if step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps:
                row["val_loss"] = result.val_losses[step] = evaluate()
                if info.is_main:  # one readable line per evaluation, with or without the progress bar
                    line = (f"step {step}/{cfg.train.max_steps}: train loss {loss_value:.4f}, val loss "
                            f"{row['val_loss']:.4f}, {tokens_this_run / max(elapsed - elapsed_at_start, 1e-9):,.0f} "
                            f"tokens/s, {elapsed:.0f} s")
                    bar.write(line, file=sys.stdout)
                    with open(out_dir / "train.log", "a") as f:
                        f.write(line + "\n")
            if log is not None:
                log.add(row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}",
                            **({"val": f"{row['val_loss']:.4f}"} if "val_loss" in row else {}))
            signalled = any_flag(info, stop.signum is not None)
            if signalled:
                result.stopped = "signal"
                result.exit_code = 128 + (stop.signum or signal.SIGTERM)
            elif stop_after is not None and step >= stop_after:
                result.stopped = "stop_after"
            if step % cfg.train.checkpoint_interval == 0 or step == cfg.train.max_steps or result.stopped != "done":
                if not weights_finite():  # a NaN/inf weight must never replace the last good checkpoint
                    result.stopped, result.exit_code = "nonfinite", EXIT_NONFINITE
                    break
                save()
            if result.stopped != "done":
                break
    bar.close()
    result.step = step
    if result.stopped == "nonfinite":
        kept = ckpt.find_checkpoint(out_dir)
        say(f"stopped: the loss, a gradient or a weight became non-finite by step {step + 1} (lr {lr:.3g}); nothing was "
            f"saved after it. The last good checkpoint is {kept or 'none (no checkpoint was written yet)'}. "
            "Lower optim.lr, raise optim.warmup_steps, or use precision fp32.")
    elif result.stopped == "signal":
        say(f"stopped by signal at step {step}; checkpoint saved in {out_dir / ckpt.CHECKPOINT_NAME}. "
            "Run the same command again to continue.")
    else:
        say(f"{'paused' if result.stopped == 'stop_after' else 'finished'} at step {step}; "
            f"checkpoint in {out_dir / ckpt.CHECKPOINT_NAME}, logs in {out_dir}")
    return result
