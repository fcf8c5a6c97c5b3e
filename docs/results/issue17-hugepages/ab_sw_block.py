"""The sliding window's fused kernel with several query-block sizes, and the chunked op, in turn in one
plain process: forward + backward on [1, T, 8, 64] float32, window 256.

    PYTHONPATH=. THP_MEM_ALLOC_ENABLE=0 python docs/results/issue17-hugepages/ab_sw_block.py T ROUNDS BLOCK [BLOCK ...]
"""
import os, sys, time, statistics
import torch
from lintrans.ops import sliding_window_attention, linear_attention
from lintrans.ops.native import sliding_window as nsw
T = int(sys.argv[1]); rounds = int(sys.argv[2]); blocks = [int(x) for x in sys.argv[3:]]
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, T, 8, 64, generator=g).requires_grad_() for _ in range(3))
do = torch.randn(1, T, 8, 64, generator=g)
def sw():
    o = sliding_window_attention(q, k, v, window=256, causal=True); o = o[0] if isinstance(o, tuple) else o
    o.backward(do); q.grad = k.grad = v.grad = None
def ch():
    o, _ = linear_attention(q, k, v, chunk_size=64); o.backward(do); q.grad = k.grad = v.grad = None
names = [f"sw{b}" for b in blocks] + ["chunked"]
times = {n: [] for n in names}
for r in range(rounds + 1):
    for n in names:
        if n.startswith("sw"):
            nsw.BLOCK = int(n[2:]); f = sw
        else:
            f = ch
        t0 = time.perf_counter(); f(); t = (time.perf_counter() - t0) * 1e3
        if r: times[n].append(t)
for n in names:
    print(n, f"median {statistics.median(times[n]):.1f} min {min(times[n]):.1f}", f"ratio to chunked {statistics.median(times[n]) / statistics.median(times['chunked']):.3f}")
print("load", os.getloadavg())
