"""A/B timing of lintrans's CPU attention ops in one plain Python process, variants taken in turn.

Two comparisons:

* native kernel against the PyTorch path it falls back to (default): each op runs with the fused
  kernel and with ``LINTRANS_NATIVE=0`` set around the call, beside the chunked linear op;
* two builds of the native kernels (``--builds OLD.so NEW.so``): the same calls with one library,
  then the other. The .so files are lintrans's own builds (``python -m lintrans.ops.native`` prints
  the current one's path; earlier builds stay in the cache directory, named by a hash of their
  build key: sources, flags, toolchain, torch and CPU), so an A/B of a kernel change is: build before, build after, run this.

Variants alternate (A B A B ..., after one warm-up call each) so that a burst of load on a shared
machine hits them alike; the median and fastest wall time and the fastest process CPU time are
printed, and ``--out`` also stores the first quartile (with ``--threads 1`` the CPU time is the work
itself, whatever else runs). Forward + ``backward(do)`` on [B, T, H, D] float32 tensors.

    python tools/ab_kernels.py --T 4096 16384 --ops chunked gated aft sliding-window delta gated-delta
    python tools/ab_kernels.py --builds OLD.so NEW.so --T 4096 16384 65536 --rounds 8
    python tools/ab_kernels.py --T 16384 --H 2 --threads 1 --out ab.jsonl   # one JSON line per op and T

Run it without other settings (no ``THP_MEM_ALLOC_ENABLE``, no allocator variables) to measure what
a user's process gets; the machine line (CPU model, vector features, load average, matmul probe) is
printed and stored with every JSON line.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lintrans.bench.machine import machine_info, matmul_probe  # noqa: E402
from lintrans.ops import aft, delta_rule, linear_attention, native, sliding_window_attention  # noqa: E402

OPS = ("chunked", "gated", "aft", "sliding-window", "delta", "gated-delta")


def _vector_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(x for x in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl") if x in flags) or "none of avx2/avx512"


def _op(name: str, chunk_size: int, window: int) -> Callable:
    if name == "chunked":
        return lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=chunk_size)[0]
    if name == "gated":  # the gate computed in the step, as when training: its gradient is timed too
        return lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=chunk_size,
                                                log_decay=-torch.nn.functional.softplus(q[..., 0]) / 16)[0]
    if name == "aft":
        return lambda q, k, v: aft(q, k, v, variant="simple")
    if name == "sliding-window":
        return lambda q, k, v: sliding_window_attention(q, k, v, window=window)
    if name in ("delta", "gated-delta"):  # beta and the gate from the input, as a layer computes them
        return lambda q, k, v: delta_rule(
            q, k, v, torch.sigmoid(k[..., 0]), chunk_size=chunk_size,
            log_decay=-torch.nn.functional.softplus(q[..., 0]) / 16 if name == "gated-delta" else None)[0]
    raise ValueError(f"--ops: unknown op {name!r}; allowed: {', '.join(OPS)}")


def _pytorch_path(fn: Callable) -> Callable:
    def run(*args):
        with native.disabled():
            return fn(*args)
    return run


def _with_library(lib: ctypes.CDLL, fn: Callable) -> Callable:
    def run(*args):
        native._lib, native._tried = lib, True
        return fn(*args)
    return run


def variants(args) -> Dict[str, Dict[str, Callable]]:
    """{op: {variant name: step}}; the first variant of each op is the baseline of its ratios."""
    out: Dict[str, Dict[str, Callable]] = {}
    libs = None
    if args.builds:
        libs = {"old": ctypes.CDLL(str(Path(args.builds[0]).resolve())),
                "new": ctypes.CDLL(str(Path(args.builds[1]).resolve()))}
    for name in args.ops:
        fn = _op(name, args.chunk_size, args.window)
        if libs:
            out[name] = {f"{name} old": _with_library(libs["old"], fn), f"{name} new": _with_library(libs["new"], fn)}
        else:
            out[name] = {f"{name} native": fn, f"{name} pytorch": _pytorch_path(fn)}
            if name != "chunked":
                out[name]["chunked native"] = _op("chunked", args.chunk_size, args.window)
    return out


def measure(steps: Dict[str, Callable], q, k, v, do, rounds: int) -> Dict[str, Dict[str, float]]:
    wall: Dict[str, List[float]] = {n: [] for n in steps}
    cpu: Dict[str, List[float]] = {n: [] for n in steps}
    for r in range(rounds + 1):  # round 0 warms up
        for name, step in steps.items():
            c0, t0 = time.process_time(), time.perf_counter()
            step(q, k, v).backward(do)
            t, c = time.perf_counter() - t0, time.process_time() - c0
            q.grad = k.grad = v.grad = None
            if r:
                wall[name].append(t * 1e3)
                cpu[name].append(c * 1e3)
    return {n: {"median_ms": round(statistics.median(wall[n]), 2), "min_ms": round(min(wall[n]), 2),
                "q1_ms": round(statistics.quantiles(wall[n], n=4)[0], 2) if len(wall[n]) > 1 else round(wall[n][0], 2),
                "cpu_min_ms": round(min(cpu[n]), 2)} for n in steps}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--builds", nargs=2, metavar=("OLD.so", "NEW.so"), help="compare two builds of the native kernels")
    p.add_argument("--ops", nargs="+", default=["chunked", "gated"], choices=OPS)
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--window", type=int, default=256, help="the sliding window's width")
    p.add_argument("--rounds", type=int, default=8, help="timed calls of each variant (after one warm-up)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="append one JSON line per op and T to this file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.builds and not native.active():
        p.error("the native kernels are not active here (LINTRANS_NATIVE=0, or no compiler): nothing to compare")
    machine = machine_info()
    machine.setdefault("vector_features", _vector_features())
    probe = matmul_probe()
    print("machine", json.dumps(machine), "\nprobe", probe, "load", os.getloadavg(), flush=True)
    table = variants(args)
    for T in args.T:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(args.B, T, args.H, args.D, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn(args.B, T, args.H, args.D, generator=g)
        for op, steps in table.items():
            res = measure(steps, q, k, v, do, args.rounds)
            base = next(iter(steps))
            for n, r in res.items():
                r["over_first_median"] = round(r["median_ms"] / res[base]["median_ms"], 3)
            print(f"T={T} {op}: " + "; ".join(
                f"{n} {r['median_ms']:.1f} ms median (min {r['min_ms']:.1f}, CPU {r['cpu_min_ms']:.1f}), "
                f"{r['over_first_median']:.3f}x {base}" for n, r in res.items()), flush=True)
            if args.out:
                row = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "T": T, "op": op,
                       "B": args.B, "H": args.H, "D": args.D, "threads": torch.get_num_threads(),
                       "builds": args.builds, "load_average": os.getloadavg(), "machine": machine,
                       "probe_before": probe, "results": res}
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("probe", matmul_probe(), "load", os.getloadavg())


if __name__ == "__main__":
    main()
