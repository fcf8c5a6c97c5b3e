"""Gated DeltaNet and DeltaNet (lintrans) against transformers' torch_chunk_gated_delta_rule at T = 4096,
B = 1, H = 8, D = 64, float32, forward + backward, in a plain Python process with default settings
(no THP_MEM_ALLOC_ENABLE, which the lintrans CLI sets): the benchmark's own series and gates
(lintrans.bench.ops / peers), taken in turn round after round so that load hits all alike; fastest and
median of the rounds. Run: .venv/bin/python docs/results/delta-rule-ops/epyc-avx2/plain.py [rounds]"""
import json
import os
import statistics
import sys
import time

import torch

from lintrans.bench.machine import machine_info
from lintrans.bench.ops import DELTA_OP, GATED_DELTA_OP, delta_ops
from lintrans.bench.peers import TRANSFORMERS_DELTA_SERIES, peer_ops

assert "THP_MEM_ALLOC_ENABLE" not in os.environ, "run it without allocator settings"
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
torch.manual_seed(0)
B, T, H, D = 1, 4096, 8, 64
q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
do = torch.randn(B, T, H, D)
series = {**delta_ops(), TRANSFORMERS_DELTA_SERIES: peer_ops()[TRANSFORMERS_DELTA_SERIES]}
series = {name: series[name] for name in (DELTA_OP, GATED_DELTA_OP, TRANSFORMERS_DELTA_SERIES)}


def step(fn):
    for x in (q, k, v):
        x.grad = None
    t = time.perf_counter()
    fn(q, k, v).backward(do)
    return (time.perf_counter() - t) * 1e3


for fn in series.values():
    step(fn)  # warm-up
times = {name: [] for name in series}
for _ in range(rounds):
    for name, fn in series.items():
        times[name].append(step(fn))
fallback = min(times[TRANSFORMERS_DELTA_SERIES])
out = {"machine": machine_info(), "rounds": rounds, "ms": times}
print(json.dumps(out["machine"]))
for name, ts in times.items():
    print(f"{name:45s} fastest {min(ts):7.1f} ms  median {statistics.median(ts):7.1f} ms  "
          f"fallback / this (fastest) {fallback / min(ts):5.2f}x  (median) "
          f"{statistics.median(times[TRANSFORMERS_DELTA_SERIES]) / statistics.median(ts):5.2f}x")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain.json"), "w") as f:
    json.dump(out, f, indent=1)
