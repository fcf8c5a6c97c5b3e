"""Training configuration: four sections (model, data, optim, train) from TOML/YAML plus overrides.

Every key is typed (the dataclasses below, through ``lintrans.config``: flags, overrides, files);
an unknown key or a value of the wrong type is a ValueError/TypeError naming the key and what is
allowed, raised before any data is read or any step is taken.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lintrans.checks import check_known_keys
from lintrans.config import apply_overrides, check_fields, dump, from_dict, read_file
from lintrans.models import GPTConfig

from .precision import PRECISIONS
from .tokenizer import TOKENIZERS

SCHEDULES = ("cosine", "linear", "constant")
BIN_DTYPES = ("uint16", "uint32")  # numpy's names; data.py maps them (this module loads without numpy's cost)
RESUME_MODES = ("auto", "never", "must")
PARALLEL = ("ddp", "fsdp")


def _key(default, help: str, **limits):
    """A config key with its help text (``lintrans train --help`` lists every key with it) and its
    limits (``low``, ``high``, ``low_open``, ``high_open``, ``choices``: see ``lintrans.config``)."""
    return field(default=default, metadata={"help": help, **limits})


@dataclass
class DataConfig:
    source: str = _key("builtin:python-docs", "the text: builtin:python-docs (the embedded corpus), text files or a "
                       "glob, nanoGPT .bin token files, or hf:NAME from the local Hugging Face cache")
    tokenizer: str = _key("gpt2", "how text becomes tokens", choices=TOKENIZERS)
    val_fraction: float = _key(0.05, "share of the corpus held out for evaluation", low=0, high=1, low_open=True,
                               high_open=True)
    bin_dtype: str = _key("uint16", "dtype of nanoGPT .bin token files", choices=BIN_DTYPES)
    hf_split: str = _key("train", "split of an hf: dataset")
    hf_text_column: str = _key("text", "column of an hf: dataset that holds the text")
    cache_dir: Optional[str] = _key(None, "where tokenized corpora are kept (default: $LINTRANS_CACHE_DIR/data or "
                                    "~/.cache/lintrans/data)")


@dataclass
class OptimConfig:
    lr: float = _key(6e-4, "peak learning rate (AdamW)", low=0, low_open=True)
    min_lr: float = _key(6e-5, "learning rate at the end of the decay, <= lr", low=0)
    warmup_steps: int = _key(100, "steps of linear warm-up to lr (step s at lr * (s + 1) / warmup_steps)", low=0)
    decay_steps: Optional[int] = _key(None, "steps from 0 to the end of the decay (default: train.max_steps)", low=1)
    schedule: str = _key("cosine", "decay after the warm-up", choices=SCHEDULES)
    weight_decay: float = _key(0.1, "AdamW weight decay, applied to matrices (>= 2-D parameters) only, not to biases or norm gains", low=0)
    beta1: float = _key(0.9, "AdamW beta1", low=0, high=1, high_open=True)
    beta2: float = _key(0.95, "AdamW beta2", low=0, high=1, high_open=True)
    eps: float = _key(1e-8, "AdamW eps", low=0, low_open=True)
    grad_clip: float = _key(1.0, "largest global gradient norm; 0 disables clipping", low=0)


@dataclass
class TrainSection:
    out_dir: str = _key("runs/default", "folder of the run: its checkpoint, train.log and resolved config")
    max_steps: int = _key(1000, "optimizer steps of the whole run", low=1)
    stop_after_steps: Optional[int] = _key(None, "stop, with a checkpoint, after this many steps in this process "
                                           "(the same command resumes)", low=1)
    batch_size: Optional[int] = _key(16, "sequences per update over all processes (ignored when "
                                     "tokens_per_update is set)", low=1)
    tokens_per_update: Optional[int] = _key(None, "tokens per update, whatever the block size: the batch is this / "
                                            "model.block_size sequences", low=1)
    micro_batch_size: Optional[int] = _key(None, "sequences per forward pass per process (default: the whole "
                                           "batch); the rest is gradient accumulation", low=1)
    eval_interval: int = _key(100, "steps between evaluations on the held-out text", low=1)
    eval_batches: int = _key(10, "batches per evaluation", low=1)
    checkpoint_interval: int = _key(200, "steps between checkpoints", low=1)
    seed: int = _key(1337, "seed of the initial weights, the batches and dropout", low=0, high=2**63 - 1)
    device: str = _key("auto", "auto, cpu, cuda, cuda:N or mps")
    precision: str = _key("auto", "auto is bf16 autocast on GPUs that support it, fp32 elsewhere", choices=PRECISIONS)
    compile: bool = _key(False, "torch.compile the model")
    resume: str = _key("auto", "auto continues from out_dir's checkpoint when there is one, never refuses an "
                       "out_dir that has one, must refuses one that has none", choices=RESUME_MODES)
    init_from: Optional[str] = _key(None, "start from these weights: a lintrans checkpoint, a Hugging Face GPT-2 "
                                    "folder or cache name, or a nanoGPT ckpt.pt; the model is that one, and "
                                    "model.attention etc. may swap its attention (weights kept)")
    progress: bool = _key(True, "progress bar")
    parallel: str = _key("ddp", "under torchrun: ddp replicates the weights, fsdp (FSDP2 fully_shard) shards "
                         "weights, gradients and optimizer state over the processes", choices=PARALLEL)
    context_parallel: int = _key(1, "split every sequence over this many processes (linear-state attention only)",
                                 low=1)


SECTIONS = {"data": DataConfig, "optim": OptimConfig, "train": TrainSection}


@dataclass
class TrainConfig:
    # GPTConfig keys, only those set (vocab_size defaults to the tokenizer's)
    model: dict = field(default_factory=dict, metadata={"schema": GPTConfig})
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        if isinstance(d, dict):
            check_known_keys("config sections", d, ["model", *SECTIONS])
        cfg = from_dict(cls, d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Every key against its field's limits (as when it was set), then what involves two keys."""
        check_fields(self)
        if self.train.batch_size is None and self.train.tokens_per_update is None:
            raise ValueError("set train.batch_size or train.tokens_per_update")
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"config key 'optim.min_lr' ({self.optim.min_lr}) must be <= optim.lr ({self.optim.lr})")
        o = self.optim
        if o.schedule != "constant" and o.decay_steps is not None and o.decay_steps <= o.warmup_steps:
            raise ValueError(f"config key 'optim.decay_steps' ({o.decay_steps}) must be > optim.warmup_steps "
                             f"({o.warmup_steps}): the decay runs from the end of the warm-up to decay_steps")
        if self.train.precision == "fp16" and self.train.device in ("cpu", "mps"):
            raise ValueError(f"config key 'train.precision' 'fp16' needs a CUDA device (gradient scaling); "
                             f"train.device is {self.train.device!r}")
        gpt = self.gpt_config(vocab_size=self.model.get("vocab_size", 64))  # model keys and values
        # so that --print-config fails like a run; with init_from and no model.attention the options are
        # the checkpoint's attention's, checked when its weights are read (in the run's plan)
        if not (self.train.init_from and "attention" not in self.model):
            from lintrans.nn.registry import check_attention

            check_attention(gpt)
        if self.train.context_parallel > 1 and not self.train.init_from:
            check_context_parallel(gpt.attention, gpt.block_size, self.train.context_parallel)
        if self.train.parallel == "fsdp" and not self.train.init_from:
            check_fsdp(gpt)

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The model config, with the vocabulary taken from the tokenizer unless set explicitly."""
        return GPTConfig.from_dict({"vocab_size": vocab_size, **self.model})


def check_fsdp(gpt: GPTConfig) -> None:
    """FSDP2 gathers a block's weights around the block's forward; reversible layers call the block's
    halves directly (forward and recompute), so they would see sharded weights."""
    if gpt.reversible:
        raise ValueError("train.parallel = 'fsdp' cannot shard model.reversible = true (its layers call the "
                         "blocks' halves, which FSDP does not gather); use train.parallel = 'ddp'")


def check_context_parallel(attention: str, block_size: int, n: int) -> None:
    from lintrans.nn.registry import context_parallel_attention

    allowed = context_parallel_attention()
    if attention not in allowed:
        raise ValueError(f"train.context_parallel = {n} splits each sequence over {n} processes, which attention "
                         f"{attention!r} cannot do (only layers whose state adds across processes can): use "
                         f"model.attention in {allowed}, or train.context_parallel = 1")
    if block_size % n:
        raise ValueError(f"train.context_parallel = {n} must divide model.block_size ({block_size}): every process "
                         "holds an equal slice of each sequence")


def padded_vocab(vocab_size: int) -> int:
    """Round up to a multiple of 64 (as nanoGPT does: 50257 -> 50304) for faster matmuls."""
    return (vocab_size + 63) // 64 * 64


# ---- files -----------------------------------------------------------------------------------


SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def shipped_configs() -> list[str]:
    """Names of the configs that ship inside the package (``--config tiny``)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.toml"))


