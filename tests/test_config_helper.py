"""lintrans.config: one dataclass gives typed flags, KEY=VALUE overrides, files and printing."""
import argparse
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import pytest

from lintrans.config import (add_arguments, apply_flags, apply_overrides, describe, dump, from_dict, read_file,
                             set_key)


@dataclass
class Inner:
    size: int = field(default=4, metadata={"help": "how many", "low": 1})
    rate: float = 0.5
    name: str = "x"
    scale: Optional[float] = None
    chunk: Union[int, Literal["auto"]] = 64
    mode: str = field(default="a", metadata={"choices": ("a", "b")})
    options: dict = field(default_factory=dict)


@dataclass
class Sample:
    quick: bool = False
    progress: bool = True
    steps: int = 10
    lrs: list[float] = field(default_factory=lambda: [1e-3])
    shapes: list[list[int]] = field(default_factory=lambda: [[8, 2]])
    inner: Inner = field(default_factory=Inner)


def parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(p, Sample)
    return apply_flags(Sample(), p.parse_args(argv), label=lambda k: f"--{k}")


def test_flags_are_typed_and_named_after_the_keys():
    s = parse(["--quick", "--no-progress", "--steps", "3", "--lrs", "1e-3", "3e-3", "--shapes", "[[4,1],[8,2]]",
               "--inner.size", "7", "--inner.scale", "none", "--inner.chunk", "auto", "--inner.mode", "b",
               "--inner.options", "{a: 1}", "--inner.name", "12"])
    assert s.quick is True and s.progress is False and s.steps == 3 and s.lrs == [1e-3, 3e-3]
    assert s.shapes == [[4, 1], [8, 2]]
    assert s.inner == Inner(size=7, scale=None, chunk="auto", mode="b", options={"a": 1}, name="12")
    assert parse(["--quick", "false", "--inner.chunk", "32"]).quick is False
    assert parse(["--inner.chunk", "32"]).inner.chunk == 32


@pytest.mark.parametrize("argv, error, match", [
    (["--steps", "x"], TypeError, "--steps must be an int, got 'x'"),
    (["--steps", "1.5"], TypeError, "--steps must be an int"),
    (["--quick", "maybe"], TypeError, "--quick must be a bool"),
    (["--lrs", "1e-3", "fast"], TypeError, "every entry of --lrs must be a number, got 'fast'"),
    (["--shapes", "[[4, 1.5]]"], TypeError, "every entry of every entry of --shapes must be an int"),
    (["--shapes", "64"], TypeError, "--shapes must be a list of list of int, got 64"),
    (["--inner.size", "0"], ValueError, r"--inner.size must be an int >= 1, got 0"),
    (["--inner.rate", "inf"], ValueError, "--inner.rate must be a finite number, got inf"),
    (["--inner.chunk", "big"], TypeError, r"--inner.chunk must be an int or one of \['auto'\], got 'big'"),
    (["--inner.mode", "c"], ValueError, r"--inner.mode must be one of \['a', 'b'\], got 'c'"),
    (["--inner.options", "[1]"], TypeError, "--inner.options must be a table"),
])
def test_bad_flag_values_name_the_key(argv, error, match):
    with pytest.raises(error, match=match):
        parse(argv)


def test_abbreviations_and_unknown_flags_are_argparse_errors():
    with pytest.raises(SystemExit):
        parse(["--ste", "3"])


def test_overrides_and_unknown_keys():
    s = apply_overrides(Sample(), ["steps=5", "inner.options.deep.x=1", "inner.options.y=[1, 2]", "inner.rate=2"])
    assert s.steps == 5 and s.inner.options == {"deep": {"x": 1}, "y": [1, 2]} and s.inner.rate == 2.0
    with pytest.raises(ValueError, match=r"unknown config key 'inner.sise'; keys of \[inner\] are \[.*'size'"):
        apply_overrides(Sample(), ["inner.sise=3"])
    with pytest.raises(ValueError, match=r"unknown config key 'stepz'; allowed: \[.*'steps'"):
        apply_overrides(Sample(), ["stepz=3"])
    with pytest.raises(ValueError, match="'steps' is not a table"):
        apply_overrides(Sample(), ["steps.x=3"])
    with pytest.raises(ValueError, match=r"'inner.options.k' is 'v', not a table, so 'inner.options.k.x' cannot be set"):
        apply_overrides(Sample(), ["inner.options.k=v", "inner.options.k.x=1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        apply_overrides(Sample(), ["steps"])
    s = Sample()
    with pytest.raises(TypeError):
        set_key(s, "inner.options", [1])
    assert s.inner.options == {}  # a failed set changes nothing


def test_files_round_trip_and_values_from_files_are_not_converted(tmp_path):
    (tmp_path / "a.toml").write_text('steps = 3\nlrs = [0.1, 1]\n[inner]\nsize = 2\noptions = { k = "v" }\n')
    s = from_dict(Sample, read_file(tmp_path / "a.toml"))
    assert s.steps == 3 and s.lrs == [0.1, 1.0] and s.inner.size == 2 and s.inner.options == {"k": "v"}
    (tmp_path / "b.yaml").write_text(dump(s))
    assert from_dict(Sample, read_file(tmp_path / "b.yaml")) == s
    with pytest.raises(TypeError, match="config key 'steps' must be an int, got '3'"):
        from_dict(Sample, {"steps": "3"})
    with pytest.raises(TypeError, match="config key 'quick' must be a bool, got 1"):
        from_dict(Sample, {"quick": 1})
    with pytest.raises(TypeError, match=r"section \[inner\] must be a table"):
        from_dict(Sample, {"inner": 3})
    # YAML as people write it: 3e-4 and 1e-3 are numbers (PyYAML's YAML 1.1 would read strings)
    (tmp_path / "e.yaml").write_text("inner:\n  rate: 3e-4\nlrs: [1e-3, 2E-3, -1e+2]\n")
    s = from_dict(Sample, read_file(tmp_path / "e.yaml"))
    assert s.inner.rate == 3e-4 and s.lrs == [1e-3, 2e-3, -100.0]
    (tmp_path / "c.toml").write_text("[inner\n")
    with pytest.raises(ValueError, match="c.toml is not valid TOML"):
        read_file(tmp_path / "c.toml")
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        read_file(tmp_path / "nope.toml")


def test_describe():
    assert describe(Optional[int], {"low": 1}) == "an int >= 1 or None"
    assert describe(list[str]) == "a list of str"


def test_flag_help_says_only_what_the_metavar_does_not():
    from lintrans.config import flag_help, keys

    table = keys(Sample)
    assert flag_help(*table["inner.size"]) == "how many [an int >= 1; default 4]"
    assert flag_help(*table["inner.scale"]) == ""  # a number, not set: nothing to add
    assert flag_help(*table["inner.name"]) == "[default x]"
    assert flag_help(*table["inner.mode"]) == "[one of ['a', 'b']; default a]"
    assert flag_help(*table["shapes"]) == "[a list of list of int; default [[8, 2]]]"
    assert flag_help(*table["lrs"]) == "[default [0.001]]"


def test_bench_and_experiment_help_is_not_padded(capsys):
    from lintrans.cli import main

    for argv in (["bench", "--help"], ["experiment", "recall", "--help"], ["experiment", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "or None" not in out and "default none" not in out and "``" not in out, argv
