"""tools/study_pieces.sh: one run per call while the budget leaves room, new runs copied out, the
record too once the study is complete. Budgets are set so that the outcome does not depend on speed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDY = ["regression", "--quick", "--mechanisms", "softmax", "--seeds", "1", "--set", "steps=2"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def pieces(tmp_path, *args, budget=10**6, reserve=0):
    env = {**os.environ, "PYTHON": sys.executable, "BUDGET": str(budget), "RESERVE": str(reserve),
           "COPY_TO": str(tmp_path / "copy"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "tools" / "study_pieces.sh"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_budget_with_no_room_trains_nothing_and_says_runs_remain(tmp_path):
    # SECONDS + reserve > budget before the first call
    p = pieces(tmp_path, *STUDY, "--lrs", "3e-3", "--out", str(tmp_path / "rec"), budget=5, reserve=10)
    assert p.returncode == 3, p.stderr
    assert not (tmp_path / "rec" / "runs").exists() and not (tmp_path / "copy").exists()


def test_pieces_complete_the_study_and_copy_only_this_calls_runs(tmp_path):
    (tmp_path / "rec" / "runs").mkdir(parents=True)
    (tmp_path / "rec" / "runs" / "earlier.json").write_text("{}")  # a run of an earlier piece: not copied
    # two runs (a sweep of two rates): two calls; --out=PATH parsed as the CLI parses it
    p = pieces(tmp_path, *STUDY, "--lrs", "3e-3", "1e-2", f"--out={tmp_path / 'rec'}")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("[study_pieces:") == 2 and "exit 3]" in p.stdout and "exit 0]" in p.stdout
    copied = sorted(f.name for f in (tmp_path / "copy" / "runs").iterdir())
    assert len(copied) == 2 and "earlier.json" not in copied
    assert (tmp_path / "copy" / "regression.json").is_file()
    assert (tmp_path / "copy" / "regression_curves.png").is_file()


def test_a_bad_option_exits_2_and_copies_nothing(tmp_path):
    p = pieces(tmp_path, *STUDY, "--lrs", "x", "--out", str(tmp_path / "rec"))
    assert p.returncode == 2, p.stderr
    assert not (tmp_path / "copy").exists()


def test_a_budget_that_is_not_whole_seconds_exits_2(tmp_path):
    p = pieces(tmp_path, *STUDY, "--out", str(tmp_path / "rec"), budget="ten")
    assert p.returncode == 2 and "BUDGET and RESERVE must be whole seconds" in p.stderr
    assert not (tmp_path / "rec").exists()


def test_record_folder_parses_as_the_cli_does():
    from lintrans.experiments.cli import record_folder

    assert record_folder(["context", "--setting=gpu"]) == Path("docs/results/experiments/context-gpu")
    assert record_folder(["context", "--out=/tmp/x", "--setting", "gpu"]) == Path("/tmp/x")
    assert record_folder(["context", "--out", "/tmp/a", "--out", "/tmp/b"]) == Path("/tmp/b")
    assert record_folder(["recall", "--quick"]) == Path("runs/experiments/recall-quick")
