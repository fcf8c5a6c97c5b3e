"""GPT training step, chunked linear attention against the no-mixing floor, in one plain process.

    PYTHONPATH=. python docs/results/train-step-17/ab_train.py --size 12L-128 --T 16384 --rounds 4
    PYTHONPATH=. python docs/results/train-step-17/ab_train.py --size 12L-128 --T 16384 --profile

No allocator settings, no huge pages (unless the caller exports THP_MEM_ALLOC_ENABLE=1): the step
is the benchmark's (``lintrans.bench.train.make_train_step``: forward, cross entropy, backward,
AdamW; batch 1, vocabulary 50257), with the chunked form at a fixed chunk size. Both models are
built, warmed up once, then stepped in turn (A B A B ...); the fastest repeat of each is kept, with
the process CPU time and page faults of that repeat, and the least CPU time of any repeat (with
``--threads 1`` that is the work, whatever else runs on the machine). A matmul probe runs before and after.
``--layer`` times one attention layer instead of the whole step (its difference times the number
of layers is what the series adds to the floor's step). ``--profile`` instead runs torch.profiler over one step of each and prints the operators that
take the most self CPU time, side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lintrans.bench.machine import machine_info, matmul_probe
from lintrans.bench.measure import time_step
from lintrans.bench.sizes import resolve_size
from lintrans.bench.train import gpt_config, make_train_step

SERIES = {"chunked": ("linear", "chunked"), "floor": ("none", None), "softmax": ("softmax", None)}


def build(size: str, T: int, series: str, chunk: int, layer: bool = False):
    attention, form = SERIES[series]
    config = gpt_config(size, T, attention, form, chunk)
    if not layer:
        return make_train_step(config, T)
    from lintrans.nn.registry import get_attention

    # one attention layer alone, forward + backward: what the series adds to the floor, per layer
    torch.manual_seed(0)
    module = get_attention(attention)(config)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(1, T, config.n_embd, generator=g).requires_grad_()
    grad = torch.randn(1, T, config.n_embd, generator=g)

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x)[0].backward(grad)

    return step


def profile(steps: dict, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    tables = {}
    for name, step in steps.items():
        with prof(activities=[ProfilerActivity.CPU]) as p:
            step()
        tables[name] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in p.key_averages()}
    names = list(steps)
    keys = sorted(set().union(*tables.values()),
                  key=lambda k: -max(tables[n].get(k, (0, 0))[0] for n in names))
    print(f"{'self CPU ms (calls)':<48}" + "".join(f"{n:>22}" for n in names) + f"{'diff':>12}")
    for k in keys[:top]:
        cells = [tables[n].get(k, (0.0, 0)) for n in names]
        diff = cells[0][0] - cells[-1][0]
        print(f"{k[:48]:<48}" + "".join(f"{ms:>14.1f} ({c:>5})" for ms, c in cells) + f"{diff:>12.1f}")
    totals = [sum(ms for ms, _ in tables[n].values()) for n in names]
    print(f"{'total self CPU':<48}" + "".join(f"{t:>22.1f}" for t in totals) + f"{totals[0] - totals[-1]:>12.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="12L-128")
    p.add_argument("--T", type=int, nargs="+", default=[16384])
    p.add_argument("--series", nargs="+", default=["chunked", "floor"], choices=list(SERIES))
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="profile one step of each instead of timing")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--layer", action="store_true",
                   help="time one attention layer (c_attn, the mixing, c_proj; forward + backward) instead of the step")
    p.add_argument("--out", default=None, help="append the results as a JSON line to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    size = resolve_size(args.size)
    probe_before = matmul_probe(1.0)
    load_before = os.getloadavg()
    rows = []
    for T in args.T:
        steps = {n: build(size, T, n, args.chunk, args.layer) for n in args.series}
        for s in steps.values():
            s()  # warm-up: AdamW state, thread pool, allocator
        if args.profile:
            profile(steps, args.top)
            continue
        times, cpu, faults = ({n: [] for n in steps} for _ in range(3))
        for _ in range(args.rounds):
            for n, s in steps.items():
                times[n].append(time_step(s, cpu=cpu[n], faults=faults[n]))
        for n in steps:
            best = min(times[n])
            i = times[n].index(best)
            rows.append({"size": size, "T": T, "series": n, "layer": args.layer, "time_s": best, "times_s": times[n],
                         "cpu_s": cpu[n][i], "cpu_min_s": min(cpu[n]), "cpus_s": cpu[n],
                         "minor_faults": faults[n][i]})
        floor = (min(times["floor"]), min(cpu["floor"])) if "floor" in times else None
        for n in steps:
            best, least = min(times[n]), min(cpu[n])
            over = (f", {100 * (best / floor[0] - 1):+.1f}% over the floor (CPU time {100 * (least / floor[1] - 1):+.1f}%)"
                    if floor and n != "floor" else "")
            print(f"{size} T={T} {n:8s} {best:8.3f} s (fastest of {len(times[n])}: "
                  f"{' '.join(f'{t:.2f}' for t in times[n])}; least CPU {least:.3f} s){over}", flush=True)
        del steps
    probe_after = matmul_probe(1.0)
    print("matmul probe before", probe_before, "after", probe_after, "load", load_before, os.getloadavg())
    if args.out and rows:
        record = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M"), "chunk": args.chunk,
                  "load_average_before": load_before, "load_average_after": os.getloadavg(),
                  "threads": torch.get_num_threads(), "probe_before": probe_before, "probe_after": probe_after,
                  "rows": rows}
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
