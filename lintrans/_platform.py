"""Where lintrans keeps its caches, and which CPU it runs on (torch-free, imported by ops and bench)."""
from __future__ import annotations

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


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
