"""GPT-2 with swappable attention, weight import/export and constant-memory generation."""
from .config import GPTConfig

__all__ = ["GPT", "GPTConfig", "GenerationCache", "cache_nbytes", "load_model", "save_model"]

# imported on first use, so that the config (and the cost model built on it) loads without torch
_LAZY = {"GPT": "gpt", "GenerationCache": "gpt", "cache_nbytes": "gpt", "load_model": "hf", "save_model": "hf"}


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
