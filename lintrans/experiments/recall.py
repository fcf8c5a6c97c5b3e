"""Study ``recall``: multi-query associative recall (MQAR, Zoology / Based) against state size.

A sequence is P key-value pairs then the P keys again in random order, each followed by a filler
token (``tasks.recall_batch``: T = 4P tokens); keys come from the first half of a vocabulary of 8192
and values from the second, the filler is one more id. ``answers="shown"`` puts each query's answer
after it instead (teacher forcing), as the records made before 2026-11-27 did: a model then sees
which values were already asked for and can score H_P / P (0.21 at 16 pairs) without recalling
anything, against 1 / P when the answers are hidden, as in Zoology (``no_recall_accuracy``).
A 2-layer GPT is trained with cross-entropy at the query positions only and
scored by held-out accuracy there. Its input adds to each token's embedding a learned projection of
the previous token's (``ShiftGPT``: the short convolution of Based and Zoology's models), the same
for every mechanism. The figure is Zoology's: accuracy against the floats one layer keeps to continue
the sequence, measured from the model's own generation cache at length T (softmax: its KV cache,
2 T d; linear: H F (Dv + 1); sliding window: its ring buffer, about 2 w d; gated: H F Dv; the delta
rule: H Dk Dv and its short convolution's last 3 inputs of q, k and v, 9 d). The
state is swept by the width: 64 (4 heads) and 128 (8 heads), head size 16 in both; the feature
dimension of based and ReBased follows from it (F = 1 + p + p(p+1)/2 and p(p+1)/2 at head size p).

Shrunk to fit an hour on 2 cores (Zoology trains far longer, on a mixture of lengths): one setting
(T = 64, 16 pairs) for training, the sweep and the evaluation; 1000 steps of 16 sequences per run,
learning rates 1e-3, 2e-3, 4e-3. Many small steps, because MQAR is learnt in a jump from chance that
short runs stop in the middle of; the shift input, because without it a 2-layer model does not learn
the task at this budget. The rate is swept at each width, since a rate that suits width 64 can leave
width 128 at chance, and chosen by held-out accuracy (what the study reports; equal ones by the lower
loss). Runs: 10 mechanisms x 2 widths x (3 rates + 2 more seeds) = 100.
``--setting hard`` is Zoology's harder point, evaluated at 64 pairs in T = 256 (its record:
docs/results/experiments/recall-hard). Trained on that point alone, not even softmax left chance in
2000 steps (docs/results/experiments/recall-delta/hard-probe2), so it trains as Zoology does, on a
mixture of easier points: ``train_pairs`` lists the pair counts the training steps cycle through
(each step's 16 sequences have P of them in T = 4P), here 4, 8, 16, 32 and 64. Its models are all of
width 64, with 4 heads of 16 or one head of 64 (a head's key space smaller than, or as large as, the
64 pairs), 4000 steps: 50 runs of about 8 minutes each on one core.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from lintrans.models.gpt import GPT

from . import study
from .models import check_specs, gpt_config, state_floats
from .tasks import recall_batch

NAME = "recall"
VERSION = 2

DEFAULT = {
    "mechanisms": ["softmax", "linear:elu", "linear:based", "linear:rebased", "sliding-window:window=8",
                   "gated-linear", "deltanet", "gated-deltanet",
                   # the delta rule with its short convolution starting as the identity instead of PyTorch's
                   # uniform init (the papers' code): the init that decides whether it learns MQAR at all
                   # (docs/experiments.md, "The delta rule")
                   "deltanet:conv_init=identity", "gated-deltanet:conv_init=identity"],
    "shapes": [[64, 4], [128, 8]],  # [width, heads]: head size 16
    "lrs": [1e-3, 2e-3, 4e-3],
    "seeds": 3,
    "n_layer": 2,
    "vocab_size": 8192,
    "pairs": 16,  # evaluated (and trained, unless train_pairs says otherwise) at P pairs in T = 4P
    "train_pairs": [],  # pair counts the training steps cycle through (each <= pairs); empty: pairs alone
    "steps": 1000,
    "batch_size": 16,
    "eval_every": 125,
    "eval_batch": 512,
    "answers": "hidden",  # what follows a query in the input; "shown" (its answer) reproduces the older records
}
# ``--setting hard``: Zoology's harder MQAR point, 64 pairs in T = 256 (four times the keys to hold),
# trained on Zoology's kind of mixture of easier points, 4000 steps. One width, two head layouts: heads
# of 16 (a key space smaller than the pairs) and one head of 64 (as large), where the delta rule's
# erasure should matter; the delta rule with the conv init that lets it learn MQAR at all
PRESETS = {"hard": {"pairs": 64, "train_pairs": [4, 8, 16, 32, 64], "steps": 4000, "eval_every": 500,
                    "shapes": [[64, 4], [64, 1]],
                    "mechanisms": ["softmax", "linear:elu", "gated-linear", "deltanet:conv_init=identity",
                                   "gated-deltanet:conv_init=identity"]}}
# --quick on top of a preset: QUICK, then these (the hard preset's mixture, scaled to QUICK's 4 pairs)
QUICK_PRESETS = {"hard": {"train_pairs": [2, 4]}}
QUICK = {
    "mechanisms": ["softmax", "linear:elu"],
    "shapes": [[16, 2], [32, 2]],
    "seeds": 2,
    "vocab_size": 64,
    "pairs": 4,
    "steps": 20,
    "batch_size": 16,
    "eval_every": 10,
    "eval_batch": 64,
}

# Published MQAR points of the Based paper (Arora et al. 2024, Figure 2 and text), for the plot:
# Based at a state of ~1e4 floats reached ~0.67, and > 0.97 from ~1.5e5; attention ~1.0.
PUBLISHED_BASED = [(1e4, 0.67), (1.5e5, 0.97)]


HELP = study.help_texts(DEFAULT, {
    "mechanisms": "attention specs compared, each NAME[:KEY=VALUE,...], e.g. linear:elu "
                  "gated-deltanet:conv_init=identity",
    "shapes": "model shapes as a JSON list of [width, heads], e.g. '[[64,4],[128,8]]'",
    "lrs": "peak learning rates swept per mechanism and shape",
    "vocab_size": "tokens: keys from one half, values from the other",
    "pairs": "key-value pairs per held-out sequence (T = 4 x pairs)",
    "train_pairs": "pair counts the training steps cycle through, each <= pairs (empty: pairs alone)",
    "answers": "what follows each query in the input: hidden (a filler token, Zoology's MQAR) or shown (its "
               "answer, teacher forcing: a model can rule out values already asked for; the records made before "
               "2026-11-27)",
})
LIMITS = dict.fromkeys(("seeds", "n_layer", "vocab_size", "pairs", "steps", "batch_size", "eval_every", "eval_batch"),
                      study.POSITIVE)
LIMITS["train_pairs"] = {"type": list[int], **study.POSITIVE}
LIMITS["answers"] = {"choices": ("hidden", "shown")}


def validate(s: dict) -> None:
    study.check_settings(s, DEFAULT, LIMITS)
    study.check_lrs(s["lrs"])
    if not isinstance(s["shapes"], list) or not s["shapes"] or not all(
            isinstance(x, list) and len(x) == 2 for x in s["shapes"]):
        raise ValueError(f"shapes must be a list of [width, heads] pairs, got {s['shapes']!r}")
    if s["vocab_size"] < 2 * s["pairs"] or s["vocab_size"] % 2:
        raise ValueError(f"vocab_size ({s['vocab_size']}) must be even and >= 2 * pairs ({2 * s['pairs']})")
    if s["train_pairs"]:
        study.check_ints("train_pairs", s["train_pairs"])
        if s["train_pairs"][-1] > s["pairs"]:
            raise ValueError(f"train_pairs ({s['train_pairs']}) must not exceed pairs ({s['pairs']}): "
                             f"the models' positions cover T = 4 * pairs")
    for width, heads in s["shapes"]:
        study.check_int("a shape's width", width)
        study.check_int("a shape's heads", heads)
        if width % heads:
            raise ValueError(f"shape [{width}, {heads}]: width must be divisible by heads")
        check_specs(s["mechanisms"], n_layer=1, n_head=heads, n_embd=width, block_size=4 * s["pairs"],
                    vocab_size=s["vocab_size"], linear_form="attention")


def run_spec(s: dict, mechanism: str, shape: list, lr: float, seed: int) -> dict:
    keys = ("n_layer", "vocab_size", "pairs", "steps", "batch_size", "eval_every", "eval_batch")
    # train_pairs and answers only where they differ from the older records' task, so those runs keep their keys
    mix = {"train_pairs": s["train_pairs"]} if s["train_pairs"] else {}
    hidden = {"answers": "hidden"} if answers(s) == "hidden" else {}
    return {"study": NAME, "version": VERSION, "attention": mechanism, "width": shape[0], "heads": shape[1],
            "lr": lr, "seed": seed, **{k: s[k] for k in keys}, **mix, **hidden}


def answers(s: dict) -> str:
    """A record's or a run's ``answers``: "shown" where it predates the setting."""
    return s.get("answers", "shown")


def model_vocab(spec: dict) -> int:
    return spec["vocab_size"] + (answers(spec) == "hidden")  # the filler is one more id


def no_recall_accuracy(s: dict) -> float:
    """The best expected accuracy of a model that does not bind keys to values: a value of the context
    at random (1 / P) with the answers hidden; with them shown, one not yet asked for (H_P / P)."""
    P = s["pairs"]
    return 1 / P if answers(s) == "hidden" else sum(1 / i for i in range(1, P + 1)) / P


def _batch(spec: dict, n: int, generator: torch.Generator, device="cpu", pairs: int = None):
    half, pairs = spec["vocab_size"] // 2, pairs or spec["pairs"]
    filler = spec["vocab_size"] if answers(spec) == "hidden" else None
    return recall_batch(n, pairs, pairs, half, half, generator, device, filler=filler)


class ShiftGPT(torch.nn.Module):
    """The GPT with each position's input also carrying the previous token's embedding through a
    learned projection: a width-2 causal convolution on the embeddings, like the short convolutions
    Based and its Zoology baselines put before the sequence mixer. Identical for every mechanism.
    Without it, a 2-layer GPT must first discover a previous-token head through its learned
    positions to bind a value to its key, which took far longer than this study's budget."""

    def __init__(self, config):
        super().__init__()
        self.gpt = GPT(config)
        self.shift = torch.nn.Linear(config.n_embd, config.n_embd, bias=False)
        GPT.init_weights(self.shift)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.gpt.transformer.wte(idx)  # [B,T,C]
        return self.gpt.hidden(inputs_embeds=e + self.shift(F.pad(e[:, :-1], (0, 0, 1, 0))))  # [B,T,C]


