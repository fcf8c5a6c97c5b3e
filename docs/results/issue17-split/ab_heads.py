"""Two builds of the chunked kernel side by side at 16k with H heads (2: the 48L-128 layer's op),
forward + backward on [1, 16384, H, 64] float32, swapped in turn; median and fastest of 11 each.

    PYTHONPATH=. THP_MEM_ALLOC_ENABLE=0 python docs/results/issue17-split/ab_heads.py OLD.so NEW.so 2
"""
import ctypes, sys, time, statistics, torch
from lintrans.ops import linear_attention, native
libs = [ctypes.CDLL(p) for p in sys.argv[1:3]]
T, H = 16384, int(sys.argv[3])
q, k, v = (torch.randn(1, T, H, 64, requires_grad=True) for _ in range(3))
g = torch.randn(1, T, H, 64)
ts = [[], []]
for r in range(24):
    i = r % 2
    native._lib, native._tried = libs[i], True
    t = time.perf_counter()
    o, _ = linear_attention(q, k, v, chunk_size=64)
    o.backward(g)
    q.grad = k.grad = v.grad = None
    if r >= 2: ts[i].append((time.perf_counter() - t) * 1e3)
for i in range(2):
    print(sys.argv[1 + i][-20:], "H=%d fwd+bwd median %.2f min %.2f ms" % (H, statistics.median(ts[i]), min(ts[i])))
