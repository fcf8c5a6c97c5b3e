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
ARGS = ["regression", "--quick", "--mechanisms", "softmax", "--seeds", "1", "--lrs", "3e-3", "--set", "steps=2"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def pieces(tmp_path, budget, reserve):
    env = {**os.environ, "PYTHON": sys.executable, "BUDGET": str(budget), "RESERVE": str(reserve),
           "COPY_TO": str(tmp_path / "copy"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "tools" / "study_pieces.sh"), *ARGS, "--out", str(tmp_path / "rec")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_budget_with_no_room_trains_nothing_and_says_runs_remain(tmp_path):
    p = pieces(tmp_path, budget=5, reserve=10)  # SECONDS + reserve > budget before the first call
    assert p.returncode == 3, p.stderr
    assert not (tmp_path / "rec" / "runs").exists() and not (tmp_path / "copy").exists()


def test_pieces_complete_the_study_and_copy_only_this_calls_runs(tmp_path):
    (tmp_path / "rec" / "runs").mkdir(parents=True)
    (tmp_path / "rec" / "runs" / "earlier.json").write_text("{}")  # a run of an earlier piece: not copied
    p = pieces(tmp_path, budget=10**6, reserve=0)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("[study_pieces:") == 1  # a one-run study: one call
    copied = sorted(f.name for f in (tmp_path / "copy" / "runs").iterdir())
    assert len(copied) == 1 and copied[0] != "earlier.json"
    assert (tmp_path / "copy" / "regression.json").is_file()