def _query_logits(model: ShiftGPT, idx, targets):
    """Logits and answers at the query positions only: the head runs on those rows alone (a
    8192-word head on every position would cost more than the rest of the model)."""
    asked = targets >= 0
    return model.gpt.lm_head(model.hidden(idx)[asked]), targets[asked]  # [N,V], [N]


def decay_half_lives(model: ShiftGPT, idx: torch.Tensor) -> Optional[list]:
    """Per layer and head of a gated delta-rule layer, ln 2 / mean(-log a_t) over idx's tokens: the state's
    half-life in tokens under the decay the layer computes for these inputs. None without such layers."""
    layers = [m for m in model.modules() if getattr(m, "GATED", False) and hasattr(m, "A_log")]
    if not layers:
        return None
    rates = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: rates.append(-mod.log_decay(args[0]).mean((0, 1))))
             for m in layers]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model.hidden(idx)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return [[float(f"{math.log(2) / max(r, 1e-30):.4g}") for r in layer.tolist()] for layer in rates]


def run(spec: dict, env: study.RunEnv) -> dict:
    T = 4 * spec["pairs"]
    # linear attention in its quadratic form: the same function, fastest at T <= 256 on a CPU
    config = gpt_config(spec["attention"], n_layer=spec["n_layer"], n_head=spec["heads"], n_embd=spec["width"],
                        block_size=T, vocab_size=model_vocab(spec), linear_form="attention")
    torch.manual_seed(spec["seed"])
    model = ShiftGPT(config).to(env.device)
    train_gen = torch.Generator().manual_seed(spec["seed"])
    held_out = _batch(spec, spec["eval_batch"], torch.Generator().manual_seed(10_000 + spec["seed"]), env.device)

    mix = spec.get("train_pairs") or [spec["pairs"]]

    def loss_at(step: int) -> torch.Tensor:
        batch = _batch(spec, spec["batch_size"], train_gen, env.device, pairs=mix[step % len(mix)])
        return F.cross_entropy(*_query_logits(model, *batch))

    def evaluate() -> dict:
        logits, answers = _query_logits(model, *held_out)
        return {"loss": F.cross_entropy(logits, answers).item(),
                "accuracy": (logits.argmax(-1) == answers).float().mean().item()}

    probe = held_out[0][:64]
    half_lives = decay_half_lives(model, probe)
    out = study.train(model, lr=spec["lr"], steps=spec["steps"], loss_at=loss_at, evaluate=evaluate,
                      eval_every=spec["eval_every"], env=env)
    if half_lives is not None:  # a gated delta rule: how training moved its memory (docs/experiments.md)
        out.update(decay_half_lives_start=half_lives, decay_half_lives_end=decay_half_lives(model, probe))
    final = out["evals"][-1] if not out["diverged"] else {"loss": None, "accuracy": None}
    out.update(params=study.param_count(model), state_floats=state_floats(model.gpt, T),
               final_loss=final["loss"], accuracy=final["accuracy"])
    return out


