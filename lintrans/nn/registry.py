"""Attention mechanisms by name, for the GPT config's ``attention`` field.

Every attention layer is an ``nn.Module`` built as ``cls(config)`` from a ``GPTConfig`` (it reads
n_embd, n_head, n_kv_head, bias, dropout, block_size and ``config.attention_options``) with

    forward(x [B, T, C], cache=None, use_cache=False) -> (y [B, T, C], new_cache or None)

Each layer class names the dataclass of its ``attention_options`` as ``Options`` (typed keys with
defaults; ``attention_options(name)`` returns it), so options are checked per mechanism wherever
they come from (a TOML ``[model.attention_options]`` table, ``--set model.attention_options.x=...``,
a checkpoint's config.json).

``cache`` is whatever the layer returned for the tokens before ``x`` (a KV cache, a recurrent
state, a ring buffer); with ``use_cache=True`` the layer returns the cache covering ``x`` too, so
prefill is one call on the prompt and decoding is one call per token. A layer that cannot decode
incrementally raises NotImplementedError naming itself when ``use_cache=True``.
"""
from __future__ import annotations

import dataclasses
import importlib

from lintrans.checks import check_choice

_REGISTRY: dict[str, type] = {}
# modules that register mechanisms when imported; imported lazily so the core stays light
_PROVIDERS = ("lintrans.nn.attention", "lintrans.nn.gated", "lintrans.nn.aft", "lintrans.nn.sliding_window",
              "lintrans.nn.cosformer", "lintrans.nn.bigbird", "lintrans.nn.reformer",
              "lintrans.nn.delta")


def register_attention(name: str):
    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} registered twice")
        if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
            raise TypeError(f"attention {name!r}: {cls.__name__}.Options must be the dataclass of its options")
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_providers() -> None:
    for mod in _PROVIDERS:
        importlib.import_module(mod)


def available_attention() -> list[str]:
    _load_providers()
    return sorted(_REGISTRY)


def get_attention(name: str) -> type:
    _load_providers()
    check_choice("attention", name, sorted(_REGISTRY))
    return _REGISTRY[name]


def attention_options(name: str) -> type:
    """The options dataclass of attention ``name`` (its fields are the keys of ``attention_options``)."""
    return get_attention(name).Options


def check_attention(config) -> None:
    """The attention name and options of a GPTConfig, checked the way building the model checks them:
    one layer built on the meta device (no memory, no time). ValueError/TypeError as the model's."""
    import torch

    layer = get_attention(config.attention)
    try:
        with torch.device("meta"):
            layer(config)
    except (ValueError, TypeError):
        raise
    except Exception:  # a constructor that reads a value (meta tensors have none): one layer built for real
        layer(config)


def context_parallel_attention() -> list[str]:
    """Mechanisms that can split a sequence over processes (their class sets ``CONTEXT_PARALLEL``)."""
    _load_providers()
    return sorted(name for name, cls in _REGISTRY.items() if getattr(cls, "CONTEXT_PARALLEL", False))


def rope_attention() -> list[str]:
    """Mechanisms that take rotary position embeddings (their class sets ``ROPE``)."""
    _load_providers()
    return sorted(name for name, cls in _REGISTRY.items() if getattr(cls, "ROPE", False))
