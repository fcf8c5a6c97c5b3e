"""Where lintrans keeps its caches, and which CPU it runs on (torch-free, imported by ops and bench)."""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """``$LINTRANS_CACHE_DIR``, else ``$XDG_CACHE_HOME/lintrans``, else ``~/.cache/lintrans``."""
    root = os.environ.get("LINTRANS_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lintrans"


@functools.lru_cache(maxsize=None)  # read once: looked up on every op call that tunes its chunk
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# /proc/cpuinfo lines that say which instructions the CPU runs: x86 (vendor, family, model, flags)
# and ARM, whose cpuinfo has no "flags" or "model name" ("Features", "CPU implementer", "CPU part")
_IDENTITY_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU implementer",
                  "CPU architecture", "CPU variant", "CPU part")


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_identity(cpuinfo: str | None = None) -> str:
    """The first processor's identifying /proc/cpuinfo lines (``cpuinfo``: that file's text), one
    ``key: value`` per line; where there is no such file, ``platform``'s processor and machine."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    seen = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in _IDENTITY_KEYS and key not in seen:
            seen[key] = " ".join(value.split())
    if not seen:
        return f"{platform.processor()} {platform.machine()}"
    return "\n".join(f"{k}: {seen[k]}" for k in _IDENTITY_KEYS if k in seen)


VECTOR_FEATURES = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile",
                   "asimd", "sve", "sve2")


def cpu_vector_features(cpuinfo: str | None = None) -> str:
    """The CPU's vector extensions that matter to the kernels' speed (e.g. "avx2 fma avx512f ..."),
    from its flags (x86) or Features (ARM) line: figures from CPUs that differ here are not comparable."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    have = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            have = set(value.split())
            break
    return " ".join(x for x in VECTOR_FEATURES if x in have) or "unknown"
