"""tools/ab_kernels.py still runs against the package (no timing is checked: only that each mode
produces its rows)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lintrans.ops import native

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ab_kernels.py"


def _tool():
    spec = importlib.util.spec_from_file_location("ab_kernels", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


needs_native = pytest.mark.skipif(not native.active(), reason="native kernels not built here")


@needs_native
def test_native_against_fallback_writes_a_row_per_op_and_T(tmp_path, monkeypatch):
    tool = _tool()
    monkeypatch.setattr(tool, "matmul_probe", lambda: {})
    out = tmp_path / "ab.jsonl"
    tool.main(["--T", "37", "--H", "2", "--D", "8", "--rounds", "1", "--threads", "1",
               "--ops", "chunked", "gated", "aft", "sliding-window", "delta", "gated-delta", "--window", "5",
               "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["op"] for r in rows] == ["chunked", "gated", "aft", "sliding-window", "delta", "gated-delta"]
    assert set(rows[2]["results"]) == {"aft native", "aft pytorch", "chunked native"}
    assert "vector_features" in rows[0]["machine"]


@needs_native
def test_two_builds(tmp_path, monkeypatch):
    tool = _tool()
    monkeypatch.setattr(tool, "matmul_probe", lambda: {})
    lib = str(native.library_path())
    out = tmp_path / "ab.jsonl"
    before = native._lib, native._tried
    try:
        tool.main(["--builds", lib, lib, "--T", "20", "--H", "1", "--D", "4", "--rounds", "1", "--out", str(out)])
    finally:
        native._lib, native._tried = before  # the tool swaps the loaded library in and leaves the last one
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(rows[0]["results"]) == {"chunked old", "chunked new"}


def test_unknown_op_is_refused():
    with pytest.raises(SystemExit):
        _tool().main(["--ops", "nonsense"])


def test_decode_step_tool_prints_a_line_per_step_and_shape(capsys):
    """tools/ab_decode_steps.py runs against the package (its times are not checked)."""
    path = Path(__file__).resolve().parents[1] / "tools" / "ab_decode_steps.py"
    spec = importlib.util.spec_from_file_location("ab_decode_steps", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--rounds", "1", "--calls", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("B=1 ")]
    assert len(lines) == 8 and all("fused" in line and "PyTorch" in line for line in lines)
