"""`lintrans experiment NAME`: the learning studies (context, recall, regression, distill).

Each study sweeps the learning rate per mechanism (seed 0), trains every seed at the chosen rate,
and writes NAME.json (settings, machine, sweep, every run's curves and metrics, summary) and
NAME_*.png under --out; finished runs are kept under --out/runs and skipped when a study is
started again. Every setting of a study is a flag (``--steps 300``, ``--mechanisms softmax
linear:elu``) and a ``--set`` key (``--set steps=300``), typed by the study's defaults (see
``lintrans experiment NAME --help`` and docs/experiments.md).
"""
from __future__ import annotations

import argparse
import importlib
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

STUDIES = ("context", "recall", "regression", "distill")
INCOMPLETE = 3  # exit status when --max-runs stopped a study before its end


@dataclass
class RunOptions:
    """How a study runs (where, how many runs at a time, what it prints); what it measures is its settings."""

    quick: bool = field(default=False, metadata={"help": "tiny settings (about a minute) that check the machinery; "
                                                         "not a result"})
    setting: Optional[str] = field(default=None, metadata={
        "help": "a named preset of the study's settings (recall: hard), applied before --set and flags; "
                "its record folder is NAME-SETTING"})
    out: Optional[str] = field(default=None, metadata={
        "help": "record folder (default docs/results/experiments/NAME, or runs/experiments/NAME-quick with --quick)"})
    jobs: int = field(default=1, metadata={
        "low": 1, "help": "runs trained in parallel processes, each with max(1, cores // jobs) torch threads "
                          "(default 1: in this process)"})
    device: str = field(default="cpu", metadata={
        "help": "where every run trains: cpu (default), cuda or cuda:N (checked before any work). Runs already in "
                "--out/runs are reused whatever trained them"})
    max_runs: Optional[int] = field(default=None, metadata={
        "low": 1, "help": "train at most this many runs; if runs remain, stop with exit status 3 (finished runs "
                          "are kept, the same command resumes): a long study in pieces, e.g. one per lease of a GPU"})
    progress: bool = field(default=True, metadata={"help": "progress bar (--no-progress: none)"})
    plot_only: bool = field(default=False, metadata={
        "help": "redraw the PNGs from an existing NAME.json in --out, training nothing"})
    print_settings: bool = field(default=False, metadata={"help": "print the resolved settings and exit"})
    estimate: bool = field(default=False, metadata={
        "help": "time a few training steps of every model and print what the runs not yet in --out/runs would "
                "cost with --jobs, training nothing (studies with a cost model: context)"})


def option_label(name: str) -> str:
    from lintrans.config import flag_name

    return flag_name(name)


def default_out(name: str, quick: bool, setting: Optional[str] = None) -> Path:
    # a --quick run never lands in the committed record folder unless --out says so
    folder = name if setting is None else f"{name}-{setting}"
    return Path("runs/experiments") / f"{folder}-quick" if quick else Path("docs/results/experiments") / folder


def out_folder(study: str, opts: RunOptions) -> Path:
    """Where a study run with ``opts`` writes its record: --out, else ``default_out``."""
    return Path(opts.out) if opts.out is not None else default_out(study, opts.quick, opts.setting)


def record_folder(argv: list) -> Path:
    """The record folder ``lintrans experiment *argv`` writes to, parsed as that command parses it
    (``--out=PATH``, the last ``--out``, ``--setting``, ``--quick``); for tools around the CLI."""
    from lintrans.cli import build_parser
    from lintrans.config import apply_flags

    args = build_parser(only="experiment").parse_args(["experiment", *argv])
    return out_folder(args.study, apply_flags(RunOptions(), args, dest="opt:", label=option_label))


def configure(p: argparse.ArgumentParser) -> None:
    from lintrans.config import add_arguments

    from .study import settings_class

    sub = p.add_subparsers(dest="study", metavar="STUDY", required=True)
    for name in STUDIES:
        mod = importlib.import_module(f"lintrans.experiments.{name}")
        about = re.sub(r"``(.+?)``", r"\1", mod.__doc__.splitlines()[0])  # plain text, not reST
        sp = sub.add_parser(name, help=about, description=about, allow_abbrev=False)
        add_arguments(sp, RunOptions, dest="opt:")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change one setting, e.g. --set steps=300 (repeatable; the same as its flag)")
        group = sp.add_argument_group("settings", "what the study measures (defaults: the study's; with --quick "
                                                  "its tiny ones); recorded in NAME.json")
        add_arguments(group, settings_class(name, mod.DEFAULT, getattr(mod, "LIMITS", None), getattr(mod, "HELP", None)),
                      dest="setting:")