def resolve_config_path(path) -> Path:
    """A config file path, or the name of a shipped config (``tiny``, ``gpt2-124m``)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.parent == Path(".") and (SHIPPED_CONFIGS / f"{path.stem}.toml").is_file() and path.suffix in ("", ".toml"):
        return SHIPPED_CONFIGS / f"{path.stem}.toml"
    what = "is a folder, not a file" if path.is_dir() else "does not exist"
    raise FileNotFoundError(f"config file {path} {what} (shipped configs, usable by name: {shipped_configs()})")


def read_config_file(path) -> dict:
    """A TOML (.toml), YAML (.yaml/.yml) or JSON (.json) file as a dict; or a shipped config's name."""
    return read_file(resolve_config_path(path))


def load_config(path=None, overrides=(), *, file_model: bool = True) -> TrainConfig:
    """Defaults, then the file at ``path`` (if any; its [model] section only with ``file_model``), then
    ``overrides`` ("section.key=value" strings)."""
    data = read_config_file(path) if path is not None else {}
    if not file_model:
        data.pop("model", None)
    cfg = TrainConfig.from_dict(data)
    apply_overrides(cfg, overrides)
    cfg.validate()
    return cfg


def write_resolved(cfg: TrainConfig, gpt: GPTConfig, path) -> None:
    """The config a run actually used, model section complete, as YAML that --config reads back."""
    from lintrans._io import atomic_write_text

    data = cfg.to_dict()
    data["model"] = gpt.to_dict()
    atomic_write_text(path, dump(data))
