import json

import pytest

from lintrans.cli import main

from experiment_helpers import check_record, run_cli, trained

PNGS = ("final", "curves", "wallclock", "spikes", "lr_sweep")


def test_quick_study_writes_its_record_and_resumes(tmp_path, capsys):
    assert run_cli("context", tmp_path) == 0
    first = capsys.readouterr().out
    data = check_record(tmp_path, "context", PNGS)
    s = data["settings"]
    n_runs = len(s["mechanisms"]) * (len(s["lrs"]) + len(s["contexts"]) * s["seeds"] - 1)
    assert trained(first) == n_runs == len(list((tmp_path / "runs").glob("*.json")))
    run = data["runs"][0]
    assert len(run["train_loss"]) == len(run["seconds"]) == s["steps"]
    assert [e["step"] for e in run["evals"]] == list(range(0, s["steps"] + 1, s["eval_every"]))
    assert set(data["summary"]["final_val_loss"]["linear:elu"]) == {str(T) for T in s["contexts"]}
    assert data["summary"]["same_time"]["mechanisms"]["softmax"]["finish_seconds"]["n"] == s["seeds"]
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()}
    # started again: every run is found in the store, nothing is trained, the record is the same
    assert run_cli("context", tmp_path) == 0
    assert trained(capsys.readouterr().out) == 0
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()} == mtimes
    assert json.loads((tmp_path / "context.json").read_text())["runs"] == data["runs"]


def test_parallel_jobs_give_the_same_results(tmp_path, capsys):
    args = ["--mechanisms", "softmax", "--seeds", "1", "--set", "contexts=[32]", "--set", "steps=4"]
    assert run_cli("context", tmp_path / "a", *args) == 0
    assert run_cli("context", tmp_path / "b", "--jobs", "2", *args) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / d / "context.json").read_text()) for d in "ab")
    # the same runs; only float rounding differs (the workers have 1 torch thread, this process 2)
    for ra, rb in zip(a["runs"], b["runs"]):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4)
    assert a["sweep"]["chosen"] == b["sweep"]["chosen"]


def test_plot_only_redraws(tmp_path, capsys):
    assert run_cli("context", tmp_path, "--mechanisms", "softmax", "--seeds", "1", "--set", "contexts=[32]",
                   "--set", "steps=2") == 0
    (tmp_path / "context_final.png").unlink()
    assert main(["experiment", "context", "--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "context_final.png").is_file()


def test_quick_does_not_default_to_the_record_folder():
    from lintrans.experiments.cli import default_out

    assert "docs" not in str(default_out("context", True))
    assert str(default_out("context", False)) == "docs/results/experiments/context"


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    cases = [
        (["--mechanisms", "bogus"], "attention must be one of"),
        (["--set", "contexts=[32,48]"], "multiples of every context"),
        (["--set", "nope=1"], "unknown setting"),
        (["--set", "steps=x"], "steps"),
        (["--set", "sweep_context=16"], "sweep_context"),
        (["--jobs", "0"], "--jobs"),
        (["--lrs", "2"], "lrs"),
        (["--set", "contexts=64"], "contexts"),
    ]
    for args, match in cases:
        assert run_cli("context", tmp_path, *args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("lintrans experiment: ") and match in err and err.count("\n") == 1, (args, err)
    assert not (tmp_path / "runs").exists()
