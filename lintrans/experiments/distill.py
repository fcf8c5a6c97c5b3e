"""Study ``distill`` (Hedgehog, Zhang et al. 2024): how much of a softmax GPT survives linearisation?

1. A teacher: a small byte-level softmax GPT trained on the embedded corpus (the ``context`` study's
   training, its weights kept as safetensors in the run store). Its learning rate is swept too.
2. For each feature map, the teacher's attention is replaced by normalised linear attention with
   that map, every other weight kept. Hedgehog's map (per layer, per head, feature size 2 x head
   size) is first fitted to mimic the teacher's softmax attention weights on training text
   (``distill_feature_maps``, the teacher frozen); elu, based (2nd-order Taylor) and Performer
   (random features, as many as Hedgehog's) have nothing to fit.
3. Measured on held-out text: the KL divergence from the teacher's attention weights to the
   replaced model's, per layer (averaged over heads and query rows); the validation loss with no
   fine-tuning; and after a short fine-tune of the whole model at the map's own learning rate
   (swept). ``softmax`` is the control: the teacher itself fine-tuned for the same steps.

Quality recovered = (L_unigram - L) / (L_unigram - L_teacher), where L_unigram is the held-out loss
of predicting every byte from its training-split frequency (no context at all): 100% matches the
teacher, 0% is no better than ignoring the context.

The default: teachers of 2 layers, width 128, 3 sweep rates + 2 more seeds = 5 runs of 1500 updates;
replaced models: 5 maps x (3 rates + 2 seeds) = 25 runs. It is sized to finish in well under an hour
with ``--jobs 2`` on a 2-core CPU (docs/experiments.md).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lintrans.checks import check_number
from lintrans.models.gpt import GPT
from lintrans.nn.feature_maps import (Hedgehog, attention_weights, distill_feature_maps,
                                      hedgehog_distillation_loss, softmax_attention_weights)

from . import context, study
from .models import gpt_config

NAME = "distill"
VERSION = 1

DEFAULT = {
    "maps": ["hedgehog", "elu", "based", "performer", "softmax"],
    "teacher_lrs": [1e-3, 3e-3, 1e-2],
    "lrs": [3e-4, 1e-3, 3e-3],  # fine-tuning, swept per map
    "seeds": 3,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "context": 128,
    "tokens_per_update": 2048,
    "teacher_steps": 1500,
    "eval_every": 150,
    "val_tokens": 16384,
    "distill_steps": 200,
    "distill_batch": 8,
    "distill_lr": 1e-2,
    "finetune_steps": 200,
    "kl_windows": 16,
    "source": "builtin:python-docs",
}
QUICK = {
    "maps": ["hedgehog", "elu"],
    "seeds": 2,
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 16,
    "context": 32,
    "tokens_per_update": 256,
    "teacher_steps": 20,
    "eval_every": 10,
    "val_tokens": 512,
    "distill_steps": 5,
    "distill_batch": 2,
    "finetune_steps": 6,
    "kl_windows": 2,
}
MAPS = ("hedgehog", "elu", "based", "performer", "softmax")


HELP = study.help_texts(DEFAULT, {
    "maps": "feature maps that replace the teacher's softmax (softmax: the teacher itself, the control)",
    "teacher_lrs": "learning rates swept for the softmax teacher",
    "lrs": "fine-tuning learning rates swept per map",
    "context": "context length T of teacher and students",
    "tokens_per_update": "tokens per optimizer step",
    "teacher_steps": "optimizer steps training each teacher",
    "val_tokens": "held-out tokens evaluated",
    "distill_steps": "steps fitting Hedgehog's maps to the teacher's attention weights",
    "distill_batch": "sequences per distillation step",
    "distill_lr": "learning rate of the distillation",
    "finetune_steps": "steps fine-tuning each replaced model",
    "kl_windows": "held-out windows over which the attention KL is measured",
    "source": "the text (a data source as train's data.source, default the embedded corpus)",
})
LIMITS = dict.fromkeys(("seeds", "n_layer", "n_head", "n_embd", "context", "tokens_per_update", "teacher_steps",
                       "eval_every", "val_tokens", "distill_steps", "distill_batch", "finetune_steps", "kl_windows"),
                      study.POSITIVE)


def validate(s: dict) -> None:
    study.check_settings(s, DEFAULT, LIMITS)
    from lintrans.train.data import resolve_source

    try:
        resolve_source(s["source"])
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"source: {e}") from None
    study.check_lrs(s["lrs"])
    study.check_lrs(s["teacher_lrs"], "teacher_lrs")
    check_number("distill_lr", s["distill_lr"], low=0, high=1, low_open=True, high_open=True)
    if not isinstance(s["maps"], list) or not s["maps"] or any(m not in MAPS for m in s["maps"]):
        raise ValueError(f"maps must be a non-empty list from {list(MAPS)}, got {s['maps']!r}")
    if len(set(s["maps"])) != len(s["maps"]):
        raise ValueError(f"maps must be distinct, got {s['maps']}")
    if s["n_embd"] % s["n_head"]:
        raise ValueError(f"n_embd ({s['n_embd']}) must be divisible by n_head ({s['n_head']})")
    T = s["context"]
    if s["tokens_per_update"] % T or s["val_tokens"] % T:
        raise ValueError(f"tokens_per_update ({s['tokens_per_update']}) and val_tokens ({s['val_tokens']}) must be "
                         f"multiples of context ({T})")
    # the windows there are: more would be recorded but not used (the runs take what there is)
    for name, total, whole in (("distill_batch", "tokens_per_update", s["tokens_per_update"] // T),
                               ("kl_windows", "val_tokens", s["val_tokens"] // T)):
        if s[name] > whole:
            raise ValueError(f"{name} ({s[name]}) exceeds the {whole} windows of {total} / context "
                             f"({s[total]} / {T})")


def teacher_spec(s: dict, lr: float, seed: int) -> dict:
    spec = context.run_spec({**s, "steps": s["teacher_steps"]}, "softmax", s["context"], lr, seed)
    return {**spec, "study": NAME, "role": "teacher", "version": VERSION, **source_key(s["source"])}


def source_key(source: str) -> dict:
    """What names a text besides its spec: a file or folder by its content, so that runs on a source
    whose files changed are trained again, not reused. The embedded corpus, versioned with lintrans,
    is named by its name alone (the keys of the runs recorded before this existed)."""
    from lintrans.train.data import resolve_source

    resolved = resolve_source(source)
    if getattr(resolved, "builtin", None) is not None:
        return {}
    if hasattr(resolved, "files"):
        files = list(resolved.files)
    else:  # a nanoGPT token file, or a folder of train.bin and val.bin
        files = sorted(resolved.path.glob("*.bin")) if resolved.path.is_dir() else [resolved.path]
    stats = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return {"source_sha256": _content_hash(source, stats)}


@functools.lru_cache(maxsize=None)
def _content_hash(source: str, stats: tuple) -> str:
    """The hash of a source's files, read once per (files, sizes, modification times) in a process."""
    from lintrans.train.data import resolve_source

    resolved = resolve_source(source)
    if hasattr(resolved, "fingerprint"):
        return resolved.fingerprint()
    import hashlib

    h = hashlib.sha256()
    for path, _, _ in stats:
        h.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def map_spec(s: dict, teacher: dict, fmap: str, lr: float) -> dict:
    keys = ("distill_steps", "distill_batch", "distill_lr", "finetune_steps", "kl_windows")
    return {"study": NAME, "version": VERSION, "role": "replace", "map": fmap, "lr": lr, "seed": teacher["seed"],
            "teacher": teacher, **{k: s[k] for k in keys}}


