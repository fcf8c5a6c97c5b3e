"""Every study end to end at --quick: the machinery works and its results are written. No test
here asserts a scientific outcome or times anything."""
import json

import pytest
import torch

from lintrans.cli import main
from lintrans.experiments.cli import default_out


def run_cli(name, out, *extra):
    return main(["experiment", name, "--quick", "--no-progress", "--out", str(out), *extra])


def trained(stdout: str) -> int:
    line = next(line for line in stdout.splitlines() if line.startswith("wrote") and ".json (" in line)
    counts = line.split(".json (", 1)[1]
    return 0 if counts.startswith("all ") else int(counts.split()[0])


def test_the_runs_line_says_where_each_run_came_from(tmp_path):
    from lintrans.experiments.cli import runs_line

    assert runs_line(16, 0, tmp_path) == "16 runs trained now"  # no "the rest from" when there is no rest
    assert runs_line(1, 0, tmp_path) == "1 run trained now"
    assert runs_line(0, 16, tmp_path) == f"all 16 runs from {tmp_path}"
    assert runs_line(2, 14, tmp_path) == f"2 trained now, 14 from {tmp_path}"


def test_quick_figures_say_they_are_a_machinery_check(tmp_path):
    from lintrans.experiments import study

    for active in (True, False):
        fig, ax = study.pyplot().subplots()
        fig.suptitle("curves")
        study.style(ax, "x", "y", "panel")
        with study.machinery_check(active):
            study.save(fig, tmp_path / "f.png")
        assert fig._suptitle.get_text() == (study.QUICK_BANNER + "\ncurves" if active else "curves")


def check_context(data):
    s = data["settings"]
    run = data["runs"][0]
    assert len(run["train_loss"]) == len(run["seconds"]) == s["steps"]
    assert [e["step"] for e in run["evals"]] == list(range(0, s["steps"] + 1, s["eval_every"]))
    last = s["mechanisms"][-1]
    assert set(data["summary"]["final_val_loss"][last]) == {str(T) for T in s["contexts"]}
    first = s["mechanisms"][0]
    assert data["summary"]["same_time"]["mechanisms"][first]["finish_seconds"]["n"] == s["seeds"]
    T = s["contexts"][-1]
    assert len(run["final_by_position"]) == len(data["summary"]["position_buckets"][str(run["context"])])
    assert len(data["baselines"]["by_position"]["trigram"][str(T)]) == len(data["summary"]["position_buckets"][str(T)])
    assert data["corpus"]["python"] and len(data["corpus"]["sha256"]) == 64
    assert [sw["context"] for sw in data["sweep"]] == s["sweep_contexts"]
    swept = len(s["sweep_contexts"])
    return len(s["mechanisms"]) * (swept * len(s["lrs"]) + len(s["contexts"]) * s["seeds"] - swept)


def check_recall(data):
    s = data["settings"]
    points = data["summary"]["points"]["linear:elu"]
    assert [[p["width"], p["heads"]] for p in points] == s["shapes"]
    assert all(p["state_floats"] > 0 and p["accuracy"]["n"] == s["seeds"] for p in points)
    # a rate swept per shape, and each shape's runs trained at its own shape's choice
    assert [[sw["width"], sw["heads"]] for sw in data["sweep"]] == s["shapes"]
    for sw in data["sweep"]:
        for r in data["runs"]:
            if [r["width"], r["heads"]] == [sw["width"], sw["heads"]]:
                assert r["lr"] == sw["chosen"][r["attention"]]
    return len(s["mechanisms"]) * len(s["shapes"]) * (len(s["lrs"]) + s["seeds"] - 1)


def check_regression(data):
    s = data["settings"]
    assert len(data["runs"][0]["error_by_examples"]) == s["eval_points"]
    assert data["summary"]["baselines"]["least_squares"]["mean"][-1] < 1e-8
    assert len(data["summary"]["error_by_examples"]["softmax"]["mean"]) == s["eval_points"]
    return len(s["mechanisms"]) * (len(s["lrs"]) + s["seeds"] - 1)


