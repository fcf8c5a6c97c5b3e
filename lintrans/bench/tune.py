"""``lintrans tune``: measure and cache the fastest chunk size (the tuning itself, shared with
``chunk_size="auto"``, is ``lintrans.ops.chunk_tuning``)."""
from __future__ import annotations

import argparse
import sys

import torch

from lintrans.checks import check_positive_int
from lintrans.ops.chunk_tuning import (cache_file, cache_key, load_cache, store, t_bucket, tune_chunk_size, tuned_dtype,
                                       valid_entry)

from .sizes import feature_dim_of


# -- lintrans tune ------------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384], help="context lengths to tune for (default 1024 4096 16384)")
    p.add_argument("--head-dim", type=int, default=64, help="D of q, k and v (default 64)")
    p.add_argument("--feature-map", default="elu", help="a feature map name (sets the feature dimension; default elu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="dtype of q, k, v (default float32)")
    p.add_argument("--device", default="cpu", help="cpu (default), auto, cuda or cuda:N")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    p.add_argument("--gated", action="store_true", help="tune for gated attention (a log_decay on the state)")


def run(args) -> int:
    from lintrans.train.distributed import resolve_device

    dtype = getattr(torch, args.dtype)
    try:
        args.device = str(resolve_device(args.device, what="--device"))
        for T in args.T:
            check_positive_int("every --T", T)
        check_positive_int("--head-dim", args.head_dim)
    except ValueError as e:
        print(f"lintrans tune: {e}", file=sys.stderr)
        return 2
    try:
        F = feature_dim_of(args.feature_map, args.head_dim)
    except (ValueError, TypeError) as e:
        print(f"lintrans tune: --feature-map: {e}", file=sys.stderr)
        return 2
    if tuned_dtype(dtype, args.device) != dtype:  # tuning the dtype nothing looks up would be wasted
        print(f"{args.dtype} inputs are computed in float32: tuning for float32", file=sys.stderr)
        dtype = tuned_dtype(dtype, args.device)
    print(f"cache: {cache_file()}")
    print(f"{'T bucket':>9} {'best':>5}  seconds per forward+backward by chunk size")
    for T in args.T:
        key = cache_key(args.device, dtype, args.head_dim, F, T, args.gated)
        entry = None if args.force else load_cache().get(key)
        if not valid_entry(entry):  # none yet, or hand-edited or foreign: measured
            entry = store(key, *tune_chunk_size(T, args.head_dim, F, dtype, args.device, gated=args.gated))
            note = ""
        else:
            note = " (cached)"
        cells = "  ".join(f"{c}:{float(s):.4f}" for c, s in sorted(entry["seconds"].items(), key=lambda cs: int(cs[0])))
        print(f"{t_bucket(T):>9} {entry['chunk_size']:>5}  {cells}{note}")
    return 0
