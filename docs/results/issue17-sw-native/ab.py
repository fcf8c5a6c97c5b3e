"""Issue 17, sliding window: the fused kernel (ops/native/sliding_window.cpp), the PyTorch blocks it
falls back to (LINTRANS_NATIVE=0 around that call only) and the chunked linear op (its own fused
kernel), side by side in one plain Python process (A B C A B C ..., fastest of N).

    THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=. python docs/results/issue17-sw-native/ab.py --threads 2
    THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=. python docs/results/issue17-sw-native/ab.py --threads 1

fwd + bwd, B=1, H=8, D=64, float32, window 256, chunked with chunk 64 and elu features. Wall time
with the given threads, and the process CPU time (the work itself, on a shared machine).
"""
import argparse
import json
import os
import time

import torch

from lintrans.ops.linear import linear_attention
from lintrans.ops.sliding_window import sliding_window_attention


def pytorch_path(fn):
    def run(*args):
        os.environ["LINTRANS_NATIVE"] = "0"
        try:
            return fn(*args)
        finally:
            del os.environ["LINTRANS_NATIVE"]
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="append one JSON line per T here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sw = lambda q, k, v: sliding_window_attention(q, k, v, window=256)  # noqa: E731
    ops = {"linear chunked": lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=64)[0],
           "sliding window 256 (native)": sw,
           "sliding window 256 (pytorch)": pytorch_path(sw)}
    for T in a.T:
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, T, 8, 64, generator=g) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        wall, cpu = {n: float("inf") for n in ops}, {n: float("inf") for n in ops}
        for r in range(a.rounds + 1):  # round 0 warms up
            for name, fn in ops.items():
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
    main()
