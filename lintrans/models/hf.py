"""Weights in and out: Hugging Face GPT-2 folders, nanoGPT checkpoints, lintrans checkpoint folders.

Nothing here downloads. Files are read with safetensors or ``torch.load(weights_only=True)`` and
written atomically (temporary file + rename).

Formats:
- Hugging Face GPT-2: ``config.json`` (model_type gpt2) + ``model.safetensors`` or
  ``pytorch_model.bin``; Conv1D weights are stored [in, out], so they are transposed.
- nanoGPT: a ``ckpt.pt`` dict with ``model`` (state dict, maybe ``_orig_mod.``-prefixed from
  torch.compile) and ``model_args``; nanoGPT uses the exact erf GELU.
- lintrans: ``config.json`` holding the GPTConfig dict (directly or under ``"model"``) +
  ``model.safetensors`` with our parameter names.
"""
from __future__ import annotations

import json
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Iterable, Optional

import torch

from lintrans.checks import check_choice

from .._io import atomic_write, atomic_write_text
from .config import GPTConfig
from .gpt import GPT

# weights stored by HF's Conv1D as [in, out]; ours are nn.Linear [out, in]
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")
_TIED = ("transformer.wte.weight", "lm_head.weight")
# overrides that leave every pretrained weight meaningful
WEIGHT_PRESERVING = ("attention", "attention_options", "dropout", "gradient_checkpointing", "gelu_approximate")
_HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


# -- state dict checks -----------------------------------------------------------------------

def load_state_dict_checked(model: GPT, state: dict, allow_missing: Iterable[str] = (), source: str = "checkpoint"):
    """Copy ``state`` into ``model``, failing with a list of what differs (keys, shapes).

    The tied embedding may be stored under either name. ``allow_missing``: model keys that may
    be absent and keep their fresh initialisation (new parameters of a swapped attention layer).
    """
    prefix = "_orig_mod."  # torch.compile's wrapper
    state = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}
    for a, b in (_TIED, _TIED[::-1]):
        if a not in state and b in state:
            state[a] = state[b]
    a, b = (state.get(k) for k in _TIED)
    if (a is not None and b is not None and a is not b and a.shape == b.shape
            and not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)):
        # one matrix serves both here: copying either would silently change the other's role
        raise ValueError(f"{source} holds an lm_head.weight that differs from the token embedding (untied "
                         "weights); the GPT ties them, so it cannot load both")
    expected = model.state_dict()
    allow = set(allow_missing) | _optional_keys(model)
    missing = [k for k in expected if k not in state and k not in allow]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k}: {tuple(state[k].shape)} in {source}, {tuple(v.shape)} in model"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
            if items:
                more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
                parts.append(f"{label}: {items[:5]}{more}")
        raise ValueError(f"{source} does not match the model config: " + "; ".join(parts))
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model


def _optional_keys(model: torch.nn.Module) -> set[str]:
    """Keys older weights may lack: a module's ``optional_state_keys``, which its own
    ``_load_from_state_dict`` fills in (e.g. Performer's count of draws)."""
    return {f"{name}.{key}" if name else key
            for name, m in model.named_modules() for key in getattr(m, "optional_state_keys", ())}


def _attention_only(key: str) -> bool:
    """A parameter of an attention layer beyond the c_attn / c_proj every mechanism shares."""
    return ".attn." in key and not any(p in key for p in (".attn.c_attn.", ".attn.c_proj."))


def _new_attention_keys(model: GPT) -> list[str]:
    """Parameters a swapped-in attention layer adds beyond the shared c_attn / c_proj."""
    return [k for k in model.state_dict() if _attention_only(k)]


class AttentionSwapWarning(UserWarning):
    """Weights loaded into an attention mechanism they were not trained with (``trained_with``)."""

    def __init__(self, message: str, trained_with: str = "softmax"):
        super().__init__(message)
        self.trained_with = trained_with