def _final_accuracy(result: dict):
    return result["accuracy"]


def _final_loss(result: dict):
    return result["final_loss"]


def run_study(s: dict, out, *, jobs: int = 1, progress: bool = True, device: str = "cpu",
              max_runs: Optional[int] = None) -> dict:
    runner = study.Runner(f"{__name__}:run", out, jobs=jobs, progress=progress, desc=NAME, device=device,
                          max_runs=max_runs)
    sweep, runs = study.sweep_and_seeds(
        runner, s["mechanisms"], lrs=s["lrs"], seeds=s["seeds"], points=s["shapes"],
        # a rate per shape: the rate chosen at width 64 left width 128 at chance (the first version-2 record)
        sweep_point=study.EACH_POINT,
        # the rate of the best held-out accuracy, what the study reports (equal ones: the lower loss); by loss
        # alone the choice could miss it (docs/experiments.md)
        spec_for=lambda m, shape, lr, seed: run_spec(s, m, shape, lr, seed), score=_final_accuracy,
        maximize=True, tiebreak=_final_loss,
        fields=lambda shape: {"width": shape[0], "heads": shape[1]})
    return {"settings": s, "sweep": sweep, "runs": runs, "summary": summarize(s, runs), **runner.counts()}


def _mixture(s: dict) -> str:
    """The training mixture, "4/8/16/32/64", or "" when training is at ``pairs`` alone."""
    return "/".join(map(str, s.get("train_pairs") or []))


