"""Calls into glibc's math functions made by each op's forward + backward with each build of the
native kernels: scalar (one element per call) and vector (libmvec, several per call). Run under the
interposer libm_calls.so (see libm_calls.c), which counts them:

    cc -O2 -shared -fPIC -mavx512f -o /tmp/libm_calls.so libm_calls.c -ldl
    LD_PRELOAD=/tmp/libm_calls.so python scalar_calls.py native.so x86-64-v3.so ... --out scalar_calls.json

Each .so is a build of lintrans/ops/native (``LINTRANS_NATIVE_MARCH=... python -m lintrans.ops.native``
prints its path). The counts cover the whole op: torch's own element-wise code mostly uses SLEEF, not
libm, but not all of it (its softplus does call libm, so the gated op's gate is a leaf here)."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from lintrans.bench.machine import machine_info  # noqa: E402
from lintrans.ops import aft, linear_attention, native, sliding_window_attention  # noqa: E402

LD = None  # [1, T, H] log-decays, set in main

OPS = {
    "chunked elu": lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=64)[0],
    "chunked softplus": lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=64,
                                                         feature_map="softplus")[0],
    # the gate a leaf here (torch's softplus would add its own scalar libm calls to the count)
    "chunked gated": lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=64, log_decay=LD)[0],
    "aft simple": lambda q, k, v: aft(q, k, v, variant="simple"),
    "sliding window 256": lambda q, k, v: sliding_window_attention(q, k, v, window=256),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("builds", nargs="+")
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    counter = ctypes.CDLL(None)  # the preloaded interposer's lm_reset / lm_count
    if not hasattr(counter, "lm_count"):
        p.error("run under LD_PRELOAD=libm_calls.so (see libm_calls.c)")
    counter.lm_count.restype = ctypes.c_long
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.T, 8, 64, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(1, args.T, 8, 64, generator=g)
    global LD
    LD = (-torch.rand(1, args.T, 8, generator=g) / 16).requires_grad_()
    rows = []
    for path in args.builds:
        lib = ctypes.CDLL(str(Path(path).resolve()))
        native._lib, native._tried = lib, True
        for name, op in OPS.items():
            op(q, k, v).backward(do)  # warm-up
            counter.lm_reset()
            op(q, k, v).backward(do)
            row = {"build": Path(path).name, "op": name, "scalar_calls": counter.lm_count(0),
                   "vector_calls": counter.lm_count(1), "vector_lanes": counter.lm_count(2)}
            row["scalar_share_of_elements"] = round(
                row["scalar_calls"] / max(1, row["scalar_calls"] + row["vector_lanes"]), 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
            q.grad = k.grad = v.grad = None
    if args.out:
        Path(args.out).write_text(json.dumps({"T": args.T, "B": 1, "H": 8, "D": 64, "dtype": "float32",
                                              "machine": machine_info(), "ld_preload": os.environ.get("LD_PRELOAD"),
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