def _build(config: GPTConfig, state: dict, source: str, pretrained_attention: str = "softmax",
           pretrained_options: Optional[dict] = None) -> GPT:
    model = GPT(config)
    if any(p.is_meta for p in model.parameters()):  # under `with torch.device("meta")`: weights would be dropped
        raise ValueError(f"{source}: loading under a meta device builds no weights; load outside "
                         "`torch.device('meta')` (then .to() where they should go)")
    swapped = config.attention != pretrained_attention
    if swapped:
        warnings.warn(AttentionSwapWarning(
            f"{source} was trained with {pretrained_attention!r} attention and is loaded with "
            f"{config.attention!r}: its weights were not trained for it, so expect a worse model until "
            "it is fine-tuned (train.init_from)", pretrained_attention), stacklevel=3)
    changed = swapped or (pretrained_options is not None and pretrained_options != config.attention_options)
    if changed:  # the old attention's own parameters (a gate, feature-map modules) have no place in the new one
        keep = model.state_dict()
        dropped = sorted(k for k in state if k not in keep and _attention_only(k))
        if dropped:
            now = repr(config.attention) + (f" with {config.attention_options}" if config.attention_options else "")
            warnings.warn(f"{source}: {len(dropped)} parameter(s) of the attention it was trained with are not "
                          f"used by {now} and are left out, e.g. {dropped[:2]}", UserWarning, stacklevel=3)
            state = {k: v for k, v in state.items() if k not in dropped}
    allow = _new_attention_keys(model) if changed else ()
    return load_state_dict_checked(model, state, allow, source)


def _apply_overrides(config: GPTConfig, overrides: dict) -> GPTConfig:
    bad = sorted(set(overrides) - set(WEIGHT_PRESERVING))
    if bad:
        raise ValueError(
            f"cannot override {bad} when loading weights (the shapes would change); allowed: {list(WEIGHT_PRESERVING)}"
        )
    qk_dim = (overrides.get("attention_options") or {}).get("qk_dim")
    if qk_dim is not None and qk_dim != config.n_embd // config.n_head:
        raise ValueError(f"attention_options['qk_dim'] = {qk_dim} would change c_attn's shape (queries and keys "
                         f"{config.n_embd // config.n_head} wide per head in these weights): leave it out when loading")
    if "attention" in overrides and overrides["attention"] != config.attention and "attention_options" not in overrides:
        overrides = {**overrides, "attention_options": _options_that_carry_over(config, overrides["attention"])}
    elif "attention_options" in overrides and overrides.get("attention", config.attention) == config.attention:
        left = {k: v for k, v in config.attention_options.items() if k not in (overrides["attention_options"] or {})}
        if left:  # they replace the saved options as a whole: a saved feature map left out would become elu
            warnings.warn(f"attention_options replace the saved ones as a whole: {left} are not given and take "
                          "their defaults (pass them too to keep them)", UserWarning, stacklevel=3)
    return config.replace(**overrides) if overrides else config


def _options_that_carry_over(config: GPTConfig, attention: str) -> dict:
    """The saved attention_options that ``attention`` also takes (qk_dim, chunk_size, ...): the others
    belong to the mechanism the weights were trained with and are left out, with a warning."""
    import dataclasses

    from lintrans.nn.registry import attention_options

    taken = {f.name for f in dataclasses.fields(attention_options(attention))}
    kept = {k: v for k, v in config.attention_options.items() if k in taken}
    # a name both take may hold a value only the old one accepts (linear's form="attention"); options
    # that work only together (a feature map and its options) are tried together first
    if not _layer_builds(config, attention, kept):
        kept = {k: v for k, v in kept.items() if _layer_builds(config, attention, {k: v})}
    dropped = sorted(set(config.attention_options) - set(kept))
    if dropped:
        warnings.warn(f"attention_options {dropped} of {config.attention!r} are not options of {attention!r} (or "
                      "not values it takes) and are left out (pass attention_options to set its own)",
                      UserWarning, stacklevel=4)
    return kept


def _layer_builds(config: GPTConfig, attention: str, options: dict) -> bool:
    """Whether one layer of ``attention`` with ``options`` builds (on the meta device: no memory)."""
    from lintrans.nn.registry import check_attention

    try:
        check_attention(config.replace(attention=attention, attention_options=options))
    except (ValueError, TypeError):
        return False
    return True


