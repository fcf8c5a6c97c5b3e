"""TOML configs on Python 3.10, which has no tomllib: ``lintrans train --config x.toml`` reads them
through ``tomli`` (a dependency there). On newer Pythons the same path is taken with tomllib hidden
and a recording stand-in for tomli, so the fallback is exercised whatever Python runs the tests."""
import importlib
import sys
import types

import pytest

from lintrans.cli import main
from lintrans.config import read_file

CONFIG = '[model]\nn_layer = 3\nn_embd = 48\n[train]\nmax_steps = 7\n'


@pytest.fixture
def only_tomli(monkeypatch):
    """``import tomllib`` fails (as on 3.10) and ``import tomli`` gives a stand-in that records its
    calls and parses with the real parser (tomli is what became tomllib: the same API)."""
    real = importlib.import_module("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    calls = []
    tomli = types.ModuleType("tomli")
    tomli.loads = lambda text, **kw: calls.append(text) or real.loads(text, **kw)
    tomli.TOMLDecodeError = real.TOMLDecodeError
    monkeypatch.setitem(sys.modules, "tomllib", None)  # None in sys.modules: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "tomli", tomli)
    with pytest.raises(ImportError):
        import tomllib  # noqa: F401
    return calls


def test_train_reads_a_toml_config_through_tomli(only_tomli, tmp_path, capsys):
    (tmp_path / "c.toml").write_text(CONFIG)
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert only_tomli[-1] == CONFIG  # the user's file, through tomli (--help's defaults read the shipped one first)
    assert len(only_tomli) <= 2
    assert "n_layer: 3" in out and "n_embd: 48" in out and "max_steps: 7" in out


def test_tomli_errors_are_reported_as_invalid_toml(only_tomli, tmp_path):
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(ValueError, match="bad.toml is not valid TOML"):
        read_file(tmp_path / "bad.toml")
    assert only_tomli == ["[model\n"]


def test_without_tomllib_or_tomli_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    (tmp_path / "c.toml").write_text(CONFIG)
    with pytest.raises(ImportError, match=r"needs 'tomli' \(pip install tomli\), or use YAML"):
        read_file(tmp_path / "c.toml")
