"""`lintrans experiment NAME`: the learning studies (context, recall, regression, distill).

Each study sweeps the learning rate per mechanism (seed 0), trains every seed at the chosen rate,
and writes NAME.json (settings, machine, sweep, every run's curves and metrics, summary) and
NAME_*.png under --out; finished runs are kept under --out/runs and skipped when a study is
started again. See docs/experiments.md.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

STUDIES = ("context", "recall", "regression", "distill")


def default_out(name: str, quick: bool) -> Path:
    # a --quick run never lands in the committed record folder unless --out says so
    return Path("runs/experiments") / f"{name}-quick" if quick else Path("docs/results/experiments") / name


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", choices=STUDIES)
    p.add_argument("--quick", action="store_true",
                   help="tiny settings (minutes) that check the machinery; not a result")
    p.add_argument("--out", type=Path, default=None,
                   help="record folder (default docs/results/experiments/NAME, or runs/experiments/NAME-quick "
                        "with --quick)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained in parallel processes, each with max(1, cores // jobs) torch threads "
                        "(default 1: in this process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--mechanisms", nargs="+", metavar="SPEC", default=None,
                   help="attention specs: softmax, linear:elu, linear:based, sliding-window:window=64, "
                        "NAME:key=value,... (default: the study's list)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per point (default: the study's, 3)")
    p.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                   help="learning rates of the sweep (default: the study's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change any other setting of the study (see the JSON's settings), e.g. --set steps=300")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw the PNGs from an existing NAME.json in --out, training nothing")


def _changes(args: argparse.Namespace) -> dict:
    from .study import parse_value

    changes = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set needs KEY=VALUE, got {item!r}")
        changes[key] = parse_value(value)
    for name in ("mechanisms", "seeds", "lrs"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return changes


def run(args: argparse.Namespace) -> int:
    import json

    from .study import resolve_settings, write_record

    mod = importlib.import_module(f"lintrans.experiments.{args.study}")
    out = args.out if args.out is not None else default_out(args.study, args.quick)
    try:
        if args.plot_only:
            path = out / f"{args.study}.json"
            if not path.is_file():
                raise ValueError(f"--plot-only needs an existing record {path}")
            record = json.loads(path.read_text())
        else:
            if isinstance(args.jobs, bool) or args.jobs < 1:
                raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
            default = resolve_settings(mod.DEFAULT, mod.QUICK) if args.quick else mod.DEFAULT
            settings = resolve_settings(default, _changes(args))
            settings["quick"] = bool(args.quick)
            mod.validate(settings)
            record = mod.run_study(settings, out, jobs=args.jobs, progress=not args.no_progress)
    except (ValueError, TypeError) as e:
        print(f"lintrans experiment: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lintrans experiment: interrupted; finished runs are kept in {out / 'runs'}, "
              "the same command resumes", file=sys.stderr)
        return 130
    trained = record.pop("runs_trained", None)
    if not args.plot_only:
        record = json.loads(write_record(out, args.study, record).read_text())
        print(f"wrote {out / (args.study + '.json')} ({trained} runs trained now, the rest from {out / 'runs'})")
    for p in mod.plot(record, out):
        print(f"wrote {p}")
    print(mod.table(record))
    return 0
