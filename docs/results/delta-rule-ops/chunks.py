"""Which chunk size the fused CPU delta-rule kernel runs fastest at: Gated DeltaNet forward + backward
(B=1, H=8, D=64, float32, the gates of `bench ops`), every chunk size timed in turn at each T, in one
plain process with default settings; the fastest of 5 rounds. Writes chunks.json beside this file."""
import json
import time
from pathlib import Path

import torch

from lintrans.bench.machine import machine_info
from lintrans.bench.ops import delta_gates
from lintrans.ops import delta_rule

CHUNKS, TS = (16, 32, 64, 128), (1024, 4096, 16384)
rows = []
for T in TS:
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, T, 8, 64, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(1, T, 8, 64, generator=g)

    def step(c):
        for x in (q, k, v):
            x.grad = None
        beta, log_decay = delta_gates(q)
        delta_rule(q, k, v, beta, log_decay=log_decay, chunk_size=c)[0].backward(grad)

    best = {c: float("inf") for c in CHUNKS}
    for c in CHUNKS:
        step(c)  # warm-up
    for _ in range(5):
        for c in CHUNKS:
            t0 = time.perf_counter()
            step(c)
            best[c] = min(best[c], time.perf_counter() - t0)
    rows += [{"T": T, "chunk": c, "time_s": best[c]} for c in CHUNKS]
    print(T, {c: f"{best[c] * 1e3:.1f} ms" for c in CHUNKS}, flush=True)
out = Path(__file__).with_name("chunks.json")
out.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))
