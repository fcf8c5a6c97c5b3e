"""Chunk size by measurement: ``chunk_size="auto"`` and ``lintrans tune``.

The chunked form's forward + backward is timed for each candidate chunk size on random features
of the call's shape class, and the fastest is kept in a JSON cache on disk keyed by (device,
dtype, head dim, feature dim, T bucket, gated or not: a decay adds work per [c, c] block, so
gated attention prefers smaller chunks), so a second run, in this process or a later one, pays
nothing. The cache lives in ``$LINTRANS_CACHE_DIR`` (default ``~/.cache/lintrans``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
import torch

from lintrans._io import atomic_write_text

CANDIDATES = (32, 64, 128, 256)  # 16 and 512 lost at every T tried on this CPU; fewer = cheaper
MAX_BUCKET = 16384  # longer contexts reuse the 16k choice: the best chunk stops depending on T
TUNE_HEADS = 8  # heads used while tuning (the key leaves H out: it scales every candidate alike)
_memo: dict[str, int] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("LINTRANS_CACHE_DIR") or Path.home() / ".cache" / "lintrans")


def cache_file() -> Path:
    return cache_dir() / "chunk_size.json"


def t_bucket(T: int) -> int:
    """The power of two >= T (at least 64, at most MAX_BUCKET): contexts that share a best chunk."""
    return min(MAX_BUCKET, max(64, 1 << max(0, math.ceil(math.log2(T)))))


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        from .machine import cpu_model

        return f"cpu:{cpu_model()}:{torch.get_num_threads()}threads"
    return device.type


def cache_key(device, dtype: torch.dtype, head_dim: int, feature_dim: int, T: int, gated: bool = False) -> str:
    key = f"{device_name(device)}|{str(dtype).replace('torch.', '')}|D{head_dim}|F{feature_dim}|T{t_bucket(T)}"
    return key + ("|gated" if gated else "")


def _load() -> dict:
    try:
        with open(cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(key: str, entry: dict) -> None:
    """Merge one entry into the cache file, atomically (write a temp file, then rename)."""
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _load()
    data[key] = entry
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))


def measure_candidate(chunk: int, fq, fk, v, S0, repeats: int = 3, ld=None) -> float:
    """Seconds of the chunked form's forward + backward at this chunk size: the fastest repeat,
    since interference only adds time (see measure.py)."""
    from lintrans.ops.linear import FORMS

    from .measure import time_step

    def step():
        for x in (fq, fk, v, ld):
            if x is not None:
                x.grad = None
        y, _ = FORMS["chunked"](fq, fk, v, S0, chunk, ld)
        y.sum().backward()

    step()  # warm-up
    return min(time_step(step, device=fq.device.type) for _ in range(repeats))


def tune_chunk_size(T: int, head_dim: int, feature_dim: int, dtype=torch.float32, device="cpu",
                    candidates=CANDIDATES, repeats: int = 2, gated: bool = False) -> tuple[int, dict[int, float]]:
    """Time every candidate (<= the T bucket) and return (fastest, {chunk: seconds})."""
    Tb = t_bucket(T)
    cands = [c for c in candidates if c <= Tb] or [min(candidates)]
    g = torch.Generator().manual_seed(0)
    shape = (1, TUNE_HEADS, Tb)
    # what the chunked form sees: positive features (the cost does not depend on values) and v + ones column
    fq, fk = (torch.rand(*shape, feature_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    v = torch.randn(*shape, head_dim + 1, generator=g).to(device, dtype).requires_grad_()
    S0 = torch.zeros(1, TUNE_HEADS, feature_dim, head_dim + 1, dtype=dtype, device=device)
    ld = -torch.rand(*shape, generator=g).to(device, dtype).requires_grad_() if gated else None  # [1,H,T]
    with torch.enable_grad():
        timings = {c: measure_candidate(c, fq, fk, v, S0, repeats, ld=ld) for c in cands}
    return min(timings, key=timings.get), timings


def auto_chunk_size(T: int, head_dim: int, feature_dim: int, dtype=torch.float32, device="cpu",
                    gated: bool = False) -> int:
    """The cached fastest chunk size for this shape class (with a decay when ``gated``); measured
    (and cached) on first use."""
    dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) and torch.device(device).type == "cpu" else dtype
    key = cache_key(device, dtype, head_dim, feature_dim, T, gated)
    if key in _memo:
        return _memo[key]
    entry = _load().get(key)
    if not (isinstance(entry, dict) and isinstance(entry.get("chunk_size"), int) and entry["chunk_size"] >= 1):
        best, timings = tune_chunk_size(T, head_dim, feature_dim, dtype, device, gated=gated)
        entry = {"chunk_size": best, "seconds": {str(c): s for c, s in timings.items()}}
        _save(key, entry)
    _memo[key] = entry["chunk_size"]
    return _memo[key]


def feature_dim_of(feature_map, head_dim: int) -> int:
    from lintrans.ops import resolve_feature_map

    phi_q, _ = resolve_feature_map(feature_map)
    return phi_q(torch.zeros(1, head_dim)).shape[-1]


# -- lintrans tune ------------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384], help="context lengths to tune for")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--feature-map", default="elu", help="a feature map name (sets the feature dimension)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    p.add_argument("--gated", action="store_true", help="tune for gated attention (a log_decay on the state)")


def run(args) -> int:
    dtype = getattr(torch, args.dtype)
    if min(args.T) < 1 or args.head_dim < 1:
        print(f"lintrans tune: --T and --head-dim must be >= 1, got --T {args.T} --head-dim {args.head_dim}",
              file=sys.stderr)
        return 2
    try:
        F = feature_dim_of(args.feature_map, args.head_dim)
    except (ValueError, TypeError) as e:
        print(f"lintrans tune: --feature-map: {e}", file=sys.stderr)
        return 2
    print(f"cache: {cache_file()}")
    print(f"{'T bucket':>9} {'best':>5}  seconds per forward+backward by chunk size")
    for T in args.T:
        key = cache_key(args.device, dtype, args.head_dim, F, T, args.gated)
        entry = None if args.force else _load().get(key)
        if entry is None:
            best, timings = tune_chunk_size(T, args.head_dim, F, dtype, args.device, gated=args.gated)
            entry = {"chunk_size": best, "seconds": {str(c): s for c, s in timings.items()}}
            _save(key, entry)
            _memo[key] = best
            note = ""
        else:
            note = " (cached)"
        cells = "  ".join(f"{c}:{float(s):.4f}" for c, s in entry["seconds"].items())
        print(f"{t_bucket(T):>9} {entry['chunk_size']:>5}  {cells}{note}")
    return 0
