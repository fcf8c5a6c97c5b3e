"""Gated DeltaNet forward + backward at T = 4096, B = 1, H = 8, D = 64, float32, repeated for a profiler:
OMP_NUM_THREADS=1 taskset -c 0 perf record -g python step.py 300; perf report --no-children --sort symbol"""
import sys
import time

import torch

from lintrans.ops import delta_rule

torch.manual_seed(0)
B, T, H, D = 1, 4096, 8, 64
q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
beta_logits, gate_logits = (torch.randn(B, T, H, requires_grad=True) for _ in range(2))
do = torch.randn(B, T, H, D)


def step():
    beta, log_decay = torch.sigmoid(beta_logits), torch.nn.functional.logsigmoid(gate_logits)
    o, _ = delta_rule(q, k, v, beta, log_decay=log_decay)
    o.backward(do)


n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
for _ in range(3):
    step()
t = time.process_time()
for _ in range(n):
    step()
print(f"forward + backward: {(time.process_time() - t) / n * 1e3:.1f} ms of CPU time per step")
