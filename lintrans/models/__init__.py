"""GPT-2 with swappable attention, weight import/export and constant-memory generation."""
from .config import GPTConfig
from .gpt import GPT, GenerationCache, cache_nbytes

__all__ = ["GPT", "GPTConfig", "GenerationCache", "cache_nbytes", "load_model", "save_model"]


def __getattr__(name):  # weight I/O imported on first use
    if name in ("load_model", "save_model"):
        from . import hf

        return getattr(hf, name)
    raise AttributeError(name)