def _shape_label(width: int, heads: int) -> str:
    return f"width {width}, {heads} head{'' if heads == 1 else 's'}"


def _select(runs, mech, shape):
    return sorted((r for r in runs if r["attention"] == mech and [r["width"], r["heads"]] == list(shape)),
                  key=lambda r: r["seed"])


def summarize(s: dict, runs: list) -> dict:
    points = {}
    for m in s["mechanisms"]:
        points[m] = []
        for shape in s["shapes"]:
            rs = _select(runs, m, shape)
            points[m].append({"width": shape[0], "heads": shape[1], "state_floats": rs[0]["state_floats"],
                              "params": rs[0]["params"], "accuracy": study.spread([r["accuracy"] for r in rs])})
    chance = 1 / (s["vocab_size"] // 2)
    return {"sequence_length": 4 * s["pairs"], "pairs": s["pairs"], "answers": answers(s), "chance_accuracy": chance,
            "no_recall_accuracy": no_recall_accuracy(s), "points": points}


def table(record: dict) -> str:
    s, points = record["settings"], record["summary"]["points"]
    w = max(len(m) for m in s["mechanisms"]) + 2
    head = f"{'accuracy (state floats/layer)':<{w}}" + "".join(
        f"{'d=%d H=%d' % tuple(shape):>22}" for shape in s["shapes"])
    lines = [head, "-" * len(head)]
    for m in s["mechanisms"]:
        cells = []
        for p in points[m]:
            a, failed = p["accuracy"]["mean"], p["accuracy"].get("n_failed", 0)
            mark = f" [{failed} failed]" if failed and a is not None else ""  # the mean leaves them out
            cells.append(f"{('diverged' if a is None else f'{a:.3f}') + mark + ' (%.3g)' % p['state_floats']:>22}")
        lines.append(f"{m:<{w}}" + "".join(cells))
    trained = f", trained on {_mixture(s)} pairs" if _mixture(s) else ""
    lines.append(f"(mean over seeds; T={record['summary']['sequence_length']}, {s['pairs']} pairs{trained}, answers "
                 f"{answers(s)}: without binding keys to values a model scores up to {no_recall_accuracy(s):.3f})")
    for sw in record["sweep"]:
        lines.append(f"lr per mechanism at {_shape_label(sw['width'], sw['heads'])}: {sw['chosen']}")
    return "\n".join(lines)


def plot(record: dict, out) -> list:
    out = Path(out)
    s, summ = record["settings"], record["summary"]
    plt = study.pyplot()
    mechs = s["mechanisms"]
    trained = f" (trained on {_mixture(s)})" if _mixture(s) else ""
    # two lines: one panel's figure is too narrow for it on one
    setting = (f"MQAR: T={summ['sequence_length']}, {s['pairs']} pairs{trained}, answers {answers(s)},\n"
               f"vocabulary {s['vocab_size']}, {study.layers(s['n_layer'])}, {s['steps']} steps of {s['batch_size']}")
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, m in enumerate(mechs):
        pts = sorted(summ["points"][m], key=lambda p: p["state_floats"])
        per_seed = [[r["accuracy"] for r in _select(record["runs"], m, [p["width"], p["heads"]])] for p in pts]
        study.band(ax, [p["state_floats"] for p in pts], [list(c) for c in zip(*per_seed)], label=m,
                   color=f"C{i}", marker="o")
    if not s.get("quick"):  # beside a machinery check's chance-level curves they would read as a failure
        ax.plot(*zip(*PUBLISHED_BASED), "*", color="grey", ms=10, label="Based, published (Zoology scale)")
    floor = no_recall_accuracy(s)
    ax.axhline(floor, color="grey", ls=":", lw=1, label=f"no key-value binding ({floor:.3f})")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    study.style(ax, "state per layer (floats; softmax: KV cache at T)", "held-out accuracy at queries",
                f"associative recall against state size (points: width/heads; band: {s['seeds']} seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_state.png"))

    shapes = s["shapes"]
    fig, axes = study.panels([_shape_label(w, h) for w, h in shapes], sharey=True)
    for ax, shape in zip(axes, shapes):
        for i, m in enumerate(mechs):
            rs = _select(record["runs"], m, shape)
            study.band(ax, [e["step"] for e in rs[0]["evals"]], [[e["accuracy"] for e in r["evals"]] for r in rs],
                       label=m, color=f"C{i}")
    study.finish_panels(fig, axes, "training step", "held-out accuracy", f"learning curves (band: seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_curves.png"))

    by = "held-out accuracy at queries" if record["sweep"][0].get("maximize") else "held-out loss at queries"
    paths.append(study.plot_sweep(record["sweep"], out / f"{NAME}_lr_sweep.png", setting, by,
                                  panel_title=lambda sw: _shape_label(sw["width"], sw["heads"])))
    return paths
