"""A/B timing of the one-token decoding steps (``linear_attention_step``, ``delta_rule_step``) in one plain
Python process: the fused CPU step against the PyTorch step it falls back to (``LINTRANS_NATIVE=0``),
taken in turn, rounds alternating, under ``torch.no_grad`` as generation runs them; fastest round per
variant, microseconds per call.

    python tools/ab_decode_steps.py                 # 1 thread, B=1: H=4 D=32 and H=12 D=64
    python tools/ab_decode_steps.py --threads 2 --rounds 9
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from lintrans.bench.machine import machine_info
from lintrans.ops import delta_rule_step, linear_attention_step, native


def cases(B: int, H: int, D: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, D, generator=g) for _ in range(3))
    state = (torch.rand(B, H, D, D, generator=g), torch.rand(B, H, D, generator=g) + 1)
    S = torch.randn(B, H, D, D, generator=g) * 0.1
    beta, ld = torch.rand(B, H, generator=g), -torch.rand(B, H, generator=g)
    return {
        "linear elu": lambda: linear_attention_step(q, k, v, state, scale=D ** -0.5),
        "linear elu + decay": lambda: linear_attention_step(q, k, v, state, scale=D ** -0.5, log_decay=ld),
        "delta rule": lambda: delta_rule_step(q, k, v, beta, S),
        "gated delta rule": lambda: delta_rule_step(q, k, v, beta, S, log_decay=ld),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="calls timed per round")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(f"{info.get('cpu')} ({info.get('cpu_features')}), torch {torch.__version__}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    try:
        for shape in ((1, 4, 32), (1, 12, 64)):
            best: dict = {}
            with torch.no_grad():
                for _ in range(args.rounds):
                    for fused in (True, False):
                        with native.disabled(not fused):
                            for name, fn in cases(*shape).items():
                                for _ in range(100):
                                    fn()
                                t = time.perf_counter()
                                for _ in range(args.calls):
                                    fn()
                                us = (time.perf_counter() - t) / args.calls * 1e6
                                best[name, fused] = min(us, best.get((name, fused), float("inf")))
            B, H, D = shape
            for name in cases(*shape):
                fused, plain = best[name, True], best[name, False]
                print(f"B={B} H={H} D={D} {name:18s} fused {fused:6.1f} us, PyTorch {plain:6.1f} us ({plain / fused:.2f}x)")
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
