"""Study ``context`` ("Linear Transformers Are Faster After All", section 5): does attention's gap to softmax grow with context?

The same small byte-level GPT, only its attention swapped, is trained on the embedded corpus at
several context lengths T with the tokens per update fixed (batch = tokens_per_update / T) and the
token budget fixed (same number of updates), on the same data: at update s every run reads the same
tokens_per_update + 1 consecutive tokens of the training split (a seeded offset) cut into windows of
T, so the contexts differ only in how the stream is cut. Held-out loss is measured on the first
``val_tokens`` of the validation split cut the same way, every ``eval_every`` updates.

The default runs 77 runs (sweep: 7 mechanisms x 3 rates at T=512; seeds: 7 x 3 contexts x 3 seeds,
less the 7 seed-0 runs at T=512 the sweep already has) of 600 updates each, so every run sees
600 x 2048 = 1.2M tokens; it is sized to finish within an hour with ``--jobs 2`` on a 2-core CPU
(docs/experiments.md).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from lintrans.models.gpt import GPT

from . import study
from .models import check_specs, gpt_config

NAME = "context"
VERSION = 1

DEFAULT = {
    "mechanisms": ["softmax", "linear:elu", "linear:based", "linear:rebased", "sliding-window:window=64",
                   "retention", "gated-linear"],
    "contexts": [128, 512, 2048],
    "sweep_context": 512,
    "lrs": [1e-3, 3e-3, 1e-2],
    "seeds": 3,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "tokens_per_update": 2048,
    "steps": 600,
    "eval_every": 60,
    "val_tokens": 16384,
    "source": "builtin:python-docs",
}
QUICK = {
    "mechanisms": ["softmax", "linear:elu"],
    "contexts": [32, 128],
    "sweep_context": 32,
    "lrs": [1e-3, 3e-3, 1e-2],
    "seeds": 2,
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "tokens_per_update": 256,
    "steps": 30,
    "eval_every": 10,
    "val_tokens": 512,
}


def validate(s: dict) -> None:
    for name in ("n_layer", "n_head", "n_embd", "tokens_per_update", "steps", "eval_every", "val_tokens",
                 "seeds", "sweep_context"):
        study.check_int(name, s[name])
    study.check_ints("contexts", s["contexts"])
    study.check_lrs(s["lrs"])
    if s["sweep_context"] not in s["contexts"]:
        raise ValueError(f"sweep_context ({s['sweep_context']}) must be one of contexts {s['contexts']}")
    for T in s["contexts"]:
        if s["tokens_per_update"] % T or s["val_tokens"] % T:
            raise ValueError(f"tokens_per_update ({s['tokens_per_update']}) and val_tokens ({s['val_tokens']}) "
                             f"must be multiples of every context, got {T}")
    check_specs(s["mechanisms"], n_layer=1, n_head=s["n_head"], n_embd=s["n_embd"], block_size=max(s["contexts"]),
                vocab_size=257)


def run_spec(s: dict, mechanism: str, context: int, lr: float, seed: int) -> dict:
    keys = ("n_layer", "n_head", "n_embd", "tokens_per_update", "steps", "eval_every", "val_tokens", "source")
    return {"study": NAME, "version": VERSION, "attention": mechanism, "context": context, "lr": lr, "seed": seed,
            **{k: s[k] for k in keys}}


@functools.lru_cache(maxsize=None)
def token_data(source: str):
    from lintrans.train.data import prepare_data, resolve_source
    from lintrans.train.tokenizer import get_tokenizer

    return prepare_data(resolve_source(source), get_tokenizer("bytes"), progress=False)


def _windows(tokens: np.ndarray, start: int, n_tokens: int, T: int, device="cpu"):
    """n_tokens + 1 consecutive tokens from ``start`` cut into inputs and targets [n_tokens / T, T]."""
    chunk = torch.from_numpy(tokens[start:start + n_tokens + 1].astype(np.int64))
    idx = torch.arange(n_tokens // T)[:, None] * T + torch.arange(T + 1)[None, :]  # [B, T+1]
    w = chunk[idx].to(device)
    return w[:, :-1], w[:, 1:]


class TextStream:
    """Training batches and held-out windows of the corpus for one run.

    Update s reads tokens_per_update + 1 consecutive training tokens from a seeded offset, cut into
    windows of T: every mechanism and context of one seed sees the same tokens in the same order.
    Held-out: the first ``val_tokens`` of the validation split, cut the same way.
    """

    def __init__(self, source: str, T: int, tokens_per_update: int, steps: int, seed: int, val_tokens: int,
                 device="cpu"):
        self.data = token_data(source)
        self.T, self.tpu, self.device = T, tokens_per_update, device
        rng = np.random.Generator(np.random.PCG64(seed))
        self.starts = rng.integers(0, len(self.data.train) - tokens_per_update - 1, size=steps)
        self.val = [_windows(self.data.val, i, min(tokens_per_update, val_tokens - i), T, device)
                    for i in range(0, val_tokens, tokens_per_update)]

    def batch(self, step: int):
        return _windows(self.data.train, int(self.starts[step]), self.tpu, self.T, self.device)

    def val_loss(self, model: GPT) -> float:
        with torch.no_grad():
            total = sum(model(x, y, return_logits=False)[1].item() * x.numel() for x, y in self.val)
        return total / sum(x.numel() for x, _ in self.val)


def run(spec: dict, env: study.RunEnv) -> dict:
    return train_lm(spec, env)[1]


def train_lm(spec: dict, env: study.RunEnv):
    """Train the GPT of a run spec on the text stream: (model, result)."""
    T = spec["context"]
    stream = TextStream(spec["source"], T, spec["tokens_per_update"], spec["steps"], spec["seed"],
                        spec["val_tokens"], env.device)
    config = gpt_config(spec["attention"], n_layer=spec["n_layer"], n_head=spec["n_head"], n_embd=spec["n_embd"],
                        block_size=T, vocab_size=stream.data.vocab_size)
    torch.manual_seed(spec["seed"])
    model = GPT(config).to(env.device)
    out = study.train(model, lr=spec["lr"], steps=spec["steps"],
                      loss_at=lambda step: model(*stream.batch(step), return_logits=False)[1],
                      evaluate=lambda: {"val_loss": stream.val_loss(model)}, eval_every=spec["eval_every"], env=env)
    out["params"] = study.param_count(model)
    out["spikes"] = study.loss_spikes(out["train_loss"])
    out["final_val_loss"] = out["evals"][-1]["val_loss"] if not out["diverged"] else None
    return model, out


def _final(result: dict):
    return result["final_val_loss"]


def run_study(s: dict, out, *, jobs: int = 1, progress: bool = True, device: str = "cpu") -> dict:
    runner = study.Runner(f"{__name__}:run", out, jobs=jobs, progress=progress, desc=NAME, device=device)
    token_data(s["source"])  # tokenise (cached) once here, not in every worker
    sweep, runs = study.sweep_and_seeds(
        runner, s["mechanisms"], lrs=s["lrs"], seeds=s["seeds"], points=s["contexts"], sweep_point=s["sweep_context"],
        spec_for=lambda m, T, lr, seed: run_spec(s, m, T, lr, seed), score=_final, fields=lambda T: {"context": T})
    return {"settings": s, "sweep": sweep, "runs": runs, "summary": summarize(s, runs),
            **runner.counts()}


# --- summary ----------------------------------------------------------------------------------


def _select(runs, mech, T):
    return sorted((r for r in runs if r["attention"] == mech and r["context"] == T), key=lambda r: r["seed"])


def _loss_at_time(run: dict, t: float):
    """Held-out loss of the last evaluation at or before t training seconds (the final one if the run
    finished sooner: a run that stops early keeps its final loss)."""
    before = [e for e in run["evals"] if e["seconds"] <= t]
    return before[-1]["val_loss"] if before else None


def summarize(s: dict, runs: list) -> dict:
    mechs, contexts = s["mechanisms"], s["contexts"]
    final, gap, spikes = {}, {}, {}
    for m in mechs:
        final[m], gap[m], spikes[m] = {}, {}, {}
        for T in contexts:
            rs, base = _select(runs, m, T), _select(runs, mechs[0], T)
            final[m][str(T)] = study.spread([r["final_val_loss"] for r in rs])
            # paired by seed: the same data order and initial seed
            pairs = [(a["final_val_loss"], b["final_val_loss"]) for a, b in zip(rs, base)]
            gap[m][str(T)] = study.spread([a - b if a is not None and b is not None else None for a, b in pairs])
            spikes[m][str(T)] = {"count": study.spread([len(r["spikes"]) for r in rs]),
                            "per_seed": [[(p["step"], round(p["size"], 3)) for p in r["spikes"]] for r in rs]}
    longest = max(contexts)
    at_long = {m: _select(runs, m, longest) for m in mechs}
    finish = {m: study.spread([r["train_seconds"] for r in rs]) for m, rs in at_long.items()}
    reference = mechs[0]
    t_ref = finish[reference]["mean"]
    t_fast = min(f["mean"] for f in finish.values() if f["mean"] is not None)
    same_time = {}
    for m, rs in at_long.items():
        same_time[m] = {"finish_seconds": finish[m],
                        f"val_loss_at_{reference}_finish": study.spread([_loss_at_time(r, t_ref) for r in rs]),
                        "val_loss_at_fastest_finish": study.spread([_loss_at_time(r, t_fast) for r in rs])}
    others = [m for m in mechs if m != reference]
    best = min(others, key=lambda m: final[m][str(longest)]["mean"] or float("inf")) if others else None
    return {
        "reference": reference,
        "final_val_loss": final,
        f"gap_to_{reference}": gap,
        "spikes": spikes,
        "longest_context": longest,
        "same_time": {"reference_finish_seconds": t_ref, "fastest_finish_seconds": t_fast,
                      "best_other_at_longest": best, "mechanisms": same_time},
    }


# --- report -----------------------------------------------------------------------------------


def table(record: dict) -> str:
    s, summ = record["settings"], record["summary"]
    ref = summ["reference"]
    w = max(len(m) for m in s["mechanisms"]) + 2
    head = f"{'final val loss (nats/byte)':<{w}}" + "".join(f"{'T=' + str(T):>22}" for T in s["contexts"])
    lines = [head, "-" * len(head)]
    for m in s["mechanisms"]:
        cells = []
        for T in s["contexts"]:
            f, g = summ["final_val_loss"][m][str(T)], summ[f"gap_to_{ref}"][m][str(T)]
            cell = "diverged" if f["mean"] is None else f"{f['mean']:.3f}"
            if g["mean"] is not None and m != ref:
                cell += f" ({g['mean']:+.3f})"
            cells.append(f"{cell:>22}")
        lines.append(f"{m:<{w}}" + "".join(cells))
    lines.append(f"(in brackets: gap to {ref}, mean over seeds; lr per mechanism: {record['sweep']['chosen']})")
    return "\n".join(lines)


def plot(record: dict, out) -> list:
    from pathlib import Path

    out = Path(out)
    s, summ = record["settings"], record["summary"]
    plt = study.pyplot()
    mechs, contexts = s["mechanisms"], s["contexts"]
    setting = (f"{s['n_layer']} layers, width {s['n_embd']}, {s['tokens_per_update']} tokens/update, "
               f"{s['steps']} updates, byte-level {s['source']}")
    colors = {m: f"C{i}" for i, m in enumerate(mechs)}
    runs = record["runs"]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for m in mechs:
        curves = [[r["final_val_loss"] for r in _select(runs, m, T)] for T in contexts]  # [T][seed]
        study.band(ax, contexts, [list(c) for c in zip(*curves)], label=m, color=colors[m], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(T) for T in contexts])
    study.style(ax, "context length T (tokens per update fixed)", "final held-out loss (nats/byte)",
                f"final held-out loss against context, mean and min-max over {s['seeds']} seeds\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_final.png"))

    shade = {T: plt.cm.viridis(i / max(1, len(contexts) - 1)) for i, T in enumerate(contexts)}
    fig, axes = study.panels(mechs, sharey=True)
    for ax, m in zip(axes, mechs):
        for T in contexts:
            rs = _select(runs, m, T)
            tokens = [e["step"] * s["tokens_per_update"] / 1e6 for e in rs[0]["evals"]]
            study.band(ax, tokens, [[e["val_loss"] for e in r["evals"]] for r in rs], label=f"T={T}",
                       color=shade[T])
    _clip_top(axes[0], runs)
    study.finish_panels(fig, axes, "training tokens (millions)", "held-out loss",
                        f"held-out loss during training, every context of each mechanism (band: seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_curves.png"))

    T = summ["longest_context"]
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for m in mechs:
        rs = _select(runs, m, T)
        n = min(len(r["evals"]) for r in rs)
        secs = [sum(r["evals"][i]["seconds"] for r in rs) / len(rs) for i in range(n)]
        study.band(ax, secs, [[e["val_loss"] for e in r["evals"]] for r in rs], label=m, color=colors[m])
    _clip_top(ax, runs)
    study.style(ax, "training seconds (mean over seeds; one torch thread per run)", "held-out loss (nats/byte)",
                f"T={T}: held-out loss against wall-clock training time\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_wallclock.png"))

    fig, axes = study.panels([f"{m} (seed 0)" for m in mechs])
    for ax, m in zip(axes, mechs):
        for T in contexts:
            r = _select(runs, m, T)[0]
            ax.plot(r["train_loss"], lw=0.6, color=shade[T], label=f"T={T}")
            for p in r["spikes"]:
                ax.plot(p["step"], r["train_loss"][p["step"]], "x", color="red", ms=5)
    study.finish_panels(fig, axes, "update", "training loss",
                        "training loss of every update; red x = spike (> 0.5 nats above the mean of the 20 before)")
    paths.append(study.save(fig, out / f"{NAME}_spikes.png"))

    paths.append(study.plot_sweep(record["sweep"], out / f"{NAME}_lr_sweep.png",
                                  f"context at T={s['sweep_context']}\n{setting}", "final held-out loss"))
    return paths


def _clip_top(ax, runs) -> None:
    """Keep the first evaluations (about ln 257) from squashing the rest of the curves."""
    finals = [r["final_val_loss"] for r in runs if r["final_val_loss"] is not None]
    if finals:
        ax.set_ylim(top=max(finals) + 1.0)
