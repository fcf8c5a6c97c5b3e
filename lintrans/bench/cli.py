"""`lintrans bench ops|train|generate|loss|all --profile quick|full [--out DIR]`.

Each benchmark prints a table (time per step against T, one row per algorithm), and with ``--out``
writes ``<out>/<name>.json`` (rows + machine + settings), ``.csv``, ``.md`` and a log-log ``.png``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .measure import Caps, Point

BENCHMARKS = ("ops", "train", "generate", "loss")
OP_DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("fp32", "bf16", "fp16")


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, T = [], lo
    while T <= hi:
        out.append(T)
        T *= 2
    return out


@dataclass
class Profile:
    ops_T: list[int]
    train_T: list[int]
    generate_T: list[int]
    sizes: tuple[str, ...]
    forms: tuple[str, ...]
    caps: Caps
    ops_only: Optional[list[str]] = None
    forward_only: bool = False  # ops: time the forward pass alone
    dtype: str = "float32"  # ops: the inputs' dtype
    precision: str = "fp32"  # train: autocast precision
    decoders: tuple[str, ...] = ("softmax", "linear")
    mechanisms: tuple[str, ...] = ()  # other attention names for train, e.g. gated-linear
    notes: dict = field(default_factory=dict)


def profiles() -> dict[str, Profile]:
    from .train import LINEAR_FORMS

    return {
        # small enough for `make demo` (its time: docs/benchmarks.md): one model size, short time caps
        "quick": Profile(
            ops_T=powers_of_two(256, 8192), train_T=powers_of_two(256, 8192), generate_T=powers_of_two(256, 8192),
            sizes=("4L-128",), forms=("chunked", "attention", "state_parallel"),
            caps=Caps(time_s=8.0, repeats=3, budget_s=1.0, min_repeats=2),
        ),
        "full": Profile(
            ops_T=powers_of_two(256, 65536), train_T=powers_of_two(256, 32768), generate_T=powers_of_two(256, 16384),
            sizes=("4L-128", "6L-384", "12L-768"), forms=LINEAR_FORMS, caps=Caps(time_s=60.0, repeats=5, budget_s=10.0, min_repeats=3),
        ),
    }


@dataclass
class BenchOptions:
    """The command line of ``lintrans bench``: a profile and what to change in it."""

    profile: str = field(default="quick", metadata={"choices": ("quick", "full"), "help": "quick: contexts up "
                                                    "to 8k (minutes); full: up to 16k-64k (hours)"})
    out: Optional[str] = field(default=None, metadata={"help": "write JSON/CSV/MD/PNG into this folder (default: "
                                                                "print the tables only)"})
    max_T: Optional[int] = field(default=None, metadata={
        "help": "longest context to try (overrides the profile; 256 is the shortest measured)", "low": 256})
    T: Optional[list[int]] = field(default=None, metadata={
        "help": "exactly these contexts instead of the powers of two up to --max-T", "low": 1})
    decoders: Optional[list[str]] = field(default=None, metadata={
        "help": "generate: the attentions to decode with (any of lintrans.nn.available_attention() but none, or "
                "all; default softmax and linear)"})
    time_cap: Optional[float] = field(default=None, metadata={"help": "seconds per step past which a curve stops",
                                                              "low": 0, "low_open": True})
    memory_cap_gb: Optional[float] = field(default=None, metadata={
        "help": "predicted peak past which a curve stops (default: half the available memory)", "low": 0,
        "low_open": True})
    threads: Optional[int] = field(default=None, metadata={"help": "torch intra-op threads (default: torch's choice)",
                                                           "low": 1})
    ops: Optional[list[str]] = field(default=None, metadata={
        "help": "op series to include (substrings, e.g. chunked softmax)"})
    forward_only: bool = field(default=False, metadata={
        "help": "ops: time the forward pass alone, without gradients (default: forward + backward)"})
    sizes: Optional[list[str]] = field(default=None, metadata={
        "help": "model sizes for train/generate (default: the profile's)"})
    forms: Optional[list[str]] = field(default=None, metadata={
        "help": "linear forms for train (default: the profile's)"})
    mechanisms: Optional[list[str]] = field(default=None, metadata={
        "help": "other attention mechanisms to train beside softmax and linear, e.g. gated-linear retention"})
    repeats: Optional[int] = field(default=None, metadata={
        "help": "timed repeats per point, all taken whatever the profile's time budget (the fastest is kept)",
        "low": 1})
    dtype: str = field(default="float32", metadata={
        "help": "ops: the dtype of q, k, v (16-bit ones: every op accumulates its state in float32; SDPA "
                "takes its flash kernel on CUDA)", "choices": OP_DTYPES})
    precision: str = field(default="fp32", metadata={
        "help": "train: fp32, or the forward under torch.autocast in bf16 or fp16 (as train.precision)",
        "choices": PRECISIONS})
    device: str = field(default="cpu", metadata={"help": "where to run: cpu, cuda or cuda:N"})


def configure(p: argparse.ArgumentParser) -> None:
    from lintrans.config import add_arguments

    p.add_argument("which", nargs="?", default="all", choices=BENCHMARKS + ("all",),
                   help="which benchmark to run (default all: each in turn)")
    add_arguments(p, BenchOptions, dest="opt:")


def _available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Progress:
    """A progress bar over the planned points, naming the point just measured."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, point: Point) -> None:
        t = f"{point.time_s * 1e3:.0f}ms" if point.time_s else point.status
        self.bar.set_postfix_str(f"{point.series} T={point.T}: {t}"[:70])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_benchmark(which: str, prof: Profile, *, device: str = "cpu", out: Optional[Path] = None,
                  command: Optional[str] = None, settings: Optional[dict] = None) -> dict:
    """Run one benchmark; print its table; write results when ``out``. Returns {'rows', 'headline', ...}."""
    from .machine import machine_info
    from .plots import plot_sweep
    from .report import headline, table, write_results
    from .trend import verdict

    t0 = time.perf_counter()
    if which == "ops":
        from .ops import GATED_OP, op_series, run_ops, select_series
        from lintrans.ops.chunk_tuning import auto_chunk_size

        chunk = lambda T: auto_chunk_size(T, 64, 64, torch.float32, device)  # noqa: E731 (elu: F = D)
        gated_chunk = lambda T: auto_chunk_size(T, 64, 64, torch.float32, device, gated=True)  # noqa: E731
        series = op_series(64, device=device)
        n = len(select_series(series, prof.ops_only) if prof.ops_only else series) * len(prof.ops_T)
        bar = Progress(n, "ops")
        points = run_ops(prof.ops_T, prof.caps, only=prof.ops_only, chunk_size=chunk, gated_chunk=gated_chunk,
                         device=device, on_point=bar, backward=not prof.forward_only,
                         dtype=getattr(torch, prof.dtype))
        passes = "forward only" if prof.forward_only else "forward + backward"
        title = f"causal attention op, {passes} (B=1, H=8, D=64, {prof.dtype})"
        from .ops import GATED_DELTA_OP
        from .peers import FLA_DELTA_SERIES, FLA_GATED_SERIES, FLA_SERIES

        comparisons = [("linear chunked", "softmax (SDPA)"), (GATED_OP, "linear chunked"), (GATED_OP, "softmax (SDPA)"),
                       (FLA_SERIES, "linear chunked"), (FLA_GATED_SERIES, GATED_OP),  # fla: on CUDA, if installed
                       (FLA_DELTA_SERIES, GATED_DELTA_OP)]
    elif which == "train":
        from .train import run_train

        n = len(prof.sizes) * (len(prof.forms) + len(prof.mechanisms) + 2) * len(prof.train_T)
        bar = Progress(n, "train")
        points = run_train(prof.train_T, prof.caps, sizes=prof.sizes, forms=prof.forms, mechanisms=prof.mechanisms,
                           device=device, on_point=bar, precision=prof.precision)
        title = "GPT training step (forward + backward + AdamW), batch 1, vocab 50257"
        if prof.precision != "fp32":
            title += f", {prof.precision} autocast"
        comparisons = [(f"{s} linear chunked", f"{s} softmax (SDPA)") for s in prof.sizes]
        comparisons += [(f"{s} {m}", f"{s} softmax (SDPA)") for s in prof.sizes for m in prof.mechanisms]
    elif which == "loss":
        from .loss import run_loss

        bar = Progress(2 * len(prof.train_T), "loss")
        points = run_loss(prof.train_T, prof.caps, device=device, on_point=bar)
        title = "LM-head loss, forward + backward (D=128, vocab 50257)"
        comparisons = [("linear_cross_entropy", "logits + F.cross_entropy")]
    else:
        from .generate import run_generate

        bar = Progress(len(prof.decoders) * len(prof.generate_T), "generate")
        points = run_generate(prof.generate_T, prof.caps, size=prof.sizes[0], device=device, on_point=bar,
                              decoders=prof.decoders)
        title = f"time per generated token, GPT {prof.sizes[0]}, after a prefill of T tokens"
        comparisons = [("linear state", "softmax KV cache")]
    bar.close()
    rows = [p.row() for p in points]
    measured = {r["series"] for r in rows}  # comparisons of series left out (--ops) are dropped
    # each comparison with whether its curves hold together (trend.verdict): a disturbed one gets no ratio
    speedups = [verdict(rows, fast, slow) for fast, slow in comparisons if {fast, slow} <= measured]
    verb = {"generate": "decodes", "train": "trains"}.get(which, "runs")
    lines = [headline(s, verb) for s in speedups]
    if which == "train":
        from .report import floor_line
        from .train import FLOOR

        lines += [line for s in prof.sizes if (line := floor_line(rows, f"{s} softmax (SDPA)", f"{s} linear chunked",
                                                                  f"{s} {FLOOR}"))]
    if which == "generate":
        from .generate import decode_lines

        lines += decode_lines(rows, prof.sizes[0])
    print(f"\n== {which}: {title}  [{time.perf_counter() - t0:.0f}s]")
    print("time per step, ms (s where marked):")
    print(table(rows, "time_s"))
    if any(r.get("peak_bytes") for r in rows):
        print("peak memory above the start of the step (prefill for generate):")
        print(table(rows, "peak_bytes"))
    if any(r.get("cache_bytes") for r in rows):
        print("cache kept for decoding:")
        print(table(rows, "cache_bytes"))
    for line in lines:
        print("headline:", line)
    errors = {}  # what each failed point said, once per message: the table's cells only say "error"
    for r in rows:
        if r["status"].startswith("error"):
            errors.setdefault(r["status"], []).append(f"{r['series']} T={r['T']}")
    for message, where in errors.items():
        print(f"{message} ({', '.join(where[:3])}{', ...' if len(where) > 3 else ''})", file=sys.stderr)
    result = {"rows": rows, "speedups": speedups, "headline": " | ".join(lines), "lines": lines, "title": title}
    if out is not None:
        from .machine import matmul_probe

        info = {**machine_info(device), **matmul_probe(device=device)}  # the speed it ran at, just after
        meta = {"benchmark": which, "title": title, "command": command, "settings": settings,
                "machine": info, "caps": prof.caps.__dict__,
                "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": _load_average(),
                "headline": result["headline"], "speedups": speedups,
                "memory_method": "peak RSS rise during one step (VmHWM after clear_refs; malloc mmap threshold 128 KiB)"}
        from .report import noise_warning

        warning = noise_warning(info)
        if warning is not None:  # in the record too, beside the headline it qualifies
            meta["noise_warning"] = warning
        paths = write_results(out, which, rows, meta)
        features = f" ({info['cpu_features']})" if info.get("cpu_features") else ""
        sub = (f"{info['cpu']}{features}, {info['torch_threads']} threads, torch {info['torch']}, "
               f"matmul {info['matmul_gflops_median']:.0f} GFLOP/s at the end")
        # generation: what decoding keeps (KV cache vs state) says more than the prefill's peak
        second = ("cache_bytes", "cache (MiB)") if which == "generate" else ("peak_bytes", "peak memory (MiB)")
        ylabel = "seconds per token" if which == "generate" else "seconds per step"
        paths["png"] = plot_sweep(rows, Path(out) / f"{which}.png", title, ylabel=ylabel, second=second, subtitle=sub)
        print("wrote", ", ".join(str(p) for p in paths.values()))
        if warning is not None:
            print(warning, file=sys.stderr)
        result["noise_warning"] = warning
        result["machine"] = info
    return result


