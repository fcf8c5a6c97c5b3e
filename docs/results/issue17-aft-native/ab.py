"""Causal AFT-simple, its PyTorch path against the fused kernel, beside the chunked op, in one plain
Python process, as a user calls them.

    PYTHONPATH=. python docs/results/issue17-aft-native/ab.py --T 4096 16384 --rounds 9
    PYTHONPATH=. python docs/results/issue17-aft-native/ab.py --T 4096 16384 --rounds 9 --threads 1

No allocator settings, no huge pages (unless the caller exports THP_MEM_ALLOC_ENABLE=1). Each step is
forward + ``o.backward(g)`` on [1, T, 8, 64] float32: ``aft(q, k, v, variant="simple")`` with the
fused kernel off (``LINTRANS_NATIVE=0`` while the step runs: the PyTorch paths) and on, and
``linear_attention(q, k, v, form="chunked", chunk_size=64)`` (its own fused kernel). The variants run
in turn (A B C A B C ...) and the fastest repeat of each is kept: other jobs on a shared machine only
ever add time.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lintrans.bench.machine import machine_info
from lintrans.bench.measure import time_step
from lintrans.ops import linear_attention
from lintrans.ops.aft import aft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="append the results as JSON lines to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    load_before = os.getloadavg()
    for T in args.T:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, T, 8, 64, generator=g).requires_grad_() for _ in range(3))
        grad = torch.randn(1, T, 8, 64, generator=g)

        def make(name):
            def step():
                for x in (q, k, v):
                    x.grad = None
                if name == "linear chunked":
                    o = linear_attention(q, k, v, form="chunked", chunk_size=64)[0]
                else:
                    os.environ["LINTRANS_NATIVE"] = "0" if name == "aft simple, pytorch" else "1"
                    try:
                        o = aft(q, k, v, variant="simple")
                    finally:
                        os.environ.pop("LINTRANS_NATIVE")
                o.backward(grad)
            return step

        names = ["aft simple, pytorch", "aft simple, native", "linear chunked"]
        steps = {n: make(n) for n in names}
        times, cpu, faults = ({n: [] for n in names} for _ in range(3))
        for s in steps.values():
            s()  # warm-up (and the library's build, on first use)
        for _ in range(args.rounds):
            for n, s in steps.items():
                times[n].append(time_step(s, cpu=cpu[n], faults=faults[n]))
        for n in names:
            best = min(times[n])
            row = {"T": T, "series": n, "time_s": best, "times_s": times[n], "cpu_s": min(cpu[n]),
                   "minor_faults": faults[n][times[n].index(best)]}
            rows.append(row)
            print(f"T={T:6d} {n:20s} {best * 1e3:8.1f} ms (fastest of {len(times[n])}; CPU {row['cpu_s'] * 1e3:.1f} ms; "
                  f"{row['minor_faults']} page faults)", flush=True)
        chunked = min(times["linear chunked"])
        for n in names[:2]:
            print(f"T={T:6d} {n} / chunked: {min(times[n]) / chunked:.2f}x (CPU time "
                  f"{min(cpu[n]) / min(cpu['linear chunked']):.2f}x)")
    record = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(), "rows": rows}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
