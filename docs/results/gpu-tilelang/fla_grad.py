"""flash-linear-attention's gated delta rule, forward and backward, against the float64 definition.

On Hopper with Triton 3.4-3.7.0, fla 0.6.0 refuses its Triton backward for gated kernels (its issue #640)
and runs TileLang's instead where `tilelang` is importable and nvcc is found. This script compares, on
CUDA, fla's ``chunk_gated_delta_rule`` and ``lintrans.ops.delta_rule`` (float32) with
``delta_rule_reference`` (float64, CPU): the output, the final state and the gradients of q, k, v, beta,
the gate and the initial state of one fixed random loss. Errors are max |error| / max |reference|.
``speed``: forward + backward time, B=1 H=8 D=64, mean of 5 after one untimed call.
Usage: python3 fla_grad.py check|speed"""
import sys
import time

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from lintrans.ops import delta_rule, delta_rule_reference


def _grads(fn, xs, weights):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    o, S = fn(*xs)
    (o.double().mul(weights[0].to(o.device)).sum() + S.double().mul(weights[1].to(S.device)).sum()).backward()
    return [o.detach(), S.detach()] + [x.grad for x in xs]


def check():
    torch.backends.cuda.matmul.allow_tf32 = False
    names = ("o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0")
    for T in (1, 100, 1000):
        for gate in (0, 1):
            g = torch.Generator().manual_seed(T + gate)
            q, k, v = (torch.randn(2, T, 2, 64, generator=g, dtype=torch.float64) for _ in range(3))
            b = torch.rand(2, T, 2, generator=g, dtype=torch.float64)
            ld = -torch.rand(2, T, 2, generator=g, dtype=torch.float64) * (gate or 1e-3)
            S0 = torch.randn(2, 2, 64, 64, generator=g, dtype=torch.float64) * 0.5
            w = (torch.randn(2, T, 2, 64, generator=g, dtype=torch.float64),
                 torch.randn(2, 2, 64, 64, generator=g, dtype=torch.float64))
            xs = [q, k, v, b, ld, S0]
            ref = _grads(lambda q, k, v, b, ld, S0: delta_rule_reference(
                q, k, v, b, log_decay=ld, initial_state=S0), xs, w)
            cuda = [x.cuda().float() for x in xs]
            fla = _grads(lambda q, k, v, b, ld, S0: chunk_gated_delta_rule(
                q, k, v, ld, b, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True),
                cuda, w)
            ours = _grads(lambda q, k, v, b, ld, S0: delta_rule(
                q, k, v, b, log_decay=ld, initial_state=S0, output_final_state=True), cuda, w)

            def err(a, r):
                return ((a.double().cpu() - r).abs().max() / r.abs().max()).item()
            print(f"T={T} gate={'token' if gate else 'near 1'}", flush=True)
            for name, r, a, o in zip(names, ref, fla, ours):
                print(f"  {name:6s} fla {err(a, r):.2e} | ours {err(o, r):.2e}", flush=True)


def _mean_ms(fn, n=5):
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
            xs = [torch.randn(1, T, 8, 64, device="cuda", generator=g, dtype=dt) for _ in range(3)]
            xs.append(torch.rand(1, T, 8, device="cuda", generator=g, dtype=dt))
            xs.append(-torch.rand(1, T, 8, device="cuda", generator=g) / 16)
            xs = [x.requires_grad_(True) for x in xs]

            def step(fn):
                o = fn(*xs)[0]
                o.float().square().mean().backward()
            theirs = lambda q, k, v, b, ld: chunk_gated_delta_rule(q, k, v, ld, b, use_qk_l2norm_in_kernel=True)
            ours = lambda q, k, v, b, ld: delta_rule(q, k, v, b, log_decay=ld)
            t0 = time.perf_counter()
            step(theirs)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            a = _mean_ms(lambda: step(theirs))
            o = _mean_ms(lambda: step(ours))
            print(f"{dt} T={T} forward+backward B=1 H=8 D=64: fla chunk_gated_delta_rule {a:.2f} ms (first call "
                  f"{first:.1f} s) | lintrans delta_rule {o:.2f} ms | ratio {o / a:.1f}x", flush=True)


{"check": check, "speed": speed}[sys.argv[1]]()