def _read_tensors(path: Path) -> dict:
    if path.name.endswith(".index.json"):
        return _read_shards(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path} is damaged or not a safetensors file: {e}") from None
    obj = _torch_load(path, "a weights-only PyTorch file")
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(obj).__name__})")
    return obj


def _torch_load(path: Path, what: str):
    """``torch.load(path, weights_only=True)``; a damaged file or one holding objects that weights-only
    loading refuses is a ValueError naming it."""
    import pickle

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text around the reason is advice for trusted files
        boiler = ("Weights only load failed", "Please file an issue", "Check the documentation")
        reason = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith(boiler)]
        raise ValueError(f"{path} cannot be read as {what}: weights-only loading refused it"
                         + (f" ({reason[-1]})" if reason else "")) from None
    except (RuntimeError, EOFError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} cannot be read as {what}: {first}") from None


def _read_shards(index: Path) -> dict:
    """The tensors of a sharded save (transformers' ``save_pretrained(max_shard_size=...)``): the index's
    ``weight_map`` names the shard holding each tensor."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map' (tensor name -> shard file)")
    state = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or Path(shard).name != shard or shard.endswith(".index.json"):
            raise ValueError(f"{index} names a shard {shard!r} that is not a weights file beside it")
        if not (index.parent / shard).is_file():
            raise ValueError(f"{index} names the shard {shard}, which is missing from {index.parent}")
        state.update(_read_tensors(index.parent / shard))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index}: the shards lack {len(missing)} tensors it lists, e.g. {missing[:3]}")
    return state


def _write_json(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _write_safetensors(path: Path, state: dict, metadata: Optional[dict] = None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


# one file, or transformers' index of shards
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _weights_file(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder} has none of {', '.join(WEIGHT_FILES)}")


# -- Hugging Face GPT-2 ---------------------------------------------------------------------

def config_from_hf(hf: dict) -> GPTConfig:
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"only GPT-2 Hugging Face models are supported, got model_type {hf.get('model_type')!r}")
    act = hf.get("activation_function", "gelu_new")
    check_choice("activation_function", act, sorted(_HF_GELU))
    n_embd = hf.get("n_embd", 768)
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(f"n_inner must be 4 * n_embd ({4 * n_embd}), got {hf['n_inner']}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ValueError(f"Hugging Face option {flag}=True is not supported")
    if not hf.get("scale_attn_weights", True):
        raise ValueError("Hugging Face option scale_attn_weights=False is not supported")
    if not hf.get("tie_word_embeddings", True):  # our lm_head is wte: one of the two matrices would be lost
        raise ValueError("Hugging Face option tie_word_embeddings=False is not supported (the GPT ties lm_head to wte)")
    if not math.isclose(hf.get("layer_norm_epsilon", 1e-5), 1e-5):
        raise ValueError(f"layer_norm_epsilon must be 1e-5, got {hf['layer_norm_epsilon']}")
    return GPTConfig(
        n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), n_embd=n_embd,
        block_size=hf.get("n_positions", hf.get("n_ctx", 1024)), vocab_size=hf.get("vocab_size", 50257),
        bias=True, dropout=0.0, gelu_approximate=_HF_GELU[act],
    )


def config_to_hf(config: GPTConfig) -> dict:
    problems = []
    if config.attention != "softmax":
        problems.append(f"attention={config.attention!r}")
    if config.kv_heads != config.n_head:
        problems.append(f"n_kv_head={config.n_kv_head}")
    if config.mlp != "gelu":
        problems.append(f"mlp={config.mlp!r}")
    if not config.bias:
        problems.append("bias=False")
    if config.pos_embedding != "learned":
        problems.append(f"pos_embedding={config.pos_embedding!r}")
    if config.reversible:
        problems.append("reversible=True")
    if problems:
        raise ValueError(
            f"the Hugging Face GPT-2 format cannot express {', '.join(problems)}; save with save_model() instead"
        )
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new" if config.gelu_approximate == "tanh" else "gelu",
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": True,
        # GPT-2's end of text where the vocabulary has it, else the byte tokenizer's (256); none below that
        "bos_token_id": _eot(config.vocab_size), "eos_token_id": _eot(config.vocab_size),
    }


def _eot(vocab_size: int):
    return 50256 if vocab_size > 50256 else 256 if vocab_size > 256 else None


def state_dict_from_hf(hf_state: dict) -> dict:
    """Hugging Face GPT-2 (GPT2LMHeadModel or GPT2Model) names and layouts -> ours."""
    out = {}
    for k, v in hf_state.items():
        if k.endswith(_HF_BUFFERS):
            continue
        if not k.startswith(("transformer.", "lm_head.")):
            k = "transformer." + k  # saved from GPT2Model
        if k.endswith(_CONV1D):
            v = v.t()
        out[k] = v.contiguous()
    return out


def state_dict_to_hf(model: GPT) -> dict:
    """Our weights as GPT2LMHeadModel stores them (lm_head omitted: it is the tied wte)."""
    config_to_hf(model.config)
    return {
        k: (v.t() if k.endswith(_CONV1D) else v)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }


def save_hf(model: GPT, folder, safe_serialization: bool = True) -> Path:
    """Write a folder ``transformers.GPT2LMHeadModel.from_pretrained`` (and load_model) can read."""
    folder = Path(folder)
    hf_config = config_to_hf(model.config)
    state = state_dict_to_hf(model)
    if safe_serialization:
        _write_safetensors(folder / "model.safetensors", state, metadata={"format": "pt"})
    else:
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        atomic_write(folder / "pytorch_model.bin", lambda tmp: torch.save(tensors, tmp))
    _write_json(folder / "config.json", hf_config)
    return folder


def load_hf(folder, **overrides) -> GPT:
    folder = Path(folder)
    try:
        config = config_from_hf(read_json_object(folder / "config.json"))
    except (ValueError, TypeError) as e:
        message = str(e)
        if str(folder) not in message:
            raise type(e)(f"{folder / 'config.json'}: {message}") from None
        raise
    config = _apply_overrides(config, overrides)
    state = state_dict_from_hf(_read_tensors(_weights_file(folder)))
    return _build(config, state, f"Hugging Face weights in {folder}")


# -- nanoGPT ----------------------------------------------------------------------------------

def load_nanogpt(path, **overrides) -> GPT:
    """A nanoGPT ``ckpt.pt`` ({'model': state dict, 'model_args': {...}, ...}), read with weights_only."""
    path = Path(path)
    ckpt = _torch_load(path, "a nanoGPT checkpoint")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise ValueError(f"{path} is not a nanoGPT checkpoint (a dict with 'model' and 'model_args')")
    args = dict(ckpt["model_args"])
    args.setdefault("gelu_approximate", "none")  # nanoGPT's nn.GELU() is the exact erf one
    config = _apply_overrides(GPTConfig.from_dict(args), overrides)
    state = {
        k: v for k, v in ckpt["model"].items()
        if not k.endswith(".attn.bias")  # causal-mask buffer of nanoGPT's non-flash path
    }
    return _build(config, state, f"nanoGPT checkpoint {path}")


# -- lintrans checkpoint folders -----------------------------------------------------------

def read_json_object(path: Path) -> dict:
    """A JSON file holding an object; ValueError naming the file otherwise."""
    try:
        obj = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _lintrans_config(cfg: dict) -> Optional[dict]:
    """The GPTConfig dict inside a lintrans config.json, or None if it is not one."""
    for key in ("model", "model_config", "gpt_config"):
        if isinstance(cfg.get(key), dict):
            return cfg[key]
    # a flat GPTConfig; a Hugging Face GPT-2 config also has n_layer, and n_positions, even without model_type
    return cfg if "n_layer" in cfg and "model_type" not in cfg and "n_positions" not in cfg else None


def save_model(model: GPT, folder, extra_config: Optional[dict] = None, state: Optional[dict] = None) -> Path:
    """Write ``folder/model.safetensors`` + ``folder/config.json`` ({"model": GPTConfig dict, ...extra}).

    ``state``: the weights to write instead of ``model.state_dict()`` (a sharded model's, gathered whole)."""
    folder = Path(folder)
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd model saves its plain names
    state = model.state_dict() if state is None else state
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied to wte
    # each file is written atomically, the pair is not: one id in both lets a load tell a pair from two
    # saves (a save killed between its files, over an older one) instead of building the wrong model
    save_id = uuid.uuid4().hex
    _write_safetensors(folder / "model.safetensors", state,
                       metadata={"format": "pt", "lintrans": "gpt", "save_id": save_id})
    _write_json(folder / "config.json", {**(extra_config or {}), "model": model.config.to_dict(), "save_id": save_id,
                                         "lintrans_format": MODEL_FORMAT})
    return folder


# The layout of a saved model (config.json + model.safetensors). Raised when a save changes in a way an older
# lintrans would misread; a load refuses a higher one by name (an unknown key would be its only hint otherwise).
# Saves without it (before 2026-11-27) are format 1.
MODEL_FORMAT = 1


def check_model_format(path: Path, cfg: dict) -> None:
    """ValueError where the config.json in folder ``path`` is of a later save format than MODEL_FORMAT."""
    fmt = cfg.get("lintrans_format", 1)
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise ValueError(f"{path / 'config.json'}: lintrans_format must be an int >= 1, got {fmt!r}")
    if fmt > MODEL_FORMAT:
        raise ValueError(f"{path / 'config.json'} was written by a newer lintrans (model format {fmt}; this one "
                         f"reads up to {MODEL_FORMAT}): upgrade lintrans to load it")


def _check_same_save(folder: Path, cfg: dict) -> None:
    """ValueError where config.json and model.safetensors name different saves (see save_model)."""
    weights = folder / "model.safetensors"
    if "save_id" not in cfg or not weights.is_file():  # saved before the id existed, or no such file
        return
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            theirs = (f.metadata() or {}).get("save_id")
    except Exception:  # a damaged file: the read of the tensors reports it
        return
    if theirs != cfg["save_id"]:
        raise ValueError(f"{folder}: model.safetensors and config.json come from different saves (one was "
                         "interrupted between its two files); save the model again")


def load_model(path, **overrides) -> GPT:
    """Load a lintrans checkpoint folder, a Hugging Face GPT-2 folder or a nanoGPT ``.pt`` file."""
    path = Path(path)
    if path.is_file():
        if path.name == "config.json":
            return load_model(path.parent, **overrides)
        if path.suffix in (".pt", ".pth", ".ckpt"):
            return load_nanogpt(path, **overrides)
        raise ValueError(f"{path}: expected a checkpoint folder or a nanoGPT .pt file")
    if not path.is_dir() and path.with_name(path.name + ".old").is_dir():
        path = path.with_name(path.name + ".old")  # a save was stopped between its two renames
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (path / "config.json").is_file():
        if (path / "ckpt.pt").is_file():
            return load_nanogpt(path / "ckpt.pt", **overrides)
        hint = ""
        # a training run's out_dir holds its checkpoint one level down (train/checkpoint.py's layout)
        for name in ("checkpoint", "checkpoint.old"):
            if (path / name / "config.json").is_file():
                hint = f"; it looks like a training run's folder: its checkpoint is {path / name}"
                break
        raise FileNotFoundError(f"{path} has neither config.json (lintrans / Hugging Face) nor ckpt.pt (nanoGPT)"
                                + hint)
    cfg = read_json_object(path / "config.json")
    inner = _lintrans_config(cfg)
    if inner is None:
        return load_hf(path, **overrides)
    check_model_format(path, cfg)
    _check_same_save(path, cfg)
    try:
        config = GPTConfig.from_dict(inner)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    saved_attention, saved_options = config.attention, config.attention_options
    config = _apply_overrides(config, overrides)
    return _build(config, _read_tensors(_weights_file(path)), f"lintrans checkpoint {path}", saved_attention,
                  saved_options)


# -- the local Hugging Face cache ----------------------------------------------------------

def hf_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache is, by the same variables huggingface_hub reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return [Path(os.environ["HUGGINGFACE_HUB_CACHE"])]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]) / "hub"]
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return [Path(xdg) / "huggingface" / "hub"]


