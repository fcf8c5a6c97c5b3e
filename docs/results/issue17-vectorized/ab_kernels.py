"""Two builds of the fused kernels side by side in one plain process: the chunked op (and its gated
form) at each T, forward + backward on [1, T, H, 64] float32 (H = 8, or --H), the builds swapped in turn (A B A B ...),
each with its own spacing of saved states (CKPT_OLD, CKPT_NEW: CHECKPOINT_CHUNKS of its version).
Median, fastest and first quartile of each.

    CKPT_OLD=16 CKPT_NEW=4 PYTHONPATH=. THP_MEM_ALLOC_ENABLE=0 \
        python docs/results/issue17-vectorized/ab_kernels.py OLD.so NEW.so --T 4096 16384 --rounds 8

The .so files are lintrans's own builds (``python -m lintrans.ops.native`` prints the path; earlier
ones stay in the cache directory, named by a hash of their sources).
"""
import argparse
import ctypes
import os
import statistics
import time

import torch

from lintrans.bench.machine import matmul_probe
from lintrans.ops import linear_attention
from lintrans.ops import native
import lintrans.ops.native.chunked as _ch
CK = {'old': int(os.environ.get('CKPT_OLD', '16')), 'new': int(os.environ.get('CKPT_NEW', '16'))}
print('ckpt', CK)

p = argparse.ArgumentParser()
p.add_argument("old")
p.add_argument("new")
p.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
p.add_argument("--rounds", type=int, default=8)
p.add_argument("--H", type=int, default=8, help="heads (2: the 48L-128 layer's op)")
args = p.parse_args()
libs = {"old": ctypes.CDLL(args.old), "new": ctypes.CDLL(args.new)}
print("probe", matmul_probe(), "load", os.getloadavg())
for T in args.T:
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, T, args.H, 64, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(1, T, args.H, 64, generator=g)
    for gated in (False, True):
        def step():
            ld = -torch.nn.functional.softplus(q[..., 0]) / 16 if gated else None
            o, _ = linear_attention(q, k, v, chunk_size=64, log_decay=ld)
            o.backward(do)
            q.grad = k.grad = v.grad = None
        times = {"old": [], "new": []}
        for i in range(2 * args.rounds + 2):
            name = "old" if i % 2 == 0 else "new"
            native._lib, native._tried = libs[name], True
            _ch.CHECKPOINT_CHUNKS = CK[name]
            t0 = time.perf_counter()
            step()
            if i >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {n: statistics.median(t) for n, t in times.items()}
        q1 = {n: statistics.quantiles(t, n=4)[0] for n, t in times.items()}
        print(f"   q1 old {q1['old']:.1f} new {q1['new']:.1f} ratio {q1['new']/q1['old']:.3f}")
        print(f"T={T} {'gated' if gated else 'ungated'}: old {med['old']:.1f} ms (min {min(times['old']):.1f}), "
              f"new {med['new']:.1f} ms (min {min(times['new']):.1f}), new/old {med['new'] / med['old']:.3f}")
print("probe", matmul_probe(), "load", os.getloadavg())
