"""Fused CPU kernels (C++/OpenMP), built on first use with the system's C++ compiler; every op that
uses them keeps its pure-PyTorch path, which runs whenever they cannot be had.

Why: on a CPU the chunked form's matmuls are small (a chunk by a head dimension), and in eager
PyTorch each block of chunks costs ~60 kernels of element-wise work around them, each a parallel
region that waits for every thread. A kernel that walks one head's chunks in a single thread, with
the element-wise work fused into loops over data in cache and the matmuls as direct BLAS calls,
runs one parallel region per call (over batch x heads). See docs/native-kernels.md.

The library is compiled once per build key into ``$LINTRANS_NATIVE_DIR`` (default: ``native/`` in
lintrans's cache directory, ``~/.cache/lintrans``), linked against torch's own BLAS
(``sgemm_``/``dgemm_`` exported by libtorch_cpu) and its OpenMP runtime, and loaded with ctypes. The
key covers everything the binary depends on: the sources, the flags, the compiler and its version,
glibc and libstdc++, torch (version and library path) and the CPU (its model and feature flags, or on
ARM its ``Features`` and ``CPU part``), so a cache shared between machines never loads a library
built for another CPU. Builds take a file lock (several processes, e.g. torchrun ranks, build once),
write to a temporary file renamed into place, clean up what a killed build left, and prune old
libraries. A library that exists but does not load is rebuilt once.

``LINTRANS_NATIVE=0`` turns the kernels off; ``LINTRANS_NATIVE_MARCH`` (default ``native``) is the
``-march`` they are built for (e.g. ``x86-64-v3``: AVX2 and FMA, no AVX-512); ``LINTRANS_NATIVE_GEMM=blas``
builds them with torch's BLAS for every product (the default, ``auto``, has AVX2 builds without AVX-512
use their own loop for float products); a missing compiler or a failed build warns once and falls back.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import os
import shlex
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from lintrans._io import FileLock
from lintrans._platform import cache_dir, cpu_identity

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fno-trapping-math: without it GCC will not if-convert a loop whose select depends on a float
# comparison (x > 0 ? x + 1 : exp(x)) for targets without mask registers, so on AVX2 such loops
# stayed scalar with one libm call per element. It changes no result: nothing reads the FP
# exception flags. -fno-math-errno likewise lets the math calls be vector calls.
BASE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno", "-fno-trapping-math"]
# libraries kept in the cache directory besides the one in use (the most recently used)
KEEP_BUILDS = 8

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def enabled() -> bool:
    """``LINTRANS_NATIVE``: on unless 0, false, no or off; a value that is neither is an error, not a guess."""
    value = os.environ.get("LINTRANS_NATIVE", "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"LINTRANS_NATIVE={os.environ['LINTRANS_NATIVE']!r}: expected 1, true, yes or on (the fused CPU "
                     "kernels, the default) or 0, false, no or off (the PyTorch path)")


@contextlib.contextmanager
def disabled(off: bool = True):
    """The PyTorch paths for the calls inside (``LINTRANS_NATIVE=0``, read at each call), the variable as it
    was after; ``off=False``: nothing changed."""
    if not off:
        yield
        return
    before = os.environ.get("LINTRANS_NATIVE")
    os.environ["LINTRANS_NATIVE"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LINTRANS_NATIVE", None)
        else:
            os.environ["LINTRANS_NATIVE"] = before


def march() -> str:
    """The target of the build, ``-march=``: ``$LINTRANS_NATIVE_MARCH``, default ``native``."""
    value = os.environ.get("LINTRANS_NATIVE_MARCH", "").strip() or "native"
    if not all(c.isalnum() or c in "-_.=," for c in value):
        raise ValueError(f"LINTRANS_NATIVE_MARCH={value!r}: expected a -march value such as native or x86-64-v3")
    return value


def gemm_choice() -> str:
    """``$LINTRANS_NATIVE_GEMM``: ``auto`` (default: small_gemm.h's loop for float products where the build
    has AVX2 and FMA but not AVX-512, the BLAS elsewhere) or ``blas`` (torch's BLAS for every product)."""
    value = os.environ.get("LINTRANS_NATIVE_GEMM", "").strip().lower() or "auto"
    if value not in ("auto", "blas"):
        raise ValueError(f"LINTRANS_NATIVE_GEMM={os.environ['LINTRANS_NATIVE_GEMM']!r}: expected auto (the default) "
                         "or blas (torch's BLAS for every product of the kernels)")
    return value


def flags() -> list:
    return [*BASE_FLAGS, f"-march={march()}", *(["-DLINTRANS_BLAS_ONLY"] if gemm_choice() == "blas" else [])]


def compiler() -> tuple:
    """The compiler command: $CXX split as a shell would (e.g. "ccache g++"), else c++."""
    return tuple(shlex.split(os.environ.get("CXX", ""))) or ("c++",)


def _output_of(cmd) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout if res.returncode == 0 else ""


@functools.lru_cache(maxsize=8)
def _toolchain(cxx: tuple) -> str:
    """The compiler (its path and ``--version``), the C++ runtime it links (libstdc++'s real file
    name carries its version) and glibc's version."""
    libstdcxx = _output_of([*cxx, "-print-file-name=libstdc++.so"]).strip()
    libstdcxx = os.path.realpath(libstdcxx) if os.path.isabs(libstdcxx) else libstdcxx
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""
    return "\n".join([" ".join(shutil.which(c) or c for c in cxx), _output_of([*cxx, "--version"]), libstdcxx,
                      libc or " ".join(platform.libc_ver())])


def _torch_lib() -> Path:
    return Path(torch.__file__).parent / "lib"


def build_key() -> str:
    """What the binary depends on, as text (hashed into its file name)."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    cxx = compiler()
    parts = [" ".join(flags()), _toolchain(cxx), torch.__version__, str(_torch_lib().resolve()), cpu_identity(),
             platform.machine()]
    return h.hexdigest() + "\n" + "\n--\n".join(parts)


def library_path() -> Path:
    """Where the library for this build key is (or will be) built."""
    digest = hashlib.sha256(build_key().encode()).hexdigest()[:16]
    root = Path(os.environ.get("LINTRANS_NATIVE_DIR") or cache_dir() / "native")
    return root / f"liblintrans-{digest}.so"


TMP_PREFIX = "tmp-build-"
LOCK_NAME = ".build.lock"


def _clean_and_prune(root: Path, keep: Path) -> None:
    """With the build lock held: remove temporary files of builds that died (none runs now), and
    libraries beyond the KEEP_BUILDS most recently used."""
    for tmp in glob.glob(str(root / f"{TMP_PREFIX}*")):
        try:
            os.remove(tmp)
        except OSError:
            pass
    libs = []
    for p in root.glob("liblintrans-*.so"):
        if p != keep:
            try:
                libs.append((p.stat().st_mtime, p))
            except OSError:
                pass
    for _, p in sorted(libs, reverse=True)[KEEP_BUILDS:]:
        try:
            p.unlink()  # a process that has it loaded keeps its mapping
        except OSError:
            pass


def _stat_id(path: Path):
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def build(verbose: bool = False, replace: Optional[tuple] = None) -> Path:
    """Compile the library unless it is there; returns its path. Under a file lock beside it, to a
    temporary file renamed into place. ``replace``: the ``(inode, size, mtime)`` of a library that
    failed to load, rebuilt unless another process has already replaced it."""
    out = library_path()
    if out.exists() and replace is None:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one lock for the directory: cleaning up temporary files and pruning touch every build's files
    with FileLock(out.parent / LOCK_NAME):
        current = _stat_id(out)
        if current is not None and (replace is None or current != replace):
            return out  # built (or rebuilt) by another process while this one waited
        _clean_and_prune(out.parent, out)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".so", dir=out.parent)
        os.close(fd)
        torch_lib = _torch_lib()
        cmd = [*compiler(), *flags(), *map(str, SOURCES), "-o", tmp,
               f"-L{torch_lib}", "-ltorch_cpu", "-lc10", "-lmvec", f"-Wl,-rpath,{torch_lib}"]
        try:
            try:
                res = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                raise RuntimeError(f"building lintrans's native kernels failed: {e}") from e
            if res.returncode != 0 or os.path.getsize(tmp) == 0:
                raise RuntimeError(f"building lintrans's native kernels failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep it from others sharing the cache
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return out


def _touch(path: Path) -> None:
    """Mark the library as used (pruning keeps the most recently used)."""
    try:
        os.utime(path)
    except OSError:  # a read-only or shared cache: the mark is only advice for pruning
        pass


def open_library(verbose: bool = False) -> ctypes.CDLL:
    """Build (if needed) and load the library. One that exists but does not load (truncated by a
    killed copy, overwritten, ...) is rebuilt once; a second failure raises."""
    path = build(verbose)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        path = build(verbose, replace=_stat_id(path) or (0, 0, 0))
        lib = ctypes.CDLL(str(path))
    _touch(path)
    return lib


def eager_only(fn):
    """``torch.compiler.disable(fn)`` (torch.compile runs ``fn`` eagerly, a graph break: it cannot trace
    a ctypes call), made only once torch._dynamo is loaded. Decorating at import would load it: as
    long again as importing torch, for every process, though only a compiling one needs it."""
    if "torch._dynamo" in sys.modules:  # loaded already: the plain decorator, and its own error messages
        return torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:  # then nothing can be compiling
            return fn(*args, **kwargs)
        disabled = fn.__dict__.get("_eager_only")
        if disabled is None:
            import torch._dynamo

            disabled = fn._eager_only = torch._dynamo.disable(fn, wrapping=False)
        return disabled(*args, **kwargs)

    return call


class LayoutError(RuntimeError):
    """A ctypes argument struct disagrees with the C side's (the bindings and the sources out of step)."""


@eager_only  # found once, outside any graph torch.compile traces
def library() -> Optional[ctypes.CDLL]:
    """The loaded library, building it on first use; None when off or unavailable (warned once)."""
    global _lib, _tried
    if _lib is not None or _tried:
        return _lib
    if not enabled() or not SOURCES:  # not _tried: turned on again later in this process, it builds then
        return None
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            _lib = open_library()
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
