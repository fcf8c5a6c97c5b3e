import json
import math

import pytest
import torch

from lintrans.cli import main
from lintrans.experiments.models import VectorGPT, parse_attention
from lintrans.experiments.runner import ExperimentConfig, run_experiment
from lintrans.models.config import GPTConfig

TINY = dict(n_layer=1, n_head=2, n_embd=16, batch_size=16, eval_batch=32)


def test_parse_attention():
    assert parse_attention("softmax") == ("softmax", {})
    assert parse_attention("linear:based") == ("linear", {"feature_map": "based"})
    assert parse_attention("linear:feature_map=elu,normalize=false,eps=1e-5,chunk_size=8") == (
        "linear", {"feature_map": "elu", "normalize": False, "eps": 1e-5, "chunk_size": 8})


@pytest.mark.parametrize("spec, match", [
    ("nope", "attention must be one of"),
    ("softmax:elu", "only for 'linear'"),
    ("linear:nope", "feature map must be one of"),
    ("linear:a=1,b", "key=value"),
    ("", "non-empty"),
])
def test_parse_attention_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_attention(spec)


def test_vector_gpt_is_causal_and_shaped():
    torch.manual_seed(0)
    model = VectorGPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=9, vocab_size=1), in_dim=3)
    assert "wte" not in model.transformer
    x = torch.randn(2, 9, 3)
    y = model(x)
    assert y.shape == (2, 9, 1)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, 4, 3)
    torch.testing.assert_close(model(x2)[:, :5], y[:, :5])  # the future does not leak back
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randn(1, 10, 3))
    with pytest.raises(ValueError, match=r"\[B, T, 3\]"):
        model(torch.randn(1, 4, 2))


@pytest.mark.parametrize("task, extra", [
    ("regression", dict(dim=2, points=5, lr=3e-3)),
    ("recall", dict(pairs=2, queries=2, keys=4, values=4, lr=1e-2)),
])
def test_a_few_dozen_steps_reduce_the_loss(task, extra):
    cfg = ExperimentConfig(task=task, attention=["softmax", "linear:elu"], steps=40, **{**TINY, **extra})
    result = run_experiment(cfg)
    for run in result["runs"]:
        losses = run["train_loss"]
        first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
        assert last < 0.9 * first, (run["attention"], first, last)
        if task == "recall":  # below guessing a value uniformly: the context is being used
            assert run["eval"]["loss"] < 0.9 * math.log(cfg.values), run["eval"]


def test_runs_are_deterministic_and_share_data():
    cfg = ExperimentConfig(task="regression", attention=["softmax"], steps=3, dim=2, points=3, **TINY)
    a, b = run_experiment(cfg), run_experiment(cfg)
    assert a["runs"][0]["train_loss"] == b["runs"][0]["train_loss"]
    assert a["runs"][0]["eval"] == b["runs"][0]["eval"]


@pytest.mark.parametrize("changes, match", [
    (dict(task="nope"), "task must be one of"),
    (dict(attention=[]), "non-empty"),
    (dict(attention=["softmax", "softmax"]), "distinct"),
    (dict(steps=0), "steps"),
    (dict(lr=2.0), "lr"),
    (dict(seed=-1), "seed"),
    (dict(task="recall", pairs=9, keys=8), "pairs"),
    (dict(task="recall", queries=9, pairs=8), "queries"),
])
def test_config_rejects(changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ExperimentConfig(**{"task": "regression", **changes})


@pytest.mark.parametrize("task, args", [
    ("regression", ["--dim", "2", "--points", "4"]),
    ("recall", ["--pairs", "3", "--queries", "2", "--keys", "6", "--values", "5"]),
])
def test_cli_end_to_end(tmp_path, capsys, task, args):
    argv = ["experiment", task, "--attention", "softmax", "linear:elu", "--steps", "3", "--batch-size", "4",
            "--eval-batch", "8", "--n-layer", "1", "--n-embd", "16", "--no-progress", "--out", str(tmp_path), *args]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "linear:elu" in out and ("least squares" in out or "chance" in out)
    data = json.loads((tmp_path / f"{task}.json").read_text())
    assert [r["attention"] for r in data["runs"]] == ["softmax", "linear:elu"]
    assert data["runs"][1]["gpt_config"]["attention_options"] == {"feature_map": "elu", "form": "attention"}
    assert len(data["runs"][0]["train_loss"]) == 3
    assert "cpu" in data["machine"] and data["config"]["steps"] == 3
    for name in (f"{task}_curves.png", f"{task}_eval.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    if task == "regression":
        assert len(data["runs"][0]["eval"]["error_by_examples"]) == 4
        assert data["baselines"]["least_squares"][-1] < 1e-8


@pytest.mark.parametrize("args, match", [
    (["regression", "--attention", "bogus"], "attention must be one of"),
    (["regression", "--steps", "0"], "steps"),
    (["recall", "--pairs", "40", "--keys", "8"], "pairs"),
    (["regression", "--device", "tpu"], "--device"),
])
def test_cli_bad_arguments(capsys, args, match):
    assert main(["experiment", *args, "--no-progress"]) == 2
    assert match in capsys.readouterr().err


def test_an_explicit_linear_form_is_kept():
    cfg = ExperimentConfig(task="regression", attention=["linear:feature_map=elu,form=chunked,chunk_size=2"],
                           steps=1, dim=2, points=3, **TINY)
    opts = run_experiment(cfg)["runs"][0]["gpt_config"]["attention_options"]
    assert opts == {"feature_map": "elu", "form": "chunked", "chunk_size": 2}