def resolve(mod, args: argparse.Namespace, quick: bool, setting: Optional[str] = None) -> dict:
    """The study's settings: its DEFAULT, then the preset ``setting`` (the module's PRESETS), then
    QUICK with --quick (and the module's QUICK_PRESETS[setting] with both), then --set items, then flags."""
    import dataclasses

    from lintrans.checks import check_choice
    from lintrans.config import apply_flags, apply_overrides, set_key

    from .study import setting_label, settings_class

    settings = settings_class(mod.NAME, mod.DEFAULT, getattr(mod, "LIMITS", None))()
    presets = getattr(mod, "PRESETS", {})
    if setting is not None:
        if not presets:
            have = [n for n in STUDIES if getattr(importlib.import_module(f"lintrans.experiments.{n}"), "PRESETS", None)]
            raise ValueError(f"--setting: {mod.NAME} has no named settings (only {', '.join(have)} have them)")
        check_choice(f"--setting for {mod.NAME}", setting, sorted(presets))
    for key, value in (presets[setting].items() if setting is not None else ()):
        set_key(settings, key, value, label=setting_label)
    for key, value in (mod.QUICK.items() if quick else ()):
        set_key(settings, key, value, label=setting_label)
    quick_preset = getattr(mod, "QUICK_PRESETS", {}).get(setting, {}) if quick else {}
    for key, value in quick_preset.items():  # what --quick must change in the preset for the two to combine
        set_key(settings, key, value, label=setting_label)
    apply_overrides(settings, args.set, label=setting_label)
    apply_flags(settings, args, dest="setting:", label=option_label)
    return dataclasses.asdict(settings)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as an interrupt."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def run(args: argparse.Namespace) -> int:
    import json

    from lintrans.config import apply_flags, dump, given_flags

    from .study import StudyIncomplete, write_record

    mod = importlib.import_module(f"lintrans.experiments.{args.study}")
    out = None
    # SIGTERM stops a study as Ctrl-C does: its worker processes stopped, finished runs kept
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        opts = apply_flags(RunOptions(), args, dest="opt:", label=option_label)
        out = out_folder(args.study, opts)
        for folder in (out, *out.parents):  # before any work: else the first finished run fails to save
            if folder.exists():
                if not folder.is_dir():
                    raise ValueError(f"--out {out}: {folder} is a file, not a folder")
                break
        if opts.plot_only:
            given = [f"--{k.replace('_', '-')}" for k, _ in given_flags(args, "setting:")] + (["--set"] if args.set else [])
            given += [flag for flag, on in (("--estimate", opts.estimate), ("--print-settings", opts.print_settings),
                                            ("--max-runs", opts.max_runs is not None)) if on]
            if given:  # they would change nothing: the record says what ran (--setting, --quick pick its folder)
                raise ValueError(f"--plot-only redraws the record as it is; it takes no settings, got {given}")
            path = out / f"{args.study}.json"
            if not path.is_file():
                raise ValueError(f"--plot-only needs an existing record {path}")
            record = json.loads(path.read_text())
        else:
            from lintrans.device import resolve_device

            device = str(resolve_device(opts.device, what="--device"))  # before any work
            settings = resolve(mod, args, opts.quick, opts.setting)
            settings["quick"], settings["device"], settings["setting"] = opts.quick, device, opts.setting
            mod.validate(settings)
            if opts.print_settings:
                print(dump(settings), end="")
                return 0
            if opts.estimate:
                if not hasattr(mod, "estimate"):
                    raise ValueError(f"--estimate is available for the context study only, not {args.study}")
                mod.estimate(settings, jobs=opts.jobs, device=device, out=out)
                return 0
            record = mod.run_study(settings, out, jobs=opts.jobs, progress=opts.progress, device=device,
                                   max_runs=opts.max_runs)
    except StudyIncomplete as e:
        print(f"lintrans experiment: {e}; finished runs are kept in {out / 'runs'}, the same command resumes",
              file=sys.stderr)
        return INCOMPLETE
    except (ValueError, TypeError) as e:
        print(f"lintrans experiment: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"lintrans experiment: interrupted; finished runs are kept in {out / 'runs'}, "
              "the same command resumes", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(e, _Terminated) else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    trained, reused = record.pop("runs_trained", 0), record.pop("runs_reused", 0)
    if not opts.plot_only:
        record = json.loads(write_record(out, args.study, record).read_text())
        print(f"wrote {out / (args.study + '.json')} ({runs_line(trained, reused, out / 'runs')})")
    from .study import QUICK_BANNER, machinery_check

    quick = bool(record.get("settings", {}).get("quick"))
    with machinery_check(quick):
        for p in mod.plot(record, out):
            print(f"wrote {p}")
    print(mod.table(record))
    if quick:
        print(f"{QUICK_BANNER} (expect chance-level scores); `lintrans experiment {args.study}` without --quick "
              f"runs the study (its committed record: {default_out(args.study, False, opts.setting)})")
    return 0


def runs_line(trained: int, reused: int, store: Path) -> str:
    if not reused:
        return f"{trained} run{'s' * (trained != 1)} trained now"
    if not trained:
        return f"all {reused} runs from {store}"
    return f"{trained} trained now, {reused} from {store}"
