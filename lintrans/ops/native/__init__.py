"""Fused CPU kernels (C++/OpenMP), built on first use with the system's C++ compiler; every op that
uses them keeps its pure-PyTorch path, which runs whenever they cannot be had.

Why: on a CPU the chunked form's matmuls are small (a chunk by a head dimension), and in eager
PyTorch each block of chunks costs ~60 kernels of element-wise work around them, each a parallel
region that waits for every thread. A kernel that walks one head's chunks in a single thread, with
the element-wise work fused into loops over data in cache and the matmuls as direct BLAS calls,
runs one parallel region per call (over batch x heads). See docs/benchmarks.md ("Native kernels").

The library is compiled once per source, compiler flags, torch build and CPU into
``$LINTRANS_NATIVE_DIR`` (default: ``native/`` in lintrans's cache directory, ``~/.cache/lintrans``), linked against torch's own BLAS
(``sgemm_``/``dgemm_`` exported by libtorch_cpu) and its OpenMP runtime, and loaded with ctypes.
``LINTRANS_NATIVE=0`` turns it off; a missing compiler or a failed build warns once and falls back.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from lintrans._platform import cache_dir, cpu_model

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def enabled() -> bool:
    return os.environ.get("LINTRANS_NATIVE", "1") not in ("0", "false", "no", "off")


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code is only for CPUs that have them all."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def library_path() -> Path:
    """Where the library for these sources, flags, torch and CPU is (or will be) built."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(torch.__version__.encode())
    h.update((cpu_model() + _cpu_flags()).encode())
    root = Path(os.environ.get("LINTRANS_NATIVE_DIR") or cache_dir() / "native")
    return root / f"liblintrans-{h.hexdigest()[:16]}.so"


def build(verbose: bool = False) -> Path:
    """Compile the library (atomically: to a temporary file, then renamed); returns its path."""
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [os.environ.get("CXX", "c++"), *FLAGS, *map(str, SOURCES), "-o", tmp,
           f"-L{torch_lib}", "-ltorch_cpu", "-lc10", "-lmvec", f"-Wl,-rpath,{torch_lib}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building lintrans's native kernels failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@torch.compiler.disable  # found once, outside any graph torch.compile traces
def library() -> Optional[ctypes.CDLL]:
    """The loaded library, building it on first use; None when off or unavailable (warned once)."""
    global _lib, _tried
    if _lib is not None or _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if not enabled() or not SOURCES:
            return None
        try:
            _lib = ctypes.CDLL(str(build()))
        except Exception as e:  # no compiler, no BLAS symbols, ...: the PyTorch path stays
            warnings.warn(f"lintrans: native CPU kernels unavailable, using the PyTorch path ({e})", RuntimeWarning)
            _lib = None
    return _lib


def available() -> bool:
    return library() is not None


def active() -> bool:
    """Whether the kernels run now: turned on (``LINTRANS_NATIVE``) and built (here, on first use).
    Both, since a library loaded earlier stays loaded after ``LINTRANS_NATIVE=0``."""
    return enabled() and available()