def _units(spec: dict) -> int:
    if spec["role"] == "teacher":
        return spec["steps"]
    return spec["finetune_steps"] + (spec["distill_steps"] * spec["teacher"]["n_layer"] if spec["map"] == "hedgehog"
                                     else 0)


def run(spec: dict, env: study.RunEnv) -> dict:
    return run_teacher(spec, env) if spec["role"] == "teacher" else run_replace(spec, env)


def run_teacher(spec: dict, env: study.RunEnv) -> dict:
    from safetensors.torch import save_model

    from lintrans._io import atomic_write

    model, out = context.train_lm(spec, env)
    # weights first, then (by the caller) the JSON that marks the run finished
    atomic_write(env.path(spec, ".safetensors"), lambda tmp: save_model(model, tmp))
    out["unigram_val_loss"] = unigram_loss(spec["source"], spec["context"], spec["tokens_per_update"],
                                           spec["val_tokens"])
    return out


@functools.lru_cache(maxsize=None)
def unigram_loss(source: str, T: int, tokens_per_update: int, val_tokens: int) -> float:
    """Held-out cross-entropy (nats/token) of each token's training-split frequency (add-one smoothed),
    on exactly the held-out targets the models' ``val_loss`` averages over."""
    data = context.token_data(source)
    counts = np.bincount(np.asarray(data.train), minlength=data.vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    stream = context.TextStream(source, T, tokens_per_update, 1, 0, val_tokens)
    targets = np.concatenate([y.numpy().ravel() for _, y in stream.val])
    return float(-logp[targets].mean())


def load_teacher(teacher: dict, env: study.RunEnv) -> GPT:
    from safetensors.torch import load_model

    model = GPT(_config(teacher, "softmax"))
    load_model(model, env.path(teacher, ".safetensors"))
    return model.to(env.device)


def _config(teacher: dict, fmap: str):
    fields = dict(n_layer=teacher["n_layer"], n_head=teacher["n_head"], n_embd=teacher["n_embd"],
                  block_size=teacher["context"], vocab_size=context.token_data(teacher["source"]).vocab_size)
    if fmap == "softmax":
        return gpt_config("softmax", **fields)
    config = gpt_config(f"linear:{fmap}", **fields)
    if fmap == "performer":  # as many random features as Hedgehog has learned ones, seeded
        head = teacher["n_embd"] // teacher["n_head"]
        config.attention_options["feature_map_options"] = {"num_features": 2 * head, "seed": teacher["seed"]}
    return config


def layer_qk(model: GPT, idx: torch.Tensor) -> list:
    """Queries and keys [B, T, H, D] every attention layer computes for ``idx``."""
    t = model.transformer
    h = t.wte(idx) + (t.wpe(torch.arange(idx.shape[1], device=idx.device)) if "wpe" in t else 0)
    out = []
    for block in t.h:
        q, k, _ = block.attn.qkv(block.ln_1(h))
        out.append((q, k))
        h, _ = block(h)
    return out


def layer_map(attn):
    """The feature map a LinearAttention layer applies (a name, one module or a (phi_q, phi_k) pair)."""
    if attn.feature_map_name is not None:
        return attn.feature_map_name
    return attn.phi_q if attn.phi_k is None else (attn.phi_q, attn.phi_k)


def attention_kl(teacher: GPT, model: GPT, windows: torch.Tensor) -> list:
    """Per layer: KL(teacher's softmax weights || the replaced layer's linear weights), averaged over
    batch, heads and query rows, on the teacher's queries and keys."""
    kls = []
    with torch.no_grad():
        for (q, k), block in zip(layer_qk(teacher, windows), model.transformer.h):
            a = softmax_attention_weights(q, k)  # [B,H,T,T]
            p = attention_weights(q, k, layer_map(block.attn))
            entropy = -(a * torch.log(a.clamp_min(1e-12))).sum(-1).mean()
            kls.append((hedgehog_distillation_loss(p, a) - entropy).item())
    return kls


def _distill_hedgehog(teacher: GPT, model: GPT, stream: context.TextStream, spec: dict, env) -> list:
    """Fit every layer's Hedgehog pair to the frozen teacher's attention on training windows."""
    curves = []
    for i, block in enumerate(model.transformer.h):
        attn = block.attn

        def batches():
            for step in range(spec["distill_steps"]):
                x, _ = stream.batch(step)
                with torch.no_grad():
                    q, k = layer_qk(teacher, x[:spec["distill_batch"]])[i]
                env.advance()
                yield q, k

        curves.append(distill_feature_maps((attn.phi_q, attn.phi_k), batches(), lr=spec["distill_lr"]))
    return curves


def run_replace(spec: dict, env: study.RunEnv) -> dict:
    teacher_spec_ = spec["teacher"]
    teacher = load_teacher(teacher_spec_, env).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    fmap = spec["map"]
    model = GPT(_config(teacher_spec_, fmap)).to(env.device)
    missing, unexpected = model.load_state_dict(teacher.state_dict(), strict=False)
    assert not unexpected and all(".phi_" in k for k in missing), (missing, unexpected)
    T = teacher_spec_["context"]
    # distillation and fine-tuning read training windows from their own seeded offsets
    stream = context.TextStream(teacher_spec_["source"], T, teacher_spec_["tokens_per_update"],
                                max(spec["distill_steps"], spec["finetune_steps"]), 1000 + spec["seed"],
                                teacher_spec_["val_tokens"], env.device)
    torch.manual_seed(spec["seed"])
    out = {"distill_loss": _distill_hedgehog(teacher, model, stream, spec, env) if fmap == "hedgehog" else None}
    kl_windows = torch.cat([x for x, _ in stream.val])[:spec["kl_windows"]]
    out["attention_kl"] = attention_kl(teacher, model, kl_windows) if fmap != "softmax" else [0.0] * len(
        model.transformer.h)
    model.eval()
    out["val_loss_no_finetune"] = stream.val_loss(model)
    tuned = study.train(model, lr=spec["lr"], steps=spec["finetune_steps"],
                        loss_at=lambda step: model(*stream.batch(step), return_logits=False)[1],
                        evaluate=lambda: {"val_loss": stream.val_loss(model)},
                        eval_every=max(1, spec["finetune_steps"] // 4), env=env)
    out["finetune"] = tuned
    out["val_loss_finetuned"] = tuned["evals"][-1]["val_loss"] if not tuned["diverged"] else None
    return out


def _final_teacher(result: dict):
    return result["final_val_loss"]


def _final_tuned(result: dict):
    return result["val_loss_finetuned"]


def run_study(s: dict, out, *, jobs: int = 1, progress: bool = True, device: str = "cpu",
              max_runs: Optional[int] = None) -> dict:
    runner = study.Runner(f"{__name__}:run", out, jobs=jobs, progress=progress, units=_units, desc=NAME,
                          device=device, max_runs=max_runs)
    context.check_sizes(context.token_data(s["source"]), s["tokens_per_update"], s["val_tokens"])  # before any run
    teacher_sweep, teachers = study.sweep_and_seeds(
        runner, ["teacher"], lrs=s["teacher_lrs"], seeds=s["seeds"], score=_final_teacher, name="role",
        spec_for=lambda _, __, lr, seed: teacher_spec(s, lr, seed))
    specs = [teacher_spec(s, t["lr"], t["seed"]) for t in teachers]
    sweep, runs = study.sweep_and_seeds(
        runner, s["maps"], lrs=s["lrs"], seeds=s["seeds"], score=_final_tuned, name="map",
        spec_for=lambda m, _, lr, seed: map_spec(s, specs[seed], m, lr))
    return {"settings": s, "teacher_sweep": teacher_sweep, "sweep": sweep, "teachers": teachers, "runs": runs,
            "summary": summarize(s, teachers, runs), **runner.counts()}


def recovered(l_base: float, l_teacher: float, loss):
    """Percentage of the teacher's gain over the unigram baseline that a loss keeps (None where the loss
    or the teacher diverged, or the teacher gained nothing: a negative or zero gain has no share)."""
    if loss is None or l_teacher is None or not (math.isfinite(loss) and math.isfinite(l_teacher)):
        return None
    if not l_teacher < l_base:
        return None
    return 100.0 * (l_base - loss) / (l_base - l_teacher)


def _select(runs, fmap):
    return sorted((r for r in runs if r["map"] == fmap), key=lambda r: r["seed"])


def summarize(s: dict, teachers: list, runs: list) -> dict:
    # computed here rather than read from a teacher run, so a record made before the baseline was scored
    # on the models' own held-out tokens is corrected when it is summarised again
    base = unigram_loss(s["source"], s["context"], s["tokens_per_update"], s["val_tokens"])
    summ = {"unigram_val_loss": base, "teacher_val_loss": study.spread([t["final_val_loss"] for t in teachers]),
            "maps": {}}
    for m in s["maps"]:
        rs = _select(runs, m)
        row = {"attention_kl_per_layer": [study.spread(col) for col in zip(*[r["attention_kl"] for r in rs])],
               "attention_kl": study.spread([sum(r["attention_kl"]) / len(r["attention_kl"]) for r in rs])}
        for when in ("no_finetune", "finetuned"):
            losses = [r[f"val_loss_{when}"] for r in rs]
            row[f"val_loss_{when}"] = study.spread(losses)
            # per seed, against that seed's own teacher
            row[f"recovered_{when}"] = study.spread(
                [recovered(base, teachers[r["seed"]]["final_val_loss"], r[f"val_loss_{when}"]) for r in rs])
        summ["maps"][m] = row
    return summ


def table(record: dict) -> str:
    summ = record["summary"]
    lines = [f"teacher (softmax) held-out loss {summ['teacher_val_loss']['mean']:.3f}, unigram "
             f"{summ['unigram_val_loss']:.3f} nats/byte; recovered = (unigram - L) / (unigram - teacher)",
             f"{'map':<12}{'attn KL':>9}{'loss, no FT':>13}{'recovered':>11}{'loss, FT':>10}{'recovered':>11}"]
    lines.append("-" * len(lines[-1]))
    for m, row in summ["maps"].items():
        cells = [row["attention_kl"], row["val_loss_no_finetune"], row["recovered_no_finetune"],
                 row["val_loss_finetuned"], row["recovered_finetuned"]]
        fmt = ["{:9.3f}", "{:13.3f}", "{:10.1f}%", "{:10.3f}", "{:10.1f}%"]
        lines.append(f"{m:<12}" + "".join(f.format(c["mean"]) if c["mean"] is not None else f"{'-':>9}"
                                          for f, c in zip(fmt, cells)))
    lines.append(f"(mean over {record['settings']['seeds']} seeds; fine-tune lr per map: {record['sweep']['chosen']})")
    worst = summ["teacher_val_loss"]["max"]
    if worst is not None and not worst < summ["unigram_val_loss"]:
        lines.append("(a seed's teacher is no better than the unigram baseline: no share of its gain is defined, "
                     "so 'recovered' leaves that seed out ('-' if none is left); a --quick run trains it too briefly)")
    return "\n".join(lines)


def plot(record: dict, out) -> list:
    out = Path(out)
    s, summ = record["settings"], record["summary"]
    plt = study.pyplot()
    maps = list(summ["maps"])
    setting = (f"teacher: softmax GPT, {study.layers(s['n_layer'])}, width {s['n_embd']}, T={s['context']}, "
               f"{s['teacher_steps']} updates; fine-tune {s['finetune_steps']} updates")
    paths = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.3))
    x = np.arange(len(maps))
    for offset, when, label in ((-0.2, "no_finetune", "no fine-tuning"), (0.2, "finetuned", "after fine-tuning")):
        for ax, key in ((ax1, "recovered"), (ax2, "val_loss")):
            cells = [summ["maps"][m][f"{key}_{when}"] for m in maps]
            mean = [c["mean"] if c["mean"] is not None else np.nan for c in cells]
            err = [[m - c["min"] if c["mean"] is not None else 0 for m, c in zip(mean, cells)],
                   [c["max"] - m if c["mean"] is not None else 0 for m, c in zip(mean, cells)]]
            ax.bar(x + offset, mean, 0.4, yerr=err, capsize=3, label=label)
    ax1.axhline(100, color="k", lw=1, ls="--")
    ax1.axhline(0, color="grey", lw=1)
    ax2.axhline(summ["teacher_val_loss"]["mean"], color="k", lw=1, ls="--", label="teacher (softmax)")
    ax2.axhline(summ["unigram_val_loss"], color="grey", lw=1, ls=":", label="unigram (no context)")
    for ax in (ax1, ax2):
        ax.set_xticks(x, maps)
    study.style(ax1, "feature map", "quality recovered (%)",
                "(unigram - L) / (unigram - teacher); bars: mean, whiskers: min-max over seeds")
    study.style(ax2, "feature map", "held-out loss (nats/byte)", "held-out loss")
    fig.suptitle(f"softmax attention replaced by linear attention with each feature map\n{setting}", fontsize=9)
    paths.append(study.save(fig, out / f"{NAME}_recovered.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    for i, m in enumerate(m for m in maps if m != "softmax"):
        rs = _select(record["runs"], m)
        study.band(ax, range(1, s["n_layer"] + 1), [r["attention_kl"] for r in rs], label=m, color=f"C{i}",
                   marker="o")
    ax.set_yscale("log")
    ax.set_xticks(range(1, s["n_layer"] + 1))
    study.style(ax, "layer", "KL(softmax weights || linear weights), nats per row",
                f"attention-weight KL on held-out text (band: seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_kl.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    for i, m in enumerate(maps):
        rs = _select(record["runs"], m)
        study.band(ax, [e["step"] for e in rs[0]["finetune"]["evals"]],
                   [[e["val_loss"] for e in r["finetune"]["evals"]] for r in rs], label=m, color=f"C{i}", marker="o")
    ax.axhline(summ["teacher_val_loss"]["mean"], color="k", lw=1, ls="--", label="teacher")
    study.style(ax, "fine-tuning update", "held-out loss (nats/byte)", f"fine-tuning (band: seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_finetune.png"))

    for name, sweep, label in (("teacher_lr_sweep", record["teacher_sweep"], "teacher"),
                               ("lr_sweep", record["sweep"], "fine-tuning per map")):
        paths.append(study.plot_sweep(sweep, out / f"{NAME}_{name}.png", f"{label}\n{setting}",
                                      "held-out loss (nats/byte)"))
    return paths
