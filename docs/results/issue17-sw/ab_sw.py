"""Issue 17, sliding window: the previous op (SDPA over gathered key blocks), the block-by-block op
and the chunked linear op, side by side in one plain Python process (A B C A B C ..., fastest of N).

    THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=. python docs/results/issue17-sw/ab_sw.py --threads 2 --T 4096 16384
    THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=. python docs/results/issue17-sw/ab_sw.py --threads 1 --T 4096 16384

fwd + bwd, B=1, H=8, D=64, float32, window 256, chunked with chunk 64 and elu features. Wall time
with the given threads; with --threads 1 the process CPU time (the work itself, on a shared machine).
The previous op is read from git (--old-rev, the commit before the block-by-block op).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from lintrans.ops.linear import linear_attention
from lintrans.ops.sliding_window import sliding_window_attention


def old_op(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:lintrans/ops/sliding_window.py"], check=True,
                         capture_output=True, text=True).stdout.replace("from .", "from lintrans.ops.")
    path = os.path.join(tempfile.mkdtemp(), "old_sliding_window.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_sliding_window", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sliding_window_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--old-rounds", type=int, default=3, help="rounds of the (slow) previous op")
    ap.add_argument("--old-rev", default="8197525")
    ap.add_argument("--out", default=None, help="append one JSON line per T here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    old = old_op(a.old_rev)
    ops = {"linear chunked": lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=64)[0],
           "sliding window 256 (block by block)": lambda q, k, v: sliding_window_attention(q, k, v, window=256),
           "sliding window 256 (previous)": lambda q, k, v: old(q, k, v, window=256)}
    for T in a.T:
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, T, 8, 64, generator=g) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        wall, cpu = {n: float("inf") for n in ops}, {n: float("inf") for n in ops}
        for r in range(a.rounds + 1):  # round 0 warms up
            for name, fn in ops.items():
                if "previous" in name and r > a.old_rounds:
                    continue
                c0, t0 = time.process_time(), time.perf_counter()
                fn(q, k, v).backward(do)
                t, c = time.perf_counter() - t0, time.process_time() - c0
                q.grad = k.grad = v.grad = None
                if r:
                    wall[name], cpu[name] = min(wall[name], t), min(cpu[name], c)
        row = {"date": time.strftime("%Y-%m-%d %H:%M"), "T": T, "threads": a.threads,
               "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"), "load_average": os.getloadavg(),
               "wall_ms": {n: round(x * 1e3, 1) for n, x in wall.items()},
               "cpu_ms": {n: round(x * 1e3, 1) for n, x in cpu.items()}}
        base = "linear chunked"
        row["over_chunked_wall"] = {n: round(wall[n] / wall[base], 2) for n in ops}
        row["over_chunked_cpu"] = {n: round(cpu[n] / cpu[base], 2) for n in ops}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
