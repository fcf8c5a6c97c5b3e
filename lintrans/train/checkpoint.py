"""Checkpoint folders: model + optimizer as safetensors, everything else as JSON, swapped in atomically.

Layout of ``OUT_DIR/checkpoint/`` (see docs/training.md):
  config.json          {"model": GPTConfig dict, "tokenizer": name}  (read by lintrans.models.load_model)
  model.safetensors    weights; the tied lm_head.weight is stored once, as transformer.wte.weight
  optimizer.safetensors AdamW state tensors named "<param index>.<name>" (exp_avg, exp_avg_sq, step)
  train_config.json    the resolved training config of the run
  trainer_state.json   step, tokens seen, optimizer param_groups, RNG and data-sampler states; written last

A new checkpoint is written to a temporary folder, then the old one is renamed to
``checkpoint.old``, the new one renamed into place and only then the old one deleted, so a kill at
any moment leaves a complete checkpoint (``find_checkpoint`` falls back to ``checkpoint.old``).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

FORMAT_VERSION = 1
CHECKPOINT_NAME = "checkpoint"
_FILES = ("config.json", "model.safetensors", "optimizer.safetensors", "train_config.json", "trainer_state.json")
_STATE_FIELDS = ("step", "tokens", "sampler", "rng", "optimizer")


def find_checkpoint(out_dir) -> Path | None:
    """The complete checkpoint folder in ``out_dir`` (the current one, else the one being replaced)."""
    for name in (CHECKPOINT_NAME, CHECKPOINT_NAME + ".old"):
        path = Path(out_dir) / name
        if (path / "trainer_state.json").is_file():
            return path
    return None


def save_checkpoint(out_dir, model, optimizer, trainer_state: dict, train_config: dict, extra_config: dict,
                    model_state: dict | None = None, optimizer_state: dict | None = None) -> Path:
    """Write the checkpoint of ``model`` (unwrapped, not DDP/compiled) and ``optimizer``; returns its path.

    ``model_state``, ``optimizer_state``: their state dicts when not their own (a sharded model's,
    gathered whole: ``lintrans.train.distributed.full_state_dicts``)."""
    from safetensors.torch import save_file

    from lintrans.models.hf import save_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final, old = out_dir / CHECKPOINT_NAME, out_dir / (CHECKPOINT_NAME + ".old")
    tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}.tmp-", dir=out_dir))
    try:
        save_model(model, tmp, extra_config=extra_config, state=model_state)
        tensors, opt_meta = _optimizer_to_flat(optimizer.state_dict() if optimizer_state is None else optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        _write_json(tmp / "train_config.json", train_config)
        _write_json(tmp / "trainer_state.json", {"format": FORMAT_VERSION, **trainer_state, "optimizer": opt_meta})
        _make_readable(tmp)
        for f in tmp.iterdir():  # the weights too, not only the JSON, are on disk before the rename
            _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_checkpoint(path) -> dict:
    """Everything but the tensors, checked for completeness: {"config", "train_config", "trainer_state"}."""
    path = Path(path)
    missing = [f for f in _FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: missing {missing}")
    out = {}
    for key, name in (("config", "config.json"), ("train_config", "train_config.json"), ("trainer_state", "trainer_state.json")):
        try:
            out[key] = json.loads((path / name).read_text())
        except ValueError as e:
            raise ValueError(f"checkpoint {path} is damaged: {name} is not valid JSON ({e})") from None
    for key, name in (("config", "config.json"), ("train_config", "train_config.json"), ("trainer_state", "trainer_state.json")):
        if not isinstance(out[key], dict):
            raise ValueError(f"checkpoint {path} is damaged: {name} must hold a JSON object")
    version = out["trainer_state"].get("format")
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {version!r}; this lintrans reads format {FORMAT_VERSION}")
    from lintrans.models.hf import check_model_format

    check_model_format(path, out["config"])  # the model's own save format (config.json's lintrans_format)
    for key, name, fields in (("trainer_state", "trainer_state.json", _STATE_FIELDS), ("config", "config.json", ("model",))):
        missing = [f for f in fields if f not in out[key]]
        if missing:
            raise ValueError(f"checkpoint {path} is damaged: {name} lacks {missing}")
    return out


def remove_abandoned(out_dir) -> list[Path]:
    """Delete the temporary folders of saves that were killed before their rename (each a full
    checkpoint's worth of disk); returns what was removed."""
    gone = sorted(Path(out_dir).glob(f".{CHECKPOINT_NAME}.tmp-*"))
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def load_weights(path, model, optimizer=None) -> None:
    """Copy the checkpoint's model tensors into ``model`` and, if given, its optimizer state into ``optimizer``."""
    from lintrans.models.hf import load_state_dict_checked

    path = Path(path)
    load_state_dict_checked(model, _load_tensors(path, "model.safetensors"), source=f"checkpoint {path}")
    if optimizer is not None:
        load_optimizer(path, optimizer)


def load_optimizer(path, optimizer, load=None) -> None:
    """The checkpoint's optimizer state into ``optimizer``, by ``load(state_dict)`` where
    ``optimizer.load_state_dict`` cannot (a sharded model's: ``distributed.load_sharded_optimizer``)."""
    path = Path(path)
    opt_tensors = _load_tensors(path, "optimizer.safetensors")
    meta = read_checkpoint(path)["trainer_state"]["optimizer"]
    # how this optimizer runs on this device (fused or foreach kernels), chosen when it was built: a state
    # saved on another device would otherwise bring its own choice (a CPU save runs unfused on CUDA)
    # (set in the state before it loads: torch places each state's step by the loaded groups' flags)
    how = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    state = _optimizer_from_flat(opt_tensors, meta)
    for group, kept in zip(state.get("param_groups", []), how):
        group.update(kept)
    try:
        (load or optimizer.load_state_dict)(state)
    except (ValueError, KeyError) as e:
        raise ValueError(f"optimizer state in checkpoint {path} does not match this model: {e}") from None


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _load_tensors(path: Path, name: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path / name), device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"checkpoint {path} is damaged: {e}") from None


def _optimizer_to_flat(sd: dict) -> tuple[dict, dict]:
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(tensors: dict, meta: dict) -> dict:
    state: dict = {}
    for key, value in list(tensors.items()) + list(meta.get("scalars", {}).items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> dict:
    """This process's torch RNG states (CPU and, if present, CUDA) as JSON-safe strings."""
    out = {"torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_unb64(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _write_json(path: Path, obj) -> None:
    """Into the temporary folder only: save_checkpoint fsyncs every file before the rename."""
    path.write_text(json.dumps(obj, indent=1) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries; give the checkpoint the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds (Windows)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