def find_in_hf_cache(name: str) -> tuple[Optional[Path], list[Path]]:
    """(snapshot folder holding config.json and weights, or None; the folders looked in)."""
    looked = []
    for cache in hf_cache_dirs():
        repo = cache / ("models--" + name.replace("/", "--"))
        looked.append(repo / "snapshots")
        snaps = []
        ref = repo / "refs" / "main"
        if ref.is_file():
            snaps.append(repo / "snapshots" / ref.read_text().strip())
        if (repo / "snapshots").is_dir():
            snaps += sorted((repo / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for snap in snaps:
            if (snap / "config.json").is_file() and any((snap / f).is_file() for f in WEIGHT_FILES):
                return snap, looked
    return None, looked


def trained_tokenizer(name_or_path) -> Optional[str]:
    """The tokenizer weights were trained with, where their folder says so: a lintrans checkpoint's
    config.json names it; a Hugging Face GPT-2 config (model_type gpt2, 50257 tokens or more) is
    GPT-2's, and so is a nanoGPT ``ckpt.pt`` with 50257 tokens or more (nanoGPT's own rule: GPT-2's
    encoding unless its data folder has a ``meta.pkl``, whose character vocabularies are far smaller).
    None where it is not known (a smaller nanoGPT vocabulary, another model type, no such path)."""
    from lintrans.tokenizer import TOKENIZERS

    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if Path(str(path) + ".old").is_dir():
            path = Path(str(path) + ".old")  # a save stopped between its two renames: what load_model reads too
        else:
            text = os.fspath(name_or_path)
            if text.startswith(("/", ".", "~")):
                return None
            path = find_in_hf_cache(text)[0]
            if path is None:
                return None
    config = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config.is_file() and (path / "ckpt.pt").is_file():
        config = path / "ckpt.pt"  # load_model's nanoGPT folder
    if config.suffix in (".pt", ".pth", ".ckpt") and config.is_file():
        return _nanogpt_tokenizer(config)
    if config.name != "config.json" or not config.is_file():
        return None
    try:
        d = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    if d.get("tokenizer") in TOKENIZERS:
        return d["tokenizer"]
    vocab = d.get("vocab_size", 50257)  # transformers' GPT2Config defaults
    if _lintrans_config(d) is None and d.get("model_type", "gpt2") == "gpt2" and isinstance(vocab, int) and vocab >= 50257:
        return "gpt2"  # what load_model reads as a Hugging Face GPT-2
    return None


def _nanogpt_tokenizer(path: Path) -> Optional[str]:
    """"gpt2" for a nanoGPT checkpoint of 50257 tokens or more (its model_args read through a memory
    map: the weights are not read), else None."""
    try:
        args = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True).get("model_args")
    except Exception:  # not a zip checkpoint, not a dict, refused: unknown, and load_model says why
        return None
    vocab = args.get("vocab_size") if isinstance(args, dict) else None
    return "gpt2" if isinstance(vocab, int) and vocab >= 50257 else None


def from_pretrained(name_or_path: str = "gpt2", **overrides) -> GPT:
    """A local folder/file, or a model name found in the local Hugging Face cache; never downloads."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a model name or a path, got {type(name_or_path).__name__}")
    path = Path(name_or_path).expanduser()
    if path.exists():
        return load_model(path, **overrides)
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or text.startswith(("/", ".", "~")):
        # plainly a path (a hub name is "name" or "org/name"): say so instead of searching the cache for it
        raise FileNotFoundError(f"name_or_path {text!r}: no such file or folder (a local path; a model in the "
                                "Hugging Face cache is named 'name' or 'org/name')")
    snap, looked = find_in_hf_cache(str(name_or_path))
    if snap is None:
        raise FileNotFoundError(
            f"{name_or_path!r} is not a local path and is not in the Hugging Face cache; looked in "
            f"{[str(p) for p in looked]} (set HF_HUB_CACHE or HF_HOME to point elsewhere). "
            "lintrans never downloads: fetch it once elsewhere (e.g. `huggingface-cli download "
            f"{name_or_path}`) or pass a folder with config.json and model.safetensors."
        )
    return load_hf(snap, **overrides)