def _load_average() -> Optional[list]:
    """The machine's load average at the end of a record (1, 5, 15 minutes): how shared it was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _each_one_of(flag: str, values, allowed) -> None:
    """SystemExit naming ``flag`` unless every value is one of ``allowed`` (checks.check_choice)."""
    from lintrans.checks import check_choice

    try:
        for value in values:
            check_choice(f"each {flag}", value, allowed)
    except ValueError as e:
        raise SystemExit(f"lintrans bench: {e}")


def build_profile(args: BenchOptions) -> Profile:
    """The profile ``args.profile`` with the changes the command line asks for, checked."""
    from lintrans.config import check_fields, flag_name

    try:
        check_fields(args, label=flag_name)  # each option against its field's limits, as the flags are
    except (ValueError, TypeError) as e:
        raise SystemExit(f"lintrans bench: {e}")
    prof = profiles()[args.profile]
    if args.ops:
        from .ops import op_series, select_series

        try:
            select_series(op_series(64, device=args.device), args.ops)
        except ValueError as e:
            raise SystemExit(f"lintrans bench: --ops: {e}")
    if args.max_T:
        prof.ops_T = powers_of_two(256, args.max_T)
        prof.train_T = powers_of_two(256, args.max_T)
        prof.generate_T = powers_of_two(256, args.max_T)
    if args.T:
        if args.max_T is not None:
            raise SystemExit("lintrans bench: give --T or --max-T, not both")
        prof.ops_T = prof.train_T = prof.generate_T = sorted(set(args.T))
    if args.decoders:
        from .generate import decoder_series

        names = decoder_series()
        _each_one_of("--decoders", args.decoders, [*names, "all"])
        prof.decoders = tuple(names) if "all" in args.decoders else tuple(dict.fromkeys(args.decoders))
    if args.time_cap:
        prof.caps.time_s = args.time_cap
    mem = args.memory_cap_gb * 2**30 if args.memory_cap_gb else (_available_bytes() or 0) // 2
    prof.caps.memory_bytes = int(mem) or None
    prof.ops_only = args.ops
    prof.forward_only = args.forward_only
    prof.dtype = args.dtype
    from lintrans.train.precision import resolve_precision

    try:  # checked here, not point by point: a precision the device cannot run would fill the table with errors
        prof.precision = resolve_precision(args.precision, args.device, what="--precision")
    except ValueError as e:
        raise SystemExit(f"lintrans bench: {e}")
    from .sizes import resolve_size
    from .train import LINEAR_FORMS

    if args.sizes:
        try:
            args.sizes = [resolve_size(name, "--sizes") for name in args.sizes]
        except ValueError as e:
            raise SystemExit(f"lintrans bench: {e}")
    _each_one_of("--forms", args.forms or (), LINEAR_FORMS)
    if args.repeats is not None:
        prof.caps.repeats = args.repeats
        # asked for by number: all of them, whatever the profile's time budget per point (which
        # otherwise times a step slower than the budget once)
        prof.caps.budget_s = args.repeats * prof.caps.time_s
    if args.mechanisms:
        from lintrans.nn.registry import available_attention

        _each_one_of("--mechanisms", args.mechanisms,
                     [a for a in available_attention() if a not in ("softmax", "linear", "none")])
        prof.mechanisms = tuple(args.mechanisms)
    prof.sizes = tuple(args.sizes) if args.sizes else prof.sizes
    prof.forms = tuple(args.forms) if args.forms else prof.forms
    return prof


# the options that only some benchmarks read: given to another alone, they would be recorded unused
APPLIES_TO = {"decoders": ("generate",), "ops": ("ops",), "forward_only": ("ops",), "dtype": ("ops",),
              "sizes": ("train", "generate"), "forms": ("train",), "mechanisms": ("train",), "precision": ("train",)}


def check_applies(which: str, given: list[str]) -> None:
    """ValueError for an option ``which`` does not read (``all`` runs every benchmark: each applies)."""
    if which == "all":
        return
    for key in given:
        if which not in APPLIES_TO.get(key, (which,)):
            raise ValueError(f"--{key.replace('_', '-')} applies to bench {' and '.join(APPLIES_TO[key])}, "
                             f"not {which}")


def run(args) -> int:
    from lintrans.config import apply_flags, flag_name, given_flags
    from lintrans.device import resolve_device

    try:
        opts = apply_flags(BenchOptions(), args, dest="opt:", label=flag_name)
        opts.device = str(resolve_device(opts.device, what="--device"))
        defaults = BenchOptions()
        check_applies(args.which, [key for key, _ in given_flags(args, "opt:")  # a default changes nothing
                                   if getattr(opts, key) != getattr(defaults, key)])
        if args.which == "generate" and opts.sizes and len(opts.sizes) > 1:
            raise ValueError(f"--sizes: generate measures one model size, got {len(opts.sizes)}")
    except (ValueError, TypeError) as e:
        raise SystemExit(f"lintrans bench: {e}")
    if args.which == "all" and opts.sizes and len(opts.sizes) > 1:
        print(f"lintrans bench all: train measures every size of --sizes, generate the first ({opts.sizes[0]})",
              file=sys.stderr)
    prof = build_profile(opts)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    out = None
    if opts.out is not None:
        from lintrans._io import writable_folder

        try:  # before anything is measured, not when the results are written
            out = writable_folder(opts.out, "--out")
        except ValueError as e:
            raise SystemExit(f"lintrans bench: {e}")
    import dataclasses

    command = getattr(args, "command_line", None)  # set by lintrans.cli: the record says what made it
    for which in BENCHMARKS if args.which == "all" else (args.which,):
        run_benchmark(which, prof, device=opts.device, out=out, command=command, settings=dataclasses.asdict(opts))
    return 0
