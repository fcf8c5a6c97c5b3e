"""`lintrans demo` (`make demo`): the quick benchmark profile with its headline.

Times a GPT training step (softmax SDPA against chunked linear attention at its tuned chunk size)
and time per generated token (KV cache against recurrent state) for growing context, then prints
the context from which the linear model trains faster and the speed-up at the longest context.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-T", type=int, default=8192, help="longest context (default 8192)")
    p.add_argument("--time-cap", type=float, default=8.0, help="seconds per step past which a curve stops")
    p.add_argument("--out", type=Path, default=None, help="also write JSON/CSV/MD/PNG here")
    p.add_argument("--skip-generate", action="store_true", help="only the training-step benchmark")


def run(args) -> int:
    from .cli import powers_of_two, profiles, run_benchmark

    t0 = time.perf_counter()
    prof = profiles()["quick"]
    prof.forms = ("chunked",)
    prof.train_T = prof.generate_T = powers_of_two(256, args.max_T)
    prof.caps.time_s = args.time_cap
    train = run_benchmark("train", prof, out=args.out)
    gen = None if args.skip_generate else run_benchmark("generate", prof, out=args.out)

    s = train["speedups"][0]
    print("\n" + "=" * 80)
    if s["faster_from_T"] is not None:
        print(f"Linear attention (chunked) trains faster than softmax from T = {s['faster_from_T']} on.")
    else:
        print("Linear attention (chunked) was not faster than softmax at the longest context measured.")
    if s["longest_common_T"] is not None:
        print(f"Speed-up at the longest context measured for both (T = {s['longest_common_T']}): "
              f"{s['speedup_at_longest']:.2f}x")
    if s["slow_stopped"]:
        print(f"Softmax stopped at T = {s['slow_stopped'][0]} ({s['slow_stopped'][1]}); "
              f"linear reached T = {s['fast_longest_T']}.")
    if gen is not None:
        rows = {(r["series"], r["T"]): r for r in gen["rows"] if r["status"] == "ok"}
        for name in ("linear state", "softmax KV cache"):
            Ts = sorted(T for (n, T) in rows if n == name)
            if len(Ts) >= 2:
                a, b = rows[(name, Ts[0])]["time_s"], rows[(name, Ts[-1])]["time_s"]
                print(f"Time per generated token, {name}: {a * 1e3:.2f} ms at T = {Ts[0]}, "
                      f"{b * 1e3:.2f} ms at T = {Ts[-1]} ({b / a:.2f}x)")
    print(f"(quick profile, {time.perf_counter() - t0:.0f}s; `lintrans bench all --profile full` for the full record)")
    return 0
