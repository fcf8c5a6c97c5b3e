"""flash-linear-attention's ``chunk_gated_delta_rule`` beside ``lintrans.ops.delta_rule`` on CUDA, forward
only (fla 0.6.0 refuses the gated backward on Hopper with Triton < 3.7.1: pytest-fla-delta.log).

``check``: both against the float64 reference on the CPU (B=2, H=2, D=64, beta in [0, 1], a state in),
max abs error over max abs value, TF32 off for torch's matmuls (Triton's float32 dots in fla use it).
``speed``: forward time, B=1, H=8, D=64, float32 and bfloat16, after one untimed call (fla's first
call at a new shape autotunes: its time is printed), mean of 10 calls.
Usage: python3 fla_delta.py check|speed   (the records: fla-delta-forward.log, fla-delta-forward-speed.log)"""
import sys
import time

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from lintrans.ops import delta_rule, delta_rule_reference


def check():
    torch.backends.cuda.matmul.allow_tf32 = False
    for T in (1, 100, 1000):
        for gate in (0, 1):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(2, T, 2, 64, generator=g, dtype=torch.float64) for _ in range(3))
            b = torch.rand(2, T, 2, generator=g, dtype=torch.float64)
            ld = -torch.rand(2, T, 2, generator=g, dtype=torch.float64) * gate
            S0 = torch.randn(2, 2, 64, 64, generator=g, dtype=torch.float64) * 0.5
            ro, rS = delta_rule_reference(q, k, v, b, log_decay=ld, initial_state=S0)
            q, k, v, b, ld, S0 = (x.cuda().float() for x in (q, k, v, b, ld, S0))
            with torch.no_grad():
                fo, fS = chunk_gated_delta_rule(q, k, v, ld, b, initial_state=S0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
                oo, oS = delta_rule(q, k, v, b, log_decay=ld, initial_state=S0, output_final_state=True)

            def err(a, r):
                return ((a.double().cpu() - r).abs().max() / r.abs().max()).item()
            print(f"T={T} gate={gate}: fla o {err(fo, ro):.2e} S {err(fS, rS):.2e} | ours o {err(oo, ro):.2e} "
                  f"S {err(oS, rS):.2e} (max abs error / max abs, vs CPU float64 reference)", flush=True)


def mean_ms(fn, n=10):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def speed():
    for dt in (torch.float32, torch.bfloat16):
        for T in (4096, 16384, 65536):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(1, T, 8, 64, device="cuda", generator=g, dtype=dt) for _ in range(3))
            b = torch.rand(1, T, 8, device="cuda", generator=g, dtype=dt)
            ld = -torch.rand(1, T, 8, device="cuda", generator=g) / 16
            with torch.no_grad():
                t0 = time.perf_counter()
                chunk_gated_delta_rule(q, k, v, ld, b, use_qk_l2norm_in_kernel=True)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                a = mean_ms(lambda: chunk_gated_delta_rule(q, k, v, ld, b, use_qk_l2norm_in_kernel=True))
                o = mean_ms(lambda: delta_rule(q, k, v, b, log_decay=ld))
            print(f"{dt} T={T} forward only B=1 H=8 D=64: fla chunk_gated_delta_rule {a:.2f} ms (first call "
                  f"{first:.1f} s) | lintrans delta_rule {o:.2f} ms | ratio {o / a:.1f}x", flush=True)


{"check": check, "speed": speed}[sys.argv[1]]()
