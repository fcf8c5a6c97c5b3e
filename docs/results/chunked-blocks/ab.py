"""Old against new chunked linear attention in one plain Python process, as a user calls it.

    PYTHONPATH=. python docs/results/chunked-blocks/ab.py --old 160abd8 --T 4096 16384 65536 --rounds 5
    PYTHONPATH=. python docs/results/chunked-blocks/ab.py --old 160abd8 --T 128 256 512 1024 --rounds 40 \
        --both --softmax-max-T 1024 --softmax-rounds 40

No allocator settings, no huge pages (unless the caller exports THP_MEM_ALLOC_ENABLE=1): the op is
timed as ``linear_attention(q, k, v, form="chunked", chunk_size=64)`` + ``o.backward(g)`` on
[1, T, 8, 64] float32. The old op is ``lintrans/ops/linear.py`` at the revision ``--old``, loaded
beside the package. The variants run in turn (A B A B ...) and the fastest repeat of each is kept:
other jobs on a shared machine only ever add time. A matmul probe runs before and after.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from lintrans.bench.machine import machine_info, matmul_probe
from lintrans.bench.measure import time_step
from lintrans.ops import linear_attention, softmax_attention


def load_old(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:lintrans/ops/linear.py"], capture_output=True, text=True,
                         check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_linear.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("lintrans.ops._old_linear", path)  # its relative imports resolve
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="git revision of the old op")
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gated", action="store_true", help="log_decay = -softplus(q[..., 0]) / 16, [B, T, H]")
    p.add_argument("--both", action="store_true", help="ungated and gated side by side")
    p.add_argument("--softmax-max-T", type=int, default=0, help="also time softmax (SDPA) up to this T")
    p.add_argument("--softmax-rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="append the results as JSON lines to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    old = load_old(args.old)
    impls = {"old": old.linear_attention, "new": linear_attention}
    probe_before = matmul_probe(1.0)
    rows = []
    for T in args.T:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, T, 8, 64, generator=g).requires_grad_() for _ in range(3))
        grad = torch.randn(1, T, 8, 64, generator=g)

        def make(name):
            def step():
                for x in (q, k, v):
                    x.grad = None
                if name == "softmax (SDPA)":
                    o = softmax_attention(q, k, v)
                else:
                    ld = -torch.nn.functional.softplus(q[..., 0]) / 16 if name.endswith("gated") else None
                    o = impls[name.split()[0]](q, k, v, form="chunked", chunk_size=64, log_decay=ld)[0]
                o.backward(grad)
            return step

        kinds = ["", " gated"] if args.both else [" gated" if args.gated else ""]
        names = [v + g for g in kinds for v in ("old", "new")]
        names += ["softmax (SDPA)"] if T <= args.softmax_max_T else []
        steps = {n: make(n) for n in names}
        times = {n: [] for n in names}
        cpu = {n: [] for n in names}  # process CPU time: with one thread, the work, whatever else runs
        faults = {n: [] for n in names}
        for s in steps.values():
            s()  # warm-up
        for r in range(args.rounds):
            for n, s in steps.items():
                if n == "softmax (SDPA)" and r >= args.softmax_rounds:
                    continue
                times[n].append(time_step(s, cpu=cpu[n], faults=faults[n]))
        for n in names:
            best = min(times[n])
            row = {"T": T, "series": n, "gated": n.endswith("gated"), "time_s": best, "times_s": times[n],
                   "cpu_s": min(cpu[n]), "minor_faults": faults[n][times[n].index(best)]}
            rows.append(row)
            print(f"T={T:6d} {n:15s} {best * 1e3:9.1f} ms (fastest of {len(times[n])}; CPU {row['cpu_s'] * 1e3:.1f} ms; "
                  f"{row['minor_faults']} page faults)", flush=True)
    probe_after = matmul_probe(1.0)
    print("matmul probe before", probe_before, "after", probe_after)
    record = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M"), "old": args.old,
              "load_average": os.getloadavg(), "threads": torch.get_num_threads(),
              "probe_before": probe_before, "probe_after": probe_after, "rows": rows}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
