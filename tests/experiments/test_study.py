import json
import math

import pytest
import torch

from lintrans.experiments import study


def test_run_key_is_stable_and_order_free():
    a = {"lr": 1e-3, "seed": 0, "attention": "softmax"}
    b = {"attention": "softmax", "seed": 0, "lr": 1e-3}
    assert study.run_key(a) == study.run_key(b)
    assert study.run_key(a) != study.run_key({**a, "seed": 1})


def test_store_round_trip_without_nan(tmp_path):
    store = study.RunStore(tmp_path)
    spec = {"x": 1}
    assert store.get(spec) is None
    store.put(spec, {"loss": float("nan"), "curve": [1.0, float("inf")]})
    assert store.get(spec) == {"loss": None, "curve": [1.0, None]}
    text = store.path(spec).read_text()
    assert json.loads(text)["spec"] == spec and "NaN" not in text
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [store.path(spec).name]  # no temp files left


class FakeRunner:
    def __init__(self, scores):
        self.scores = scores

    def run(self, specs):
        return [{"score": self.scores[(s["mech"], s["lr"])]} for s in specs]


def test_lr_sweep_picks_the_lowest_held_out_score_and_skips_diverged():
    scores = {("a", 1): 3.0, ("a", 2): 2.0, ("a", 3): None, ("b", 1): 1.0, ("b", 2): float("nan"), ("b", 3): 5.0}
    specs = {m: [{"mech": m, "lr": lr} for lr in (1, 2, 3)] for m in "ab"}
    sweep = study.lr_sweep(FakeRunner(scores), specs, lambda r: r["score"])
    assert sweep["chosen"] == {"a": 2, "b": 1}
    assert sweep["table"]["b"][1] == {"lr": 2, "score": None}
    with pytest.raises(RuntimeError, match="diverged"):
        study.lr_sweep(FakeRunner({("a", 1): None}), {"a": [{"mech": "a", "lr": 1}]}, lambda r: r["score"])


def test_lr_sweep_can_pick_the_highest_score_with_a_tiebreak():
    """Recall picks by held-out accuracy (what it reports), equal accuracies by the lower loss."""
    acc = {("a", 1): 0.2, ("a", 2): 0.5, ("a", 3): 0.5, ("b", 1): 0.0, ("b", 2): 0.0, ("b", 3): None}
    loss = {("a", 1): 1.0, ("a", 2): 3.0, ("a", 3): 2.0, ("b", 1): 5.0, ("b", 2): 4.0, ("b", 3): 1.0}

    class Runner:
        def run(self, specs):
            return [{"acc": acc[(s["mech"], s["lr"])], "loss": loss[(s["mech"], s["lr"])]} for s in specs]

    specs = {m: [{"mech": m, "lr": lr} for lr in (1, 2, 3)] for m in "ab"}
    sweep = study.lr_sweep(Runner(), specs, lambda r: r["acc"], maximize=True, tiebreak=lambda r: r["loss"])
    assert sweep["chosen"] == {"a": 3, "b": 2} and sweep["maximize"] is True
    assert sweep["table"]["a"][2] == {"lr": 3, "score": 0.5, "tiebreak": 2.0}
    # by the loss alone, as before: the lowest
    assert study.lr_sweep(Runner(), specs, lambda r: r["loss"])["chosen"] == {"a": 1, "b": 3}


def test_spread():
    assert study.spread([1.0, 3.0, None]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2, "n_failed": 1}
    assert study.spread([None])["mean"] is None
    # a curve that ended early (a diverged seed) or is None does not cut the others short
    assert study.spread_curves([[1, 2, 3], [3, 4], None]) == {"mean": [2, 3, 3], "min": [1, 2, 3], "max": [3, 4, 3]}
    assert study.spread_curves([None]) == {"mean": [], "min": [], "max": []}


def test_loss_spikes():
    losses = [2.0] * 25 + [2.7] + [2.0] * 5
    assert [s["step"] for s in study.loss_spikes(losses)] == [25]
    assert study.loss_spikes([2.0] * 30) == []


def test_lr_factor_warms_up_then_decays_to_the_floor():
    f = [study.lr_factor(s, 100) for s in range(100)]
    assert f[0] == pytest.approx(0.2) and max(f) == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(f[5:], f[6:]))


def test_train_stops_on_a_non_finite_loss():
    model = torch.nn.Linear(2, 1)
    out = study.train(model, lr=1e-2, steps=5, loss_at=lambda s: model.weight.sum() * (math.nan if s == 2 else 1.0),
                      evaluate=lambda: {"v": 1.0}, eval_every=1)
    assert out["diverged"] and len(out["train_loss"]) == 2 and len(out["evals"]) == 3


@pytest.mark.parametrize("changes, err, match", [
    ({"nope": 1}, ValueError, "unknown setting 'nope'"),
    ({"steps": "many"}, TypeError, "steps"),
    ({"steps": 2.5}, TypeError, "steps"),
])
def test_resolve_settings_rejects(changes, err, match):
    with pytest.raises(err, match=match):
        study.resolve_settings({"steps": 10, "lr": 1e-3}, changes)


def test_resolve_settings_accepts_ints_for_floats():
    assert study.resolve_settings({"steps": 10, "lr": 1e-3}, {"lr": 1}) == {"steps": 10, "lr": 1.0}
