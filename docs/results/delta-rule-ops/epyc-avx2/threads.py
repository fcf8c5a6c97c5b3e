"""Gated DeltaNet and DeltaNet op, forward and forward + backward at T = 4096 (B = 1, H = 8, D = 64, float32),
fastest and median of 15 calls in a plain process: run once with the default threads and once with
OMP_NUM_THREADS=1 (threads.log)."""
import time, torch, sys
from lintrans.ops import delta_rule
torch.manual_seed(0)
B,T,H,D=1,4096,8,64
q,k,v=(torch.randn(B,T,H,D,requires_grad=True) for _ in range(3))
beta=torch.rand(B,T,H).requires_grad_()
ld=(-torch.rand(B,T,H)/16).requires_grad_()
do=torch.randn(B,T,H,D)
def best(f,n=15):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return min(ts)*1e3, sorted(ts)[len(ts)//2]*1e3
for gated in (False, True):
    L = ld if gated else None
    def fwd():
        with torch.no_grad(): delta_rule(q,k,v,beta,log_decay=L)
    def fb():
        o,_=delta_rule(q,k,v,beta,log_decay=L); o.backward(do)
    print("gated" if gated else "plain", "fwd %.1f (med %.1f)"%best(fwd), "fwd+bwd %.1f (med %.1f)"%best(fb), flush=True)
