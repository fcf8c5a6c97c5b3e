"""Study ``regression``: in-context linear regression (Garg et al. 2022, as the ReBased/Hedgehog literature uses it).

Each sequence draws w ~ N(0, I_n) and points x_i ~ N(0, I_n), y_i = w . x_i; the model reads
x_1, y_1, ..., x_P as vectors (``tasks.regression_tokens``) and predicts y_i at every x_i from the
examples before it. Error is squared error / n (predicting 0 scores about 1). Training follows a
curriculum as in Garg et al.: the first ``curriculum`` of the steps grow the active dimensions from
``start_dim`` to ``dim`` (the others are zero) and the points from ``start_points`` to ``points``;
then every batch is full size. Held-out sequences are full size with ``eval_points`` points, more
than trained on: the error at k >= ``points`` examples is extrapolation. No mechanism has position
embeddings (``pos_embedding="none"``), so every one runs at any length; the causal mask still tells
softmax the order, and one extra input (1 on y tokens, 0 on x tokens) tells the two kinds apart. Baselines on the same held-out data: least squares, averaging
(w_hat = mean y_i x_i) and 3-nearest-neighbours.

The default: 4 mechanisms x (3 rates + 3 seeds - 1) = 20 runs of 3000 steps of 64 sequences (2
layers, width 64), sized to finish within an hour with ``--jobs 2`` on a 2-core CPU
(docs/experiments.md). The y-token input is needed: without it softmax did not learn in a probe.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from . import study
from .models import VectorGPT, check_specs, gpt_config
from .tasks import (averaging_errors, least_squares_errors, nearest_neighbour_errors, regression_batch,
                    regression_tokens)

NAME = "regression"
VERSION = 1

DEFAULT = {
    "mechanisms": ["softmax", "linear:elu", "linear:based", "linear:rebased"],
    "lrs": [3e-4, 1e-3, 3e-3],
    "seeds": 3,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "dim": 5,
    "points": 11,
    "eval_points": 21,
    "start_dim": 2,
    "start_points": 5,
    "curriculum": 0.5,
    "steps": 3000,
    "batch_size": 64,
    "eval_every": 300,
    "eval_batch": 2048,
}
QUICK = {
    "mechanisms": ["softmax", "linear:elu"],
    "seeds": 2,
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 16,
    "dim": 3,
    "points": 5,
    "eval_points": 8,
    "start_dim": 1,
    "start_points": 3,
    "steps": 20,
    "batch_size": 16,
    "eval_every": 10,
    "eval_batch": 64,
}


HELP = study.help_texts(DEFAULT, {
    "mechanisms": "attention specs compared, each NAME[:KEY=VALUE,...]",
    "lrs": "peak learning rates swept per mechanism",
    "dim": "dimension n of w and x",
    "points": "(x, y) examples per training sequence",
    "eval_points": "examples per held-out sequence (more than points: extrapolation)",
    "start_dim": "active dimensions at the start of the curriculum",
    "start_points": "examples per sequence at the start of the curriculum",
    "curriculum": "fraction of the steps over which dimensions and examples grow to dim and points",
})
LIMITS = {
    **dict.fromkeys(("seeds", "n_layer", "n_head", "n_embd", "dim", "points", "eval_points", "start_dim",
                     "start_points", "steps", "batch_size", "eval_every", "eval_batch"), study.POSITIVE),
    "curriculum": {"low": 0, "high": 1, "high_open": True},  # a fraction of the steps
}


def validate(s: dict) -> None:
    study.check_settings(s, DEFAULT, LIMITS)
    study.check_lrs(s["lrs"])
    if not s["start_dim"] <= s["dim"] or not s["start_points"] <= s["points"] < s["eval_points"]:
        raise ValueError(f"need start_dim <= dim and start_points <= points < eval_points (the extrapolation is "
                         f"measured past the trained points), got start_dim {s['start_dim']}, dim {s['dim']}, "
                         f"start_points {s['start_points']}, points {s['points']}, eval_points {s['eval_points']}")
    check_specs(s["mechanisms"], linear_form="attention", **_fields(s))


def _fields(s: dict) -> dict:
    return dict(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"], block_size=2 * s["eval_points"] - 1,
                vocab_size=1, pos_embedding="none")


def run_spec(s: dict, mechanism: str, lr: float, seed: int) -> dict:
    keys = [k for k in DEFAULT if k not in ("mechanisms", "lrs", "seeds")]
    return {"study": NAME, "version": VERSION, "attention": mechanism, "lr": lr, "seed": seed,
            **{k: s[k] for k in keys}}


def curriculum(spec: dict, step: int) -> tuple[int, int]:
    """(active dimensions, points) at ``step``: linear growth over the first ``curriculum`` of the run."""
    span = spec["curriculum"] * spec["steps"]
    frac = 1.0 if span == 0 else min(1.0, step / span)
    dims = spec["start_dim"] + round(frac * (spec["dim"] - spec["start_dim"]))
    return dims, spec["start_points"] + round(frac * (spec["points"] - spec["start_points"]))


def _batch(spec: dict, n: int, dims: int, points: int, generator: torch.Generator, device="cpu"):
    xs, ys, _ = regression_batch(n, points, dims, generator, device)
    pad = torch.zeros(n, points, spec["dim"] - dims, device=device)  # unused dimensions are zero
    return torch.cat([xs, pad], dim=-1), ys


def _errors(model, xs, ys, dims: int) -> torch.Tensor:
    seq = regression_tokens(xs, ys)  # [B,2P-1,n]
    # one more input: 1 on y tokens, 0 on x tokens; without positions it is what tells them apart
    kind = torch.zeros_like(seq[..., :1])
    kind[:, 1::2] = 1.0
    pred = model(torch.cat([seq, kind], dim=-1))[:, ::2, 0]  # [B,P] read at the x positions
    return (pred - ys) ** 2 / dims


def run(spec: dict, env: study.RunEnv) -> dict:
    # linear attention in its quadratic form: the same function, fastest at these lengths
    config = gpt_config(spec["attention"], linear_form="attention", **_fields(spec))
    torch.manual_seed(spec["seed"])
    model = VectorGPT(config, in_dim=spec["dim"] + 1).to(env.device)
    gen = torch.Generator().manual_seed(spec["seed"])
    held_out = _batch(spec, spec["eval_batch"], spec["dim"], spec["eval_points"],
                      torch.Generator().manual_seed(10_000 + spec["seed"]), env.device)

    def loss_at(step: int) -> torch.Tensor:
        dims, points = curriculum(spec, step)
        return _errors(model, *_batch(spec, spec["batch_size"], dims, points, gen, env.device), dims).mean()

    def evaluate() -> dict:
        by_k = _errors(model, *held_out, spec["dim"]).mean(0).tolist()
        return {"error": sum(by_k[:spec["points"]]) / spec["points"], "error_by_examples": by_k}

    out = study.train(model, lr=spec["lr"], steps=spec["steps"], loss_at=loss_at, evaluate=evaluate,
                      eval_every=spec["eval_every"], env=env)
    final = out["evals"][-1] if not out["diverged"] else {"error": None, "error_by_examples": None}
    out.update(params=study.param_count(model), error=final["error"], error_by_examples=final["error_by_examples"])
    return out


def baselines(s: dict, seed: int) -> dict:
    xs, ys = _batch(s, s["eval_batch"], s["dim"], s["eval_points"], torch.Generator().manual_seed(10_000 + seed))
    n = s["dim"]
    return {name: (fn(xs, ys) / n).mean(0).tolist() for name, fn in (
        ("least_squares", least_squares_errors), ("averaging", averaging_errors),
        ("3-nearest-neighbours", nearest_neighbour_errors), ("zero", lambda x, y: y.double() ** 2))}


def _final(result: dict):
    return result["error"]


def run_study(s: dict, out, *, jobs: int = 1, progress: bool = True, device: str = "cpu",
              max_runs: Optional[int] = None) -> dict:
    runner = study.Runner(f"{__name__}:run", out, jobs=jobs, progress=progress, desc=NAME, device=device,
                          max_runs=max_runs)
    sweep, runs = study.sweep_and_seeds(runner, s["mechanisms"], lrs=s["lrs"], seeds=s["seeds"], score=_final,
                                        spec_for=lambda m, _, lr, seed: run_spec(s, m, lr, seed))
    # baselines per seed, each on that seed's held-out set, then spread like the models
    per_seed = [baselines(s, seed) for seed in range(s["seeds"])]
    base = {b: study.spread_curves([p[b] for p in per_seed]) for b in per_seed[0]}
    return {"settings": s, "sweep": sweep, "runs": runs, "summary": summarize(s, runs, base),
            **runner.counts()}


def _select(runs, mech):
    return sorted((r for r in runs if r["attention"] == mech), key=lambda r: r["seed"])


def summarize(s: dict, runs: list, base: dict) -> dict:
    by_k = {m: study.spread_curves([r["error_by_examples"] for r in _select(runs, m)]) for m in s["mechanisms"]}
    inside = {m: study.spread([r["error"] for r in _select(runs, m)]) for m in s["mechanisms"]}
    extra = {m: study.spread([sum(r["error_by_examples"][s["points"]:]) / (s["eval_points"] - s["points"])
                              if r["error_by_examples"] else None for r in _select(runs, m)])
             for m in s["mechanisms"]}
    return {"trained_points": s["points"], "error_by_examples": by_k, "baselines": base,
            "error_in_distribution": inside, "error_extrapolation": extra}


def table(record: dict) -> str:
    s, summ = record["settings"], record["summary"]
    ks = sorted({0, 1, s["dim"] - 1, s["dim"], s["points"] - 1, s["eval_points"] - 1})
    rows = [(m, summ["error_by_examples"][m]["mean"]) for m in s["mechanisms"]]
    rows += [(b, c["mean"]) for b, c in summ["baselines"].items()]
    w = max(len(r[0]) for r in rows) + 2
    head = f"{'error / n at k examples':<{w}}" + "".join(f"{'k=' + str(k):>8}" for k in ks)
    lines = [head, "-" * len(head)]
    for name, curve in rows:
        lines.append(f"{name:<{w}}" + "".join(f"{curve[k]:>8.3f}" if k < len(curve) and curve[k] is not None
                                              else f"{'-':>8}" for k in ks))
    lines.append(f"(mean over seeds; trained on up to k={s['points'] - 1}, k >= {s['points']} is extrapolation; "
                 f"lr per mechanism: {record['sweep']['chosen']})")
    return "\n".join(lines)


def plot(record: dict, out) -> list:
    out = Path(out)
    s, summ = record["settings"], record["summary"]
    plt = study.pyplot()
    setting = (f"n={s['dim']}, {study.layers(s['n_layer'])}, width {s['n_embd']}, no position embeddings, "
               f"{s['steps']} steps of {s['batch_size']} (curriculum over the first {s['curriculum']:.0%})")
    styles = {"least_squares": "k--", "averaging": "k-.", "3-nearest-neighbours": "k:", "zero": None}
    paths = []
    for name, ks in (("examples", s["points"]), ("extrapolation", s["eval_points"])):
        fig, ax = plt.subplots(figsize=(7, 4.8))
        for i, m in enumerate(s["mechanisms"]):
            curves = [r["error_by_examples"] for r in _select(record["runs"], m) if r["error_by_examples"]]
            study.band(ax, range(ks), [c[:ks] for c in curves], label=m, color=f"C{i}", marker="o")
        for b, st in styles.items():
            if st is not None:
                ax.plot(range(ks), summ["baselines"][b]["mean"][:ks], st, lw=1.5, label=b.replace("_", " "))
        if name == "extrapolation":
            ax.axvspan(s["points"] - 0.5, ks - 0.5, color="grey", alpha=0.12, lw=0)
            ax.text(s["points"], 0.02, "more examples than in training", fontsize=8, transform=ax.get_xaxis_transform())
        ax.set_ylim(0, 1.6)
        study.style(ax, "in-context examples k", "held-out squared error / n (0 = exact, ~1 = predict 0)",
                    f"in-context linear regression: error against examples (band: {s['seeds']} seeds)\n{setting}")
        paths.append(study.save(fig, out / f"{NAME}_{name}.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, m in enumerate(s["mechanisms"]):
        rs = _select(record["runs"], m)
        study.band(ax, [e["step"] for e in rs[0]["evals"]], [[e["error"] for e in r["evals"]] for r in rs],
                   label=m, color=f"C{i}")
    ax.set_ylim(0, 1.6)
    study.style(ax, "training step", f"held-out error / n, mean over k < {s['points']}",
                f"learning curves (band: seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_curves.png"))
    paths.append(study.plot_sweep(record["sweep"], out / f"{NAME}_lr_sweep.png", f"regression\n{setting}",
                                  f"held-out error / n, mean over k < {s['points']}"))
    return paths