def check_distill(data):
    s = data["settings"]
    assert len(data["teachers"]) == s["seeds"]
    assert all((data["runs_dir"] / f"{t['key']}.safetensors").is_file() for t in data["teachers"])
    hedgehog = [r for r in data["runs"] if r["map"] == "hedgehog"]
    assert len(hedgehog[0]["distill_loss"]) == s["n_layer"] and len(hedgehog[0]["attention_kl"]) == s["n_layer"]
    row = data["summary"]["maps"]["elu"]
    assert row["val_loss_no_finetune"]["mean"] is not None
    # a share of the teacher's gain over the unigram exists only where it gained (a --quick teacher may not)
    gained = sum(t["final_val_loss"] < data["summary"]["unigram_val_loss"] for t in data["teachers"])
    assert row["recovered_finetuned"]["n"] == gained
    teachers = len(s["teacher_lrs"]) + s["seeds"] - 1
    return teachers + len(s["maps"]) * (len(s["lrs"]) + s["seeds"] - 1)


STUDIES = {
    "context": (("final", "position", "curves", "wallclock", "spikes", "lr_sweep"), check_context),
    "recall": (("state", "curves", "lr_sweep"), check_recall),
    "regression": (("examples", "extrapolation", "curves", "lr_sweep"), check_regression),
    "distill": (("recovered", "kl", "finetune", "lr_sweep", "teacher_lr_sweep"), check_distill),
}


@pytest.mark.parametrize("name", STUDIES)
def test_quick_study_writes_its_record_and_resumes(name, tmp_path, capsys):
    pngs, check = STUDIES[name]
    assert run_cli(name, tmp_path) == 0
    first = capsys.readouterr().out
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["study"] == name and "cpu" in data["machine"] and data["settings"]["quick"] is True
    mechanisms = data["settings"].get("mechanisms") or data["settings"]["maps"]
    for sweep in data["sweep"] if isinstance(data["sweep"], list) else [data["sweep"]]:
        assert set(sweep["chosen"]) == set(mechanisms)
        assert all(len(rows) == len(data["settings"]["lrs"]) for rows in sweep["table"].values())
    for png in pngs:
        assert (tmp_path / f"{name}_{png}.png").read_bytes()[:4] == b"\x89PNG", png
    n_runs = check({**data, "runs_dir": tmp_path / "runs"})
    assert trained(first) == n_runs == len(list((tmp_path / "runs").glob("*.json")))
    assert f"({n_runs} runs trained now)" in first and "machinery check" in first
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()}
    # started again: every run is found in the store, nothing is trained, the record is the same
    assert run_cli(name, tmp_path) == 0
    assert f"(all {n_runs} runs from" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").iterdir()} == mtimes
    assert json.loads((tmp_path / f"{name}.json").read_text())["runs"] == data["runs"]


def test_parallel_jobs_give_the_same_results(tmp_path, capsys):
    args = ["--mechanisms", "softmax", "--seeds", "1", "--set", "contexts=[32]", "--set", "sweep_contexts=[32]",
            "--set", "steps=4"]
    assert run_cli("context", tmp_path / "a", *args) == 0
    assert run_cli("context", tmp_path / "b", "--jobs", "2", *args) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / d / "context.json").read_text()) for d in "ab")
    # the same runs; only float rounding differs (the workers have their own torch thread count)
    for ra, rb in zip(a["runs"], b["runs"]):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4)
    assert a["sweep"][0]["chosen"] == b["sweep"][0]["chosen"]


def test_estimate_costs_only_the_runs_not_yet_trained(tmp_path, capsys):
    args = ["--mechanisms", "softmax", "--seeds", "2", "--set", "contexts=[16,32]", "--set", "sweep_contexts=[16,32]",
            "--set", "steps=2"]

    def estimate(*extra):
        capsys.readouterr()
        assert run_cli("context", tmp_path, "--estimate", *args, *extra) == 0
        return capsys.readouterr().out

    out = estimate()
    assert "0 of 8 runs already in" in out  # 3 rates at each of 2 contexts, then seed 1 at both
    assert "T=16     " in out and "4 runs x" in out and not (tmp_path / "runs").exists()  # nothing trained
    assert run_cli("context", tmp_path, *args) == 0
    out = estimate()
    assert "8 of 8 runs already in" in out and "s/update" not in out and "0.00 h" in out
    out = estimate("--seeds", "3")  # one more seed: one run at each context
    assert "8 of 10 runs already in" in out and out.count(" 1 run x") == 2


def test_estimate_is_for_the_context_study(tmp_path, capsys):
    assert run_cli("recall", tmp_path, "--estimate") == 2
    assert "--estimate is available for the context study only, not recall" in capsys.readouterr().err


