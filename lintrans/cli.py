"""`lintrans` / `python -m lintrans`: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import warnings

from . import __version__

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("lintrans.bench.demo", "the main job: quick benchmark profile with a headline"),
    "bench": ("lintrans.bench.cli", "benchmarks: attention ops, training step, generation (tables; JSON + PNG with --out)"),
    "tune": ("lintrans.bench.tune", "pick the fastest chunk size by measurement and cache it"),
    "cost": ("lintrans.bench.cost_cli", "parameters, FLOPs, state vs KV-cache bytes, arithmetic intensity, MFU"),
    "train": ("lintrans.train.cli", "train a GPT (any attention in lintrans.nn.available_attention()) from text or token files"),
    "sample": ("lintrans.models.sample_cli", "generate text from a checkpoint or a Hugging Face GPT-2 folder"),
    "experiment": ("lintrans.experiments.cli", "learning studies: context, recall, regression, distill (JSON + PNG)"),
}


def _load(name: str):
    return importlib.import_module(SUBCOMMANDS[name][0])


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lintrans", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"lintrans {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in SUBCOMMANDS.items():
        # allow_abbrev=False: a misspelt or shortened flag (--train.max_st) is an error, not a guess
        p = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        if only == name:
            _load(name).configure(p)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, extras: list[str],
                  argv: list[str] = ()) -> None:
    """Exit with the (innermost) subcommand's usage and, for each unknown flag, the closest known one: a
    typo (``--train.max_step``) names the key it meant, as ``--set`` and config files do."""
    import difflib

    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    target = sub.choices[command] if sub is not None and command in sub.choices else parser
    words = [a for a in argv if not a.startswith("-")]
    while (inner := next((a for a in target._actions if isinstance(a, argparse._SubParsersAction)), None)) \
            and (name := next((w for w in words if w in inner.choices), None)):  # e.g. experiment recall
        target = inner.choices[name]
    known = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extras:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and (close := difflib.get_close_matches(flag, known, n=1, cutoff=0.75)):
            hints.append(f"{flag}: did you mean {close[0]}?")
    target.error(f"unrecognized arguments: {' '.join(extras)}" + "".join("\n  " + h for h in hints))


def _nested_keys(parser: argparse.ArgumentParser, command: str | None, argv: list[str]) -> list[str]:
    """``--model.attention_options.form recurrent`` (a key inside a dict-valued key) as the command's
    ``--set model.attention_options.form=recurrent``, where the command has --set and the flag's
    first two parts are one of its keys."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    target = sub.choices.get(command) if sub is not None and command else None
    known = {o for a in target._actions for o in a.option_strings} if target is not None else set()
    if "--set" not in known:
        return argv

    def table(word):  # "--model.attention_options" of "--model.attention_options.form[=x]", else None
        parts = word.partition("=")[0][2:].split(".") if word.startswith("--") else []
        name = f"--{parts[0]}.{parts[1]}" if len(parts) > 2 and all(parts) else None
        return name if name in known else None

    tables = {t for w in argv if (t := table(w))}
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        flag, eq, value = word.partition("=")
        # a key inside a table, or the whole table given beside such keys: all become --set, so that
        # they apply in the order given (flags would apply after every --set)
        if table(word) or (flag in tables):
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] not in known:
                value, i = argv[i + 1], i + 1
            elif not eq:  # no value: leave it for argparse to report
                out.append(word)
                i += 1
                continue
            out += ["--set", f"{flag[2:]}={value}"]
        else:
            out.append(word)
        i += 1
    return out


def use_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, PyTorch
    >= 2.2, Linux) unless the variable is already set.

    Tensors above glibc's 32 MiB mmap threshold get fresh pages on every allocation; with 4 KiB
    pages, faulting them in took half of a chunked attention step at T = 16k on the 2-core
    benchmark machine (docs/benchmarks.md). PyTorch reads the variable at its first large
    allocation, so this must run before any tensor work; ``THP_MEM_ALLOC_ENABLE=0`` opts out.
    """
    if sys.platform.startswith("linux"):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: list[str] | None = None) -> int:
    use_huge_pages()
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        command = None
    parser = build_parser(only=command)
    typed = argv
    argv = _nested_keys(parser, command, argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, command, extras, argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.command_line = shlex.join(["lintrans", *typed])  # for records that name the command that made them
    shown = warnings.formatwarning
    warnings.formatwarning = _one_line  # a CLI user reads the warning, not the source line that raised it
    try:
        return int(_load(args.command).run(args) or 0)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)  # a command's one-line error: exit status 2, as every command's
        return 2
    finally:
        warnings.formatwarning = shown


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"lintrans: {category.__name__}: {message}\n"


if __name__ == "__main__":
    raise SystemExit(main())
