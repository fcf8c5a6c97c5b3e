"""`lintrans demo` (`make demo`): the quick benchmark profile with its headline.

Three measurements, each side by side in one run: the attention op (softmax SDPA against chunked
linear attention, forward + backward), a GPT training step (softmax against chunked linear at its
tuned chunk size) and time per generated token (KV cache against recurrent state). Prints the
context from which linear attention is faster and the speed-up at the longest context measured,
each only where both curves hold together (``trend.verdict``: a disturbed point is timed again
during the sweep, one that stays disturbed withholds the comparison), and last whether the
machine was too busy to conclude.

The training model is deep and narrow (12 layers, width 128) on purpose: with a 50257-token
vocabulary at batch 1 the LM head costs 6 T d V FLOPs, and in a shallow model it, not attention,
sets the step time (`lintrans cost` shows the split).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional


def configure(p: argparse.ArgumentParser) -> None:
    # 4k: past it softmax's step alone outgrows the demo's minutes, and each point now gets two
    # alternating rounds; `bench train` and the records in docs/results go to 16k-32k
    p.add_argument("--max-T", type=int, default=4096, help="longest context for the training step, >= 256 (default 4096)")
    p.add_argument("--generate-max-T", type=int, default=8192,
                   help="longest context for time per generated token, >= 256 (default 8192)")
    # 8k, not 16k: softmax's 16k op step, timed three times, would make the demo much longer; the full
    # profile and docs/results/peers have the op to 16k and beyond
    p.add_argument("--ops-max-T", type=int, default=8192, help="longest context for the op benchmark, >= 256 (default 8192)")
    p.add_argument("--size", default="12L-128", help="model size for the training step (default 12L-128)")
    p.add_argument("--time-cap", type=float, default=12.0, help="seconds per step past which a curve stops (default 12)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"),
                   help="folder for the record (JSON/CSV/MD/PNG; default runs/demo). The committed record is "
                        "docs/results/demo: pass that to replace it")
    p.add_argument("--skip-generate", action="store_true", help="skip the generation benchmark")


def op_share_line(ops: dict) -> Optional[str]:
    """The chunked op at the longest T it reached: its FLOPs (as ``lintrans cost`` counts the chunked
    form) per second, as a share of the matmul probe taken at the end of the same record."""
    from .cost import ModelShape, op_training_flops

    probe = (ops.get("machine") or {}).get("matmul_gflops_best")
    ok = [r for r in ops["rows"] if r["series"] == "linear chunked" and r["status"] == "ok"]
    if not probe or not ok:
        return None
    r = max(ok, key=lambda r: r["T"])
    shape = ModelShape(n_layer=1, n_head=8, n_embd=512, attention="linear", form="chunked",
                       chunk_size=r.get("chunk_size") or 64)
    rate = op_training_flops(shape, r["T"]) / r["time_s"]
    return (f"chunked op at T = {r['T']}: {r['time_s'] * 1e3:.0f} ms, {rate / 1e9:.0f} GFLOP/s as `lintrans cost` "
            f"counts it, {100 * rate / (probe * 1e9):.0f}% of the matmul probe ({probe:.0f} GFLOP/s, same run)")


def summary_lines(ops: dict, train: dict, gen: Optional[dict], size: str) -> list[str]:
    """The demo's conclusions from the three benchmarks' results, each comparison only where its
    curves hold together (``trend.verdict``), and last whether the machine was too busy for them."""
    from .trend import verdict, verdict_lines

    lines, unsettled = [], []

    def compare(result: dict, what: str, verb: str) -> bool:
        s = result["speedups"][0] if result["speedups"] else None
        if s is None:
            return False
        v = verdict(result["rows"], s["fast"], s["slow"])
        lines.extend(verdict_lines(v, what, verb))
        if v["disturbances"]:
            unsettled.append(what)
        return v["concluded"]

    if compare(ops, "attention op (fwd + bwd, H=8, D=64)", "runs") and (line := op_share_line(ops)) is not None:
        lines.append("  " + line)
    if compare(train, f"GPT {size} training step (vocab 50257, batch 1)", "trains"):
        # the no-mixing floor: what any attention could gain
        lines.extend("  " + line + "." for line in train["lines"][len(train["speedups"]):])
    if gen is not None and compare(gen, "time per generated token", "decodes"):
        from .trend import curve

        for name in ("linear state", "softmax KV cache"):
            pts = curve(gen["rows"], name)
            if len(pts) >= 2:
                (T0, a), (T1, b) = pts[0], pts[-1]
                lines.append(f"  {name}: {a * 1e3:.2f} ms at T = {T0}, {b * 1e3:.2f} ms at T = {T1} ({b / a:.2f}x)")
    probes = [r["noise_warning"] for r in (ops, train, gen) if r is not None and r.get("noise_warning")]
    if unsettled or probes:
        why = ([f"no conclusion for the {', '.join(unsettled)}"] if unsettled else []) + (
            [f"{len(probes)} of the matmul probes taken with the records varied past the quiet threshold"]
            if probes else [])
        lines.append(f"the machine was busy during this demo ({'; '.join(why)}): its figures may be off; "
                     "run `make demo` again when the machine is idle")
    return lines


def run(args) -> int:
    from .cli import powers_of_two, profiles, run_benchmark
    from .sizes import resolve_size

    try:
        args.size = resolve_size(args.size)
    except ValueError as e:
        raise SystemExit(f"lintrans demo: {e}")
    from lintrans.checks import check_number

    try:  # before any work: each curve starts at T = 256
        for flag in ("max_T", "generate_max_T", "ops_max_T"):
            check_number(f"--{flag.replace('_', '-')}", getattr(args, flag), integer=True, low=256)
        check_number("--time-cap", args.time_cap, low=0, low_open=True)
        from lintrans._io import writable_folder

        writable_folder(args.out, "--out")
    except (ValueError, TypeError) as e:
        raise SystemExit(f"lintrans demo: {e}")
    t0 = time.perf_counter()
    command = getattr(args, "command_line", "lintrans demo")
    prof = profiles()["quick"]
    prof.caps.time_s = args.time_cap
    # several timed repeats per point, and at least two alternating rounds even where one step takes
    # seconds: near the crossover the series lie close together and one slow moment can flip them
    # (docs/benchmarks.md has the runs that showed it)
    prof.caps.budget_s = 3.0
    prof.caps.min_repeats = 2
    prof.ops_only = ["linear chunked", "softmax (SDPA)"]
    prof.ops_T = powers_of_two(256, args.ops_max_T)
    ops = run_benchmark("ops", prof, out=args.out, command=command)
    prof.sizes, prof.forms = (args.size,), ("chunked",)
    prof.train_T = powers_of_two(256, args.max_T)
    train = run_benchmark("train", prof, out=args.out, command=command)
    gen = None
    if not args.skip_generate:
        prof.sizes = ("4L-128",)
        # a decoded token takes milliseconds: the budget buys many repeats, and their minimum is
        # what holds still on a shared machine
        prof.caps.repeats = 10
        prof.generate_T = powers_of_two(256, args.generate_max_T)
        gen = run_benchmark("generate", prof, out=args.out, command=command)

    print("\n" + "=" * 80)
    for line in summary_lines(ops, train, gen, args.size):
        print(line)
    print(f"(quick profile, {time.perf_counter() - t0:.0f}s; `lintrans bench all --profile full` for the full record)")
    print(f"record written to {args.out.resolve()}/ (ops, train{', generate' if gen is not None else ''}: "
          ".json .csv .md .png)")
    return 0
