"""Chunk size by measurement, behind ``linear_attention(..., chunk_size="auto")`` and ``lintrans tune``.

The public op's chunked form, forward + backward, is timed for each candidate chunk size on random
inputs of the call's shape class, and the fastest is kept in a JSON cache keyed by (device, dtype,
head dim, feature dim, T bucket, gated or not: a decay adds work per [c, c] block, so gated
attention prefers smaller chunks); a second call, in this process or a later one, pays nothing.
The cache is ``chunk_size.json`` in ``lintrans._platform.cache_dir()``.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from lintrans._io import FileLock, atomic_write_text
from lintrans._platform import cache_dir, cpu_model, cpu_vector_features

from . import native

CANDIDATES = (32, 64, 128, 256)  # 16 and 512 lost at every T tried on the benchmark CPU; fewer = cheaper
MAX_BUCKET = 16384  # longer contexts reuse the 16k choice: the best chunk stops depending on T
TUNE_HEADS = 8  # heads used while tuning (the key leaves H out: it scales every candidate alike)
_memo: dict[str, int] = {}


def cache_file() -> Path:
    return cache_dir() / "chunk_size.json"


def t_bucket(T: int) -> int:
    """The power of two >= T (at least 64, at most MAX_BUCKET): contexts that share a best chunk."""
    return min(MAX_BUCKET, max(64, 1 << max(0, math.ceil(math.log2(T)))))


def device_name(device, kernel: Optional[bool] = None) -> str:
    """The device, and on the CPU which path runs (``kernel``: the fused kernel, default: whether it is
    on), with torch's version: each changes which chunk is fastest."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}:torch{torch.__version__}"
    if device.type == "cpu":  # the fused kernel (ops/native) and the PyTorch blocks prefer different chunks
        path = ":native" if (native.active() if kernel is None else kernel) else ""
        # the vector features too: one model name covers CPUs with and without AVX-512 (cloud VMs),
        # whose best chunks differ, and a home folder may be shared between them
        features = cpu_vector_features().replace(" ", ",")
        return f"cpu:{cpu_model()}[{features}]:{torch.get_num_threads()}threads{path}:torch{torch.__version__}"
    return f"{device.type}:torch{torch.__version__}"


def cache_key(device, dtype: torch.dtype, head_dim: int, feature_dim: int, T: int, gated: bool = False,
              form: str = "chunked", kernel: Optional[bool] = None) -> str:
    key = (f"{device_name(device, kernel)}|{str(dtype).replace('torch.', '')}|D{head_dim}|F{feature_dim}"
           f"|T{t_bucket(T)}")
    return key + ("|gated" if gated else "") + ("" if form == "chunked" else f"|{form}")


def valid_entry(entry) -> bool:
    """A cache entry as ``store`` writes it (a hand-edited or foreign one is measured again)."""
    return (isinstance(entry, dict) and type(entry.get("chunk_size")) is int and entry["chunk_size"] in CANDIDATES
            and isinstance(entry.get("seconds"), dict))


def load_cache() -> dict:
    try:
        with open(cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_entry(key: str, entry: dict) -> None:
    """Merge one entry into the cache file, atomically (write a temp file, then rename), under a lock:
    processes tuning at once would otherwise each write back what they read, and drop the others'."""
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(path.name + ".lock")):
        data = load_cache()
        data[key] = entry
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_candidate(chunk: int, q, k, v, log_decay=None, repeats: int = 3, form: str = "chunked") -> float:
    """Seconds of ``linear_attention``'s ``form``, forward + backward, at this chunk size: the
    fastest repeat, since interference only adds time."""
    from .linear import linear_attention

    def step():
        for x in (q, k, v, log_decay):
            if x is not None:
                x.grad = None
        o, _ = linear_attention(q, k, v, form=form, chunk_size=chunk, feature_map="identity", log_decay=log_decay)
        o.sum().backward()

    step()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(q.device)
        t0 = time.perf_counter()
        step()
        _sync(q.device)
        times.append(time.perf_counter() - t0)
    return min(times)


def tune_chunk_size(T: int, head_dim: int, feature_dim: int, dtype=torch.float32, device="cpu",
                    candidates=CANDIDATES, repeats: int = 2, gated: bool = False, form: str = "chunked",
                    kernel: Optional[bool] = None) -> tuple[int, dict[int, float]]:
    """Time every candidate (<= the T bucket) on the path the call takes (``kernel`` False: the PyTorch
    blocks, where the fused kernel cannot run it) and return (fastest, {chunk: seconds})."""
    Tb = t_bucket(T)
    cands = [c for c in candidates if c <= Tb] or [min(candidates)]
    g = torch.Generator().manual_seed(0)
    shape = (1, Tb, TUNE_HEADS)
    # the first call may come from inside inference_mode or no_grad (a model's forward): the timed
    # forward + backward needs ordinary tensors and autograd
    with torch.inference_mode(False), torch.enable_grad():
        # positive q, k with the identity map stand for any map's features (the cost does not depend on values)
        q, k = (torch.rand(*shape, feature_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
        v = torch.randn(*shape, head_dim, generator=g).to(device, dtype).requires_grad_()
        ld = -torch.rand(*shape, generator=g).to(device, dtype).requires_grad_() if gated else None  # [1,T,H]
        # the kernel off where the call cannot take it: the stand-in inputs would take it otherwise
        with native.disabled(kernel is False and torch.device(device).type == "cpu"):
            timings = {c: measure_candidate(c, q, k, v, ld, repeats, form) for c in cands}
    return min(timings, key=timings.get), timings


def tuned_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype whose chunk size applies: the op computes 16-bit inputs in float32 (on every device), and
    looks its chunk up by that dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def auto_chunk_size(T: int, head_dim: int, feature_dim: int, dtype=torch.float32, device="cpu",
                    gated: bool = False, form: str = "chunked", kernel: Optional[bool] = None) -> int:
    """The cached fastest chunk size for this shape class (with a decay when ``gated``; of ``form``; on the
    path ``kernel`` says, default: the fused kernel where it is on); measured (and cached) on first use."""
    dtype = tuned_dtype(dtype, device)
    key = cache_key(device, dtype, head_dim, feature_dim, T, gated, form, kernel)
    if key in _memo:
        return _memo[key]
    entry = load_cache().get(key)
    if not valid_entry(entry):  # a hand-edited or foreign cache: measured again
        entry = store(key, *tune_chunk_size(T, head_dim, feature_dim, dtype, device, gated=gated, form=form,
                                            kernel=kernel))
    _memo[key] = entry["chunk_size"]
    return _memo[key]


def store(key: str, best: int, timings: dict[int, float]) -> dict:
    """Record a measurement in the cache file and this process's memo; returns the entry."""
    entry = {"chunk_size": best, "seconds": {str(c): s for c, s in timings.items()}}
    _memo[key] = best
    try:
        save_entry(key, entry)
    except OSError as e:  # a cache folder that cannot be written: this process keeps the value, the op runs
        warnings.warn(f"chunk_size='auto': the cache {cache_file()} cannot be written ({e}); the chunk measured "
                      "is kept for this process only", RuntimeWarning, stacklevel=2)
    return entry