def test_a_stopped_study_redoes_only_the_missing_runs(tmp_path, capsys):
    args = ["--mechanisms", "softmax", "--set", "contexts=[32]", "--set", "sweep_contexts=[32]",
            "--set", "steps=2"]
    assert run_cli("context", tmp_path, *args) == 0
    done = sorted((tmp_path / "runs").glob("*.json"))
    for p in done[:2]:  # as if the study had been killed before these two finished
        p.unlink()
    capsys.readouterr()
    assert run_cli("context", tmp_path, *args) == 0
    assert trained(capsys.readouterr().out) == 2
    assert sorted((tmp_path / "runs").glob("*.json")) == done


def test_plot_only_redraws(tmp_path, capsys):
    assert run_cli("context", tmp_path, "--mechanisms", "softmax", "--seeds", "1", "--set", "contexts=[32]",
                   "--set", "sweep_contexts=[32]",
                   "--set", "steps=2") == 0
    (tmp_path / "context_final.png").unlink()
    assert main(["experiment", "context", "--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "context_final.png").is_file()


def test_quick_does_not_default_to_the_record_folder():
    assert "docs" not in str(default_out("context", True))
    assert str(default_out("recall", False)) == "docs/results/experiments/recall"
    assert str(default_out("recall", False, "hard")) == "docs/results/experiments/recall-hard"
    assert str(default_out("recall", True, "hard")) == "runs/experiments/recall-hard-quick"


@pytest.mark.parametrize("name, args, match", [
    ("context", ["--mechanisms", "bogus"], "attention must be one of"),
    ("context", ["--set", "contexts=[32,48]"], "multiples of every context"),
    ("context", ["--set", "nope=1"], "unknown setting"),
    ("context", ["--set", "steps=x"], "steps"),
    ("context", ["--set", "sweep_contexts=[32]"], "sweep_contexts"),
    ("context", ["--jobs", "0"], "--jobs"),
    ("context", ["--lrs", "2"], "lrs"),
    ("context", ["--set", "contexts=64"], "contexts"),
    ("recall", ["--set", "shapes=[[30,4]]"], "divisible"),
    ("recall", ["--set", "sweep_shape=[8,2]"], "unknown setting"),
    ("recall", ["--set", "vocab_size=4"], "vocab_size"),
    ("recall", ["--mechanisms", "sliding-window:bogus=1"], "bogus"),
    ("recall", ["--setting", "bogus"], "--setting for recall must be one of ['hard'], got 'bogus'"),
    ("context", ["--setting", "hard"], "--setting for context must be one of ['gpu'], got 'hard'"),
    ("context", ["--mechanisms", "linear:elu@rope"], "pos_embedding='rope'"),
    ("context", ["--mechanisms", "softmax@bogus"], "after '@' must be one of"),
    ("regression", ["--set", "eval_points=3"], "eval_points"),
    ("regression", ["--set", "eval_points=5"], "points < eval_points"),  # nothing left to extrapolate to
    ("regression", ["--set", "curriculum=1.5"], "curriculum"),
    ("regression", ["--seeds", "0"], "seeds"),
    ("context", ["--plot-only"], "--plot-only"),
    ("context", ["--plot-only", "--steps", "9"], "--plot-only redraws the record as it is; it takes no settings"),
    ("recall", ["--quick", "--plot-only", "--estimate"], "it takes no settings, got ['--estimate']"),
    ("regression", ["--setting", "hard"], "--setting: regression has no named settings (only context, recall"),
    ("distill", ["--set", "maps=[\"elu\",\"cosine\"]"], "maps"),
    ("distill", ["--set", "context=48"], "multiples of context"),
    ("distill", ["--distill-lr", "0"], "distill_lr must be a number in (0, 1)"),
    ("distill", ["--teacher-lrs", "0"], "teacher_lrs must be a non-empty list"),
    ("distill", ["--source", "/nonexistent/file.txt"], "source: "),
    ("distill", ["--source", "nosuch:thing"], "source: "),
    # more windows than there are: recorded but not used (the runs took what there was)
    ("distill", ["--set", "distill_batch=1000"], "distill_batch (1000) exceeds the"),
    ("distill", ["--set", "kl_windows=10000"], "kl_windows (10000) exceeds the"),
    # more than the source holds: an IndexError, or numpy's "high <= 0", deep in a run
    ("distill", ["--set", "val_tokens=2000000", "--set", "kl_windows=1"], "val_tokens (2000000) exceeds the held-out split"),
])
def test_bad_input_exits_2_with_one_line(name, args, match, tmp_path, capsys):
    assert run_cli(name, tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("lintrans experiment: ") and match in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_device_reaches_the_runs_and_the_record(tmp_path, capsys):
    assert run_cli("regression", tmp_path, "--device", "cpu", "--mechanisms", "softmax", "--seeds", "1",
                   "--lrs", "1e-3", "--steps", "2", "--eval-every", "1") == 0
    data = json.loads((tmp_path / "regression.json").read_text())
    assert data["settings"]["device"] == "cpu" and data["settings"]["steps"] == 2
    assert [r["device"] for r in data["runs"]] == ["cpu"]


def test_device_cuda_without_cuda_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        assert run_cli("context", tmp_path, "--device", device) == 2
        err = capsys.readouterr().err
        assert err == f"lintrans experiment: --device is {device!r} but no CUDA device is available\n"
    assert run_cli("context", tmp_path, "--device", "tpu") == 2
    assert "--device must be auto, cpu, cuda, cuda:N or mps" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_settings_flags_set_and_quick_are_typed_and_printed(tmp_path, capsys):
    assert run_cli("recall", tmp_path, "--set", "steps=7", "--pairs", "3", "--shapes", "[[8,2]]",
                   "--print-settings") == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "pairs: 3" in out and "- - 8" in out and "quick: true" in out
    assert "vocab_size: 64" in out  # the --quick value where nothing overrides it
    assert run_cli("recall", tmp_path, "--steps", "2.5") == 2
    assert capsys.readouterr().err == "lintrans experiment: --steps must be an int >= 1, got '2.5'\n"
    assert not (tmp_path / "runs").exists()


def test_recall_hard_setting_is_a_preset_under_set_and_flags(tmp_path, capsys):
    assert main(["experiment", "recall", "--setting", "hard", "--print-settings"]) == 0
    out = capsys.readouterr().out
    assert "pairs: 64" in out and "setting: hard" in out and "vocab_size: 8192" in out
    assert "train_pairs:\n- 4\n- 8\n- 16\n- 32\n- 64\n" in out and "steps: 4000" in out
    assert main(["experiment", "recall", "--setting", "hard", "--steps", "2000", "--print-settings"]) == 0
    assert "steps: 2000" in capsys.readouterr().out  # a flag wins over the preset
    # a smaller --pairs must come with a mixture it covers
    assert main(["experiment", "recall", "--setting", "hard", "--pairs", "32", "--print-settings"]) == 2
    assert "train_pairs ([4, 8, 16, 32, 64]) must not exceed pairs (32)" in capsys.readouterr().err
    assert main(["experiment", "recall", "--setting", "hard", "--pairs", "32", "--train-pairs", "8", "32",
                 "--print-settings"]) == 0
    assert "pairs: 32" in capsys.readouterr().out
    # --quick combines with the preset: QUICK's 4 pairs with a mixture they cover, not the preset's 4-64
    assert main(["experiment", "recall", "--setting", "hard", "--quick", "--print-settings"]) == 0
    out = capsys.readouterr().out
    assert "pairs: 4\ntrain_pairs:\n- 2\n- 4\n" in out and "steps: 20" in out and "setting: hard" in out


def test_recall_trains_on_the_train_pairs_mixture_and_scores_at_pairs(tmp_path, monkeypatch):
    """--train-pairs: the training steps cycle through those pair counts (T = 4P each), while the
    held-out set, and so the accuracy, stays at --pairs; the run's key holds the mixture only when set."""
    from lintrans.experiments import recall

    drawn = []
    real = recall.recall_batch

    def spy(batch, n_pairs, *args, **kw):
        drawn.append((batch, n_pairs))
        return real(batch, n_pairs, *args, **kw)

    monkeypatch.setattr(recall, "recall_batch", spy)
    assert run_cli("recall", tmp_path, "--mechanisms", "softmax", "--shapes", "[[16,2]]", "--seeds", "1",
                   "--lrs", "1e-3", "--pairs", "4", "--train-pairs", "2", "4", "--steps", "5") == 0
    assert drawn == [(64, 4)] + [(16, 2), (16, 4)] * 2 + [(16, 2)]  # held-out set first, then the steps
    settings = json.loads((tmp_path / "recall.json").read_text())["settings"]
    assert settings["train_pairs"] == [2, 4] and settings["pairs"] == 4
    assert recall.run_spec(settings, "softmax", [16, 2], 1e-3, 0)["train_pairs"] == [2, 4]
    plain = recall.run_spec({**recall.DEFAULT}, "softmax", [64, 4], 1e-3, 0)
    assert "train_pairs" not in plain  # records made before the setting keep their runs' keys


def test_recall_answers_hidden_by_default_and_the_no_recall_level():
    """The default hides the answers (Zoology's task: the model has one more id, the filler); "shown"
    keeps the keys of the runs recorded before the setting; the no-recall level is 1/P hidden and
    H_P/P shown (a model that rules out the values already asked for)."""
    from lintrans.experiments import recall

    hidden = recall.run_spec({**recall.DEFAULT}, "softmax", [64, 4], 1e-3, 0)
    shown = recall.run_spec({**recall.DEFAULT, "answers": "shown"}, "softmax", [64, 4], 1e-3, 0)
    assert hidden["answers"] == "hidden" and "answers" not in shown
    assert recall.model_vocab(hidden) == 8193 and recall.model_vocab(shown) == 8192
    assert recall.no_recall_accuracy({"pairs": 16, "answers": "hidden"}) == 1 / 16
    assert abs(recall.no_recall_accuracy({"pairs": 16}) - 0.211295) < 1e-6  # a record made before the setting
    idx, targets = recall._batch(hidden, 4, torch.Generator().manual_seed(0))
    assert torch.all(idx[:, 33::2] == 8192) and torch.all(targets[:, 32::2] >= 4096)


@pytest.mark.parametrize("extra, match", [
    (["--pairs", "4", "--train-pairs", "2", "8"], r"train_pairs \(\[2, 8\]\) must not exceed pairs \(4\)"),
    (["--pairs", "4", "--train-pairs", "4", "2"], "train_pairs must be distinct and increasing"),
    (["--pairs", "4", "--train-pairs", "0"], "must be an int >= 1"),
])
def test_recall_rejects_bad_train_pairs(tmp_path, capsys, extra, match):
    import re

    assert run_cli("recall", tmp_path, *extra) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_recall_runs_the_delta_rule_and_records_its_state(tmp_path, capsys):
    assert run_cli("recall", tmp_path, "--mechanisms", "deltanet", "gated-deltanet", "--seeds", "1",
                   "--lrs", "1e-3") == 0
    data = json.loads((tmp_path / "recall.json").read_text())
    for m in ("deltanet", "gated-deltanet"):
        for p in data["summary"]["points"][m]:  # widths 16 and 32, 2 heads: S per head and the conv tail
            h = p["width"] // p["heads"]
            assert p["state_floats"] == p["heads"] * h * h + 3 * 3 * p["width"]
            assert p["accuracy"]["n"] == 1
    runs = [json.loads(f.read_text()) for f in (tmp_path / "runs").glob("*.json")]
    for r in runs:  # the gated layer records its half-lives per layer and head, before and after training
        gated = r["spec"]["attention"] == "gated-deltanet"
        for key in ("decay_half_lives_start", "decay_half_lives_end"):
            assert (key in r["result"]) == gated
            if gated:
                lives = r["result"][key]
                assert len(lives) == r["spec"]["n_layer"] and {len(x) for x in lives} == {r["spec"]["heads"]}
                assert all(x > 0 for layer in lives for x in layer)


def test_decay_half_lives_are_ln2_over_the_mean_decay_rate(monkeypatch):
    """The recorded half-life per layer and head is ln 2 over the mean of -log a_t that the layer's op
    actually receives on these inputs; a model without a gated delta layer records none."""
    import math

    from lintrans.experiments import recall
    from lintrans.experiments.models import gpt_config
    from lintrans.nn import delta

    def model(attention):
        torch.manual_seed(0)
        return recall.ShiftGPT(gpt_config(attention, n_layer=2, n_head=3, n_embd=12, block_size=8, vocab_size=16))

    m = model("gated-deltanet")
    idx = torch.randint(0, 16, (4, 8))
    received, op = [], delta.delta_rule

    def spy(*args, log_decay=None, **kw):
        received.append(log_decay)
        return op(*args, log_decay=log_decay, **kw)

    monkeypatch.setattr(delta, "delta_rule", spy)
    got = recall.decay_half_lives(m, idx)
    assert len(received) == 2  # one forward, two layers
    want = [[math.log(2) / r for r in (-ld).mean((0, 1)).tolist()] for ld in received]
    assert len(got) == 2 and all(g == pytest.approx(w, rel=1e-3) for g, w in zip(got, want))
    assert m.training  # left as it was
    assert recall.decay_half_lives(model("deltanet"), idx) is None


def test_distill_baseline_is_scored_on_the_models_held_out_tokens():
    """The unigram loss averages over the targets of the held-out windows the models' val_loss sees,
    not over the whole held-out split."""
    import numpy as np

    from lintrans.experiments import context, distill

    got = distill.unigram_loss("builtin:python-docs", 16, 64, 256)
    data = context.token_data("builtin:python-docs")
    logp = np.log((np.bincount(np.asarray(data.train), minlength=data.vocab_size) + 1.0) /
                  (len(data.train) + data.vocab_size))
    stream = context.TextStream("builtin:python-docs", 16, 64, 1, 0, 256)
    assert sum(y.numel() for _, y in stream.val) == 256
    targets = np.asarray(data.val)[1:257]  # the windows' targets: the 256 bytes after the first
    assert got == pytest.approx(float(-logp[targets].mean()), rel=1e-12)
    assert got != pytest.approx(float(-logp[np.asarray(data.val)].mean()), rel=1e-3)


@pytest.mark.parametrize("name", ["context", "recall", "regression", "distill"])
def test_every_setting_of_a_study_has_help_text(name, capsys, monkeypatch):
    import importlib

    mod = importlib.import_module(f"lintrans.experiments.{name}")
    assert set(mod.HELP) == set(mod.DEFAULT), "HELP names exactly the study's settings"
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit):
        main(["experiment", name, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for key, text in mod.HELP.items():
        assert f"--{key.replace('_', '-')} " in out and " ".join(text.split()) in out, key


def test_runs_get_the_processes_threads_with_one_job_and_a_share_of_the_cores_with_more(monkeypatch):
    import torch

    from lintrans.experiments import study

    monkeypatch.setattr(study, "cpu_cores", lambda: 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # as OMP_NUM_THREADS=3 would
        assert study.run_threads(1) == 3  # in this process: what it already has
        assert study.run_threads(2) == 4 and study.run_threads(16) == 1
    finally:
        torch.set_num_threads(before)


def test_help_texts_take_a_studys_own_then_the_shared_and_refuse_gaps():
    from lintrans.experiments import study

    assert study.help_texts({"seeds": 3, "pairs": 4}, {"pairs": "pairs"}) == {
        "seeds": study.COMMON_HELP["seeds"], "pairs": "pairs"}
    assert study.help_texts({"seeds": 3}, {"seeds": "mine"}) == {"seeds": "mine"}
    with pytest.raises(KeyError, match=r"settings without help text: \['pairs'\]"):
        study.help_texts({"pairs": 4}, {})
    with pytest.raises(KeyError, match=r"help text for no setting: \['gone'\]"):
        study.help_texts({"seeds": 3}, {"gone": "x"})


def test_estimate_drains_the_device_queue_around_every_timed_call(tmp_path, capsys, monkeypatch):
    """On an accelerator only a synchronised timing measures the work, not its launches: every timed
    step and evaluation is bracketed by a ``synchronize`` of the study's device (a no-op on the CPU)."""
    from lintrans.bench import machine

    calls = []
    monkeypatch.setattr(machine, "synchronize", lambda device: calls.append(str(device)))
    assert run_cli("context", tmp_path, "--estimate", "--mechanisms", "softmax", "--set", "contexts=[16]",
                   "--set", "sweep_contexts=[16]") == 0
    # per mechanism and context: 3 timed steps (a warm-up and 2) and one evaluation, each synchronised twice
    assert calls == ["cpu"] * 8


def test_max_runs_stops_a_study_in_pieces_that_add_up_to_the_whole(tmp_path, capsys):
    from lintrans.experiments.cli import INCOMPLETE

    args = ["--mechanisms", "softmax", "linear:elu", "--seeds", "2", "--set", "contexts=[32]",
            "--set", "sweep_contexts=[32]", "--lrs", "1e-3", "2e-3", "--set", "steps=3"]
    store = tmp_path / "runs"
    # 4 sweep runs, then each mechanism's seed 1 at its chosen rate: 6 in all, done 4 + 1 + 1
    assert run_cli("context", tmp_path, "--max-runs", "4", "--jobs", "2", *args) == INCOMPLETE  # counted in workers too
    assert "stopped after 4 runs" in capsys.readouterr().err and not (tmp_path / "context.json").exists()
    assert len(list(store.glob("*.json"))) == 4
    assert run_cli("context", tmp_path, "--max-runs", "1", *args) == INCOMPLETE
    assert "stopped after 1 run (" in capsys.readouterr().err and len(list(store.glob("*.json"))) == 5
    assert run_cli("context", tmp_path, "--max-runs", "1", *args) == 0  # the last one: the study ends
    assert "(1 trained now, 5 from" in capsys.readouterr().out
    pieces = json.loads((tmp_path / "context.json").read_text())
    assert run_cli("context", tmp_path / "whole", *args) == 0  # in one go: the same runs and results
    whole = json.loads((tmp_path / "whole" / "context.json").read_text())
    # the same runs; the sweep's losses differ by float rounding only (its workers had their own thread count)
    assert [r["key"] for r in pieces["runs"]] == [r["key"] for r in whole["runs"]]
    for a, b in zip(pieces["runs"], whole["runs"]):
        assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], rel=1e-4)
    assert main(["experiment", "context", "--quick", "--max-runs", "0", "--out", str(tmp_path)]) == 2
    assert "--max-runs" in capsys.readouterr().err


def test_sigterm_stops_a_study_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """SIGTERM to the study's process (a scheduler, `kill`) is an interrupt: its workers are stopped,
    finished runs kept, exit status 128 + 15, and the previous handler is back afterwards."""
    import os
    import signal
    import time

    import lintrans.experiments.regression as regression

    def run_study(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(regression, "run_study", run_study)
    before = signal.getsignal(signal.SIGTERM)
    assert run_cli("regression", tmp_path) == 128 + signal.SIGTERM
    assert "interrupted; finished runs are kept" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_worker_exits_when_its_study_process_dies():
    """Its watchdog sees another parent (the study was SIGKILLed) and exits, instead of training the
    runs queued to it unseen, which a rerun of the command would train again."""
    import subprocess
    import sys

    code = "from lintrans.experiments.study import _exit_with_parent; _exit_with_parent(-1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 1


def test_an_out_that_is_a_file_stops_before_any_work(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert run_cli("regression", out) == 2
        err = capsys.readouterr().err
        assert err.startswith("lintrans experiment: --out ") and "is a file, not a folder" in err, err


def test_distill_runs_on_a_file_are_keyed_by_its_content(tmp_path):
    """Teachers trained on a file are not reused once the file says something else; the embedded
    corpus's runs keep the keys they were recorded under."""
    from lintrans.experiments import distill
    from lintrans.experiments.study import run_key

    s = {**distill.DEFAULT, "source": str(tmp_path / "a.txt")}
    (tmp_path / "a.txt").write_text("one text " * 50)
    before = run_key(distill.teacher_spec(s, 1e-3, 0))
    assert run_key(distill.teacher_spec(s, 1e-3, 0)) == before
    (tmp_path / "a.txt").write_text("another text " * 50)
    assert run_key(distill.teacher_spec(s, 1e-3, 0)) != before
    assert "source_sha256" not in distill.teacher_spec(distill.DEFAULT, 1e-3, 0)


def test_a_damaged_run_file_is_named(tmp_path):
    from lintrans.experiments.study import RunStore

    store = RunStore(tmp_path)
    store.put({"a": 1}, {"x": 1.0})
    assert store.get({"a": 1}) == {"x": 1.0}
    store.path({"a": 1}).write_text("{}")
    with pytest.raises(ValueError, match=r"run file .*\.json is damaged .*delete it"):
        store.get({"a": 1})


def test_a_plot_that_fails_midway_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    from lintrans.experiments import study

    plt = study.pyplot()
    fig = plt.figure()
    study.save(fig, tmp_path / "p.png")
    old = (tmp_path / "p.png").read_bytes()

    def broken(path, **kw):
        open(path, "wb").write(b"\x89PNG half")
        raise KeyboardInterrupt

    fig = plt.figure()
    monkeypatch.setattr(fig, "savefig", broken)
    with pytest.raises(KeyboardInterrupt):
        study.save(fig, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["p.png"]
