"""One kernel, forward + backward on [1, T, 8, 64] float32, with the huge-page advice on and off in turn
(LINTRANS_HUGEPAGES=1 / 0, read at each allocation), in one plain process: median and fastest time and
the page faults of a call.

    PYTHONPATH=. THP_MEM_ALLOC_ENABLE=0 python docs/results/issue17-hugepages/ab_hugepages.py T REPEATS [chunked|sw|aft]
"""
import os, sys, time, statistics, resource
import torch
from lintrans.ops import linear_attention
T = int(sys.argv[1]); reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
op = sys.argv[3] if len(sys.argv) > 3 else "chunked"
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, T, 8, 64, generator=g).requires_grad_() for _ in range(3))
do = torch.randn(1, T, 8, 64, generator=g)
def step():
    if op == "chunked":
        o, _ = linear_attention(q, k, v, form="chunked", chunk_size=64)
    elif op == "sw":
        from lintrans.ops import sliding_window_attention
        o = sliding_window_attention(q, k, v, window=256, causal=True); o = o[0] if isinstance(o, tuple) else o
    else:
        from lintrans.ops.aft import aft
        o = aft(q, k, v, variant="simple"); o = o[0] if isinstance(o, tuple) else o
    o.backward(do)
    q.grad = k.grad = v.grad = None
res = {"on": [], "off": []}
faults = {"on": [], "off": []}
for i in range(reps * 2 + 2):
    mode = "on" if i % 2 == 0 else "off"
    os.environ["LINTRANS_HUGEPAGES"] = "1" if mode == "on" else "0"
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter(); step(); t = time.perf_counter() - t0
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if i >= 2:
        res[mode].append(t * 1e3); faults[mode].append(f1 - f0)
for m in res:
    print(f"{op} T={T} hugepages {m}: median {statistics.median(res[m]):.1f} ms, min {min(res[m]):.1f}, faults {statistics.median(faults[m]):.0f}")
print("ratio off/on (median):", round(statistics.median(res['off']) / statistics.median(res['on']), 3), "load", os.getloadavg()[0])
