"""`lintrans demo`: every linear-attention form on random data, its time and its error against
the float64 reference, as a table. (Replaced by the quick benchmark profile once it lands.)"""
from __future__ import annotations

import argparse
import time

import torch


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", type=int, default=512, help="sequence length (default 512)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=64)


def run(args) -> int:
    from lintrans.ops import FORMS, linear_attention, linear_attention_reference, softmax_attention

    torch.manual_seed(0)
    B, T, H, D = 1, args.T, args.heads, args.head_dim
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    ref, _ = linear_attention_reference(q[:, :128], k[:, :128], v[:, :128])
    print(f"causal linear attention, elu+1 feature map, B={B} T={T} H={H} D={D}, float32, {torch.get_num_threads()} threads")
    print(f"{'form':<20}{'time (ms)':>12}{'max |err| vs float64 ref (first 128)':>40}")
    for form in FORMS:
        t0 = time.perf_counter()
        o, _ = linear_attention(q, k, v, form=form, chunk_size=args.chunk_size)
        ms = (time.perf_counter() - t0) * 1e3
        err = (o[:, :128].double() - ref).abs().max().item()
        print(f"{form:<20}{ms:>12.2f}{err:>40.2e}")
    t0 = time.perf_counter()
    softmax_attention(q, k, v)
    print(f"{'softmax (SDPA)':<20}{(time.perf_counter() - t0) * 1e3:>12.2f}{'(baseline, not comparable)':>40}")
    return 0
