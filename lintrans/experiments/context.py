"""Study ``context`` ("Linear Transformers Are Faster After All", section 5): does linear attention's gap to softmax grow with context?

Byte-level GPTs, only their attention (and position encoding) swapped, are trained on the Python
standard library's source code (``code_corpus``: split by file, so held-out files are unseen code)
at contexts T spanning 16x, with the tokens per update fixed (batch = tokens_per_update / T) and the
same number of updates: at update s every run of a seed reads the same tokens_per_update + 1
consecutive training tokens (a seeded offset) cut into windows of T. Held-out loss is measured on the
first ``val_tokens`` of the held-out split cut the same way, every ``eval_every`` updates, in total
and by position in the window (buckets 1-16, 17-64, 65-256, ...): a model uses its context where its
loss keeps falling at late positions. Count-based unigram, bigram and trigram losses on the same
held-out windows (``ngram``) are in the record: a model counts as using context only once it beats
the trigram clearly.

Mechanisms are attention specs with a position encoding after ``@`` (``softmax@learned``: GPT-2's
table; ``softmax@rope``: rotary; ``gated-deltanet@none``: none, the recurrent mechanisms' choice, as
their state already orders the tokens). The learning rate is swept per mechanism at the
``sweep_contexts`` (seed 0; by default the shortest and the longest context); a context between two
swept ones trains at the rate interpolated log-linearly in log T between their choices.

Profiles: the default is the seed's three roles (softmax with rotary positions, linear elu, and
the gated remedy) x 3 contexts x 3 seeds plus the sweep, 1000 updates each: the fewest updates at
which softmax clearly beats the trigram (a probe at T = 256: 2.046 nats/byte with learned positions,
1.617 with rotary ones, against the trigram's 1.818), so the record is one of models that use their
context. More mechanisms join the same record with ``--mechanisms`` (finished runs are reused):
``softmax@learned``, ``linear:feature_map=based,qk_dim=16@none`` (Based with its paper's feature dim),
``deltanet@none``, ``gated-deltanet@none``.
``lintrans experiment context --estimate --jobs 2`` times a few steps of every model and prints
what the runs not yet in the record folder would cost; ``--quick`` is a machinery check and
``--setting gpu`` has larger models and longer contexts (record folder context-gpu).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from lintrans.models.gpt import GPT

from . import study
from .models import check_specs, gpt_config

NAME = "context"
VERSION = 2
LM_VERSION = 1  # run_spec / train_lm: the version-1 text-stream runs the distill study's teachers are keyed by
POSITIONS = ("learned", "rope", "none")
CORPORA = ("python-stdlib-code",)

DEFAULT = {
    "mechanisms": ["softmax@rope", "linear:elu@none", "gated-linear@none"],
    "contexts": [256, 1024, 4096],
    "sweep_contexts": [256, 4096],
    "lrs": [1e-3, 2e-3, 4e-3],
    "seeds": 3,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "tokens_per_update": 4096,
    "steps": 1000,
    "eval_every": 100,
    "val_tokens": 65536,
    "corpus": "python-stdlib-code",
}
QUICK = {
    "mechanisms": ["softmax@learned", "softmax@rope", "gated-deltanet@none"],
    "contexts": [16, 64],
    "sweep_contexts": [16, 64],
    "lrs": [1e-3, 3e-3, 1e-2],
    "seeds": 2,
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "tokens_per_update": 256,
    "steps": 20,
    "eval_every": 10,
    "val_tokens": 512,
}
PRESETS = {
    "gpu": {
        "contexts": [512, 2048, 8192],
        "sweep_contexts": [512, 8192],
        "lrs": [1e-3, 2e-3, 4e-3],
        "n_layer": 6,
        "n_head": 8,
        "n_embd": 256,
        "tokens_per_update": 16384,
        "steps": 3000,
        "eval_every": 300,
        "val_tokens": 262144,
    },
}


def split_mechanism(mechanism: str) -> tuple[str, str]:
    """``SPEC@POSITION`` -> (attention spec, position encoding); no ``@``: GPT-2's learned positions."""
    if not isinstance(mechanism, str):
        raise TypeError(f"a mechanism must be a string such as 'softmax@rope', got {mechanism!r}")
    spec, at, position = mechanism.partition("@")
    if not at:
        position = "learned"
    if position not in POSITIONS:
        raise ValueError(f"mechanism {mechanism!r}: the position encoding after '@' must be one of {list(POSITIONS)}, "
                         f"got {position!r}")
    return spec, position


HELP = study.help_texts(DEFAULT, {
    "mechanisms": "models compared, each ATTENTION[:KEY=VALUE,...]@POSITION with POSITION learned, rope or none, "
                  "e.g. softmax@rope gated-deltanet:conv_size=0@none",
    "contexts": "context lengths T trained and compared (tokens per update stay the same at each)",
    "sweep_contexts": "contexts where the rate is swept (seed 0); the others take the chosen rate interpolated "
                      "in log T",
    "lrs": "peak learning rates swept per mechanism",
    "tokens_per_update": "tokens per optimizer step at every context (sequences per step = this / T)",
    "val_tokens": "held-out tokens evaluated, cut into windows of T",
    "corpus": "the text: python-stdlib-code (the running Python's standard library sources, split by file)",
})
LIMITS = dict.fromkeys(("n_layer", "n_head", "n_embd", "tokens_per_update", "steps", "eval_every", "val_tokens",
                        "seeds"), study.POSITIVE)


def validate(s: dict) -> None:
    study.check_settings(s, DEFAULT, LIMITS)
    study.check_ints("contexts", s["contexts"])
    study.check_ints("sweep_contexts", s["sweep_contexts"])
    study.check_lrs(s["lrs"])
    for T in s["contexts"]:
        if s["tokens_per_update"] % T or s["val_tokens"] % T:
            raise ValueError(f"tokens_per_update ({s['tokens_per_update']}) and val_tokens ({s['val_tokens']}) "
                             f"must be multiples of every context, got {T}")
    if not set(s["sweep_contexts"]) <= set(s["contexts"]) or s["sweep_contexts"][0] != s["contexts"][0] \
            or s["sweep_contexts"][-1] != s["contexts"][-1]:
        raise ValueError(f"sweep_contexts ({s['sweep_contexts']}) must be contexts from {s['contexts']} including "
                         "the shortest and the longest")
    if s["corpus"] not in CORPORA:
        raise ValueError(f"corpus must be one of {list(CORPORA)}, got {s['corpus']!r}")
    if not isinstance(s["mechanisms"], list) or len(set(s["mechanisms"])) != len(s["mechanisms"]):
        raise ValueError(f"mechanisms must be a list of distinct SPEC@POSITION strings, got {s['mechanisms']!r}")
    for m in s["mechanisms"]:
        spec, position = split_mechanism(m)
        try:
            check_specs([spec], n_layer=1, n_head=s["n_head"], n_embd=s["n_embd"], block_size=max(s["contexts"]),
                        vocab_size=257, pos_embedding=position)
            GPT(gpt_config(spec, n_layer=1, n_head=s["n_head"], n_embd=s["n_embd"], block_size=8, vocab_size=8,
                           pos_embedding=position))
        except ValueError as e:
            raise ValueError(f"mechanism {m!r}: {e}") from None


def position_buckets(T: int) -> list[tuple[int, int]]:
    """1-based inclusive position ranges: 1-16, 17-64, 65-256, ... (x4), the last ending at T."""
    study.check_int("T", T)
    buckets, lo, hi = [], 1, 16
    while lo <= T:
        buckets.append((lo, min(hi, T)))
        lo, hi = hi + 1, hi * 4
    return buckets


def bucket_means(token_losses: torch.Tensor, T: int) -> list[float]:
    """Mean of per-token losses [B, T] over each position bucket of ``position_buckets(T)``."""
    return [float(token_losses[:, lo - 1:hi].mean()) for lo, hi in position_buckets(T)]


def token_losses(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [B, T] (nats) of the model's predictions of y from x."""
    logits, _ = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def study_spec(s: dict, mechanism: str, context: int, lr: float, seed: int, corpus_sha256: str) -> dict:
    keys = ("n_layer", "n_head", "n_embd", "tokens_per_update", "steps", "eval_every", "val_tokens", "corpus")
    return {"study": NAME, "version": VERSION, "attention": mechanism, "context": context, "lr": lr, "seed": seed,
            "corpus_sha256": corpus_sha256, **{k: s[k] for k in keys}}


class TokenStream:
    """Training batches and held-out windows of a corpus's train / val splits for one run.

    Update s reads tokens_per_update + 1 consecutive training tokens from a seeded offset, cut into
    windows of T: every mechanism and context of one seed sees the same tokens in the same order.
    Held-out: the first ``val_tokens`` of the validation split, cut the same way.
    """

    def __init__(self, splits, T: int, tokens_per_update: int, steps: int, seed: int, val_tokens: int,
                 device="cpu"):
        self.splits = splits
        self.T, self.tpu, self.device = T, tokens_per_update, device
        check_sizes(splits, tokens_per_update, val_tokens)
        rng = np.random.Generator(np.random.PCG64(seed))
        self.starts = rng.integers(0, len(splits.train) - tokens_per_update - 1, size=steps)
        self.val = [_windows(splits.val, i, min(tokens_per_update, val_tokens - i), T, device)
                    for i in range(0, val_tokens, tokens_per_update)]

    def batch(self, step: int):
        return _windows(self.splits.train, int(self.starts[step]), self.tpu, self.T, self.device)


class CodeStream(TokenStream):
    """Training batches and held-out windows of the code corpus for one run (see the module docstring)."""

    def __init__(self, T: int, tokens_per_update: int, steps: int, seed: int, val_tokens: int, device="cpu",
                 corpus=None):
        from .code_corpus import load

        self.corpus = load() if corpus is None else corpus
        super().__init__(self.corpus, T, tokens_per_update, steps, seed, val_tokens, device)

    def evaluate(self, model: GPT) -> dict:
        """Held-out loss in total and by position bucket (nats per byte)."""
        with torch.no_grad():
            losses = torch.cat([token_losses(model, x, y) for x, y in self.val])  # [windows, T]
        return {"val_loss": float(losses.mean()), "by_position": bucket_means(losses, self.T)}


def run(spec: dict, env: study.RunEnv) -> dict:
    """One run of the study: train, evaluate by position, count spikes."""
    from .code_corpus import load

    corpus = load()
    if corpus.info["sha256"] != spec["corpus_sha256"]:
        raise ValueError(f"this interpreter's corpus (sha256 {corpus.info['sha256'][:12]}, Python "
                         f"{corpus.info['python']}) is not the one the study was started with "
                         f"({spec['corpus_sha256'][:12]})")
    T = spec["context"]
    stream = CodeStream(T, spec["tokens_per_update"], spec["steps"], spec["seed"], spec["val_tokens"], env.device,
                        corpus)
    attention, position = split_mechanism(spec["attention"])
    config = gpt_config(attention, n_layer=spec["n_layer"], n_head=spec["n_head"], n_embd=spec["n_embd"],
                        block_size=T, vocab_size=corpus.vocab_size, pos_embedding=position)
    torch.manual_seed(spec["seed"])
    model = GPT(config).to(env.device)
    out = study.train(model, lr=spec["lr"], steps=spec["steps"],
                      loss_at=lambda step: model(*stream.batch(step), return_logits=False)[1],
                      evaluate=lambda: stream.evaluate(model), eval_every=spec["eval_every"], env=env)
    out["params"] = study.param_count(model)
    out["spikes"] = study.loss_spikes(out["train_loss"])
    final = out["evals"][-1] if not out["diverged"] else None
    out["final_val_loss"] = final["val_loss"] if final else None
    out["final_by_position"] = final["by_position"] if final else None
    return out


# --- the version-1 text stream (the embedded prose corpus), kept for the distill study's teachers ---


def run_spec(s: dict, mechanism: str, context: int, lr: float, seed: int) -> dict:
    keys = ("n_layer", "n_head", "n_embd", "tokens_per_update", "steps", "eval_every", "val_tokens", "source")
    return {"study": NAME, "version": LM_VERSION, "attention": mechanism, "context": context, "lr": lr, "seed": seed,
            **{k: s[k] for k in keys}}


def check_sizes(splits, tokens_per_update: int, val_tokens: int) -> None:
    """ValueError naming the setting a source's splits cannot serve (numpy's "high <= 0" or an IndexError
    deep in a run otherwise)."""
    if val_tokens + 1 > len(splits.val):
        raise ValueError(f"val_tokens ({val_tokens}) exceeds the held-out split ({len(splits.val)} tokens)")
    if tokens_per_update + 2 > len(splits.train):
        raise ValueError(f"tokens_per_update ({tokens_per_update}) exceeds the training split "
                         f"({len(splits.train)} tokens)")


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


class TextStream(TokenStream):
    """A ``TokenStream`` of a text source's bytes (the studies' version-1 corpus, distill's teachers)."""

    def __init__(self, source: str, T: int, tokens_per_update: int, steps: int, seed: int, val_tokens: int,
                 device="cpu"):
        super().__init__(token_data(source), T, tokens_per_update, steps, seed, val_tokens, device)

    def val_loss(self, model: GPT) -> float:
        with torch.no_grad():
            total = sum(model(x, y, return_logits=False)[1].item() * x.numel() for x, y in self.val)
        return total / sum(x.numel() for x, _ in self.val)


def train_lm(spec: dict, env: study.RunEnv):
    """Train the GPT of a run spec on the text stream: (model, result)."""
    T = spec["context"]
    stream = TextStream(spec["source"], T, spec["tokens_per_update"], spec["steps"], spec["seed"],
                        spec["val_tokens"], env.device)
    config = gpt_config(spec["attention"], n_layer=spec["n_layer"], n_head=spec["n_head"], n_embd=spec["n_embd"],
                        block_size=T, vocab_size=stream.splits.vocab_size)
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


def interpolated_lr(chosen: dict, T: int) -> float:
    """The rate for context T from the rates ``chosen`` ({swept T: lr}): the swept one at a swept T,
    else log-linear in log T between the nearest swept contexts on either side."""
    if T in chosen:
        return chosen[T]
    swept = sorted(chosen)
    lo = max(t for t in swept if t < T)
    hi = min(t for t in swept if t > T)
    w = (math.log(T) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return float(f"{math.exp((1 - w) * math.log(chosen[lo]) + w * math.log(chosen[hi])):.3g}")


@functools.lru_cache(maxsize=8)
def _baselines_for(contexts: tuple, val_tokens: int) -> dict:
    from .code_corpus import load
    from .ngram import baselines, windows_of

    corpus = load()
    windows = {T: windows_of(corpus.val, val_tokens, T) for T in contexts}
    return baselines(corpus.train, windows, corpus.vocab_size, {T: position_buckets(T) for T in contexts})


def _baselines(s: dict, out, sha: str) -> dict:
    """The n-gram baselines on the study's held-out windows, kept in the run store beside the runs
    (keyed like a run, as KEY.ngram), so a resumed study does not count them again."""
    import json

    from lintrans._io import atomic_write_text

    from . import ngram

    key = {"study": NAME, "version": VERSION, "baselines": "ngram", "contexts": s["contexts"],
           "val_tokens": s["val_tokens"], "corpus_sha256": sha,
           # from version 2 on only, so the baselines cached before the field keep their key
           **({"ngram_version": ngram.VERSION} if ngram.VERSION > 1 else {})}
    path = study.RunStore(out).path(key, ".ngram")  # JSON; not *.json, which are the runs
    if path.is_file():
        return json.loads(path.read_text())
    result = _baselines_for(tuple(s["contexts"]), s["val_tokens"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result))
    return result


def run_study(s: dict, out, *, jobs: int = 1, progress: bool = True, device: str = "cpu",
              max_runs: Optional[int] = None) -> dict:
    from .code_corpus import load

    corpus = load()
    sha = corpus.info["sha256"]
    runner = study.Runner(f"{__name__}:run", out, jobs=jobs, progress=progress, desc=NAME, device=device,
                          max_runs=max_runs)
    load_before = os.getloadavg()
    mechs = s["mechanisms"]

    def spec_for(m, T, lr, seed):
        return study_spec(s, m, T, lr, seed, sha)

    # phase 1: the sweep at every sweep context, in one batch so that --jobs N runs it in parallel
    runner.run([spec_for(m, T, lr, 0) for T in s["sweep_contexts"] for m in mechs for lr in s["lrs"]])
    sweeps = [{"context": T, **study.lr_sweep(runner, {m: [spec_for(m, T, lr, 0) for lr in s["lrs"]] for m in mechs},
                                              _final)} for T in s["sweep_contexts"]]
    rates = {m: {T: interpolated_lr({sw["context"]: sw["chosen"][m] for sw in sweeps}, T) for T in s["contexts"]}
             for m in mechs}
    # phase 2: every seed at every context at its rate (a swept context's seed-0 run is the sweep's own)
    grid = [(m, T, seed) for m in mechs for T in s["contexts"] for seed in range(s["seeds"])]
    specs = [spec_for(m, T, rates[m][T], seed) for m, T, seed in grid]
    runs = [{"attention": m, "context": T, "seed": seed, "lr": spec["lr"], "key": study.run_key(spec), **result}
            for (m, T, seed), spec, result in zip(grid, specs, runner.run(specs))]
    baselines = _baselines(s, out, sha)
    # a rate chosen at the grid's edge may not be the best: the grid should then be widened
    edge = {str(sw["context"]): [m for m in mechs if sw["chosen"][m] in (min(s["lrs"]), max(s["lrs"]))]
            for sw in sweeps}
    return {"settings": s, "corpus": corpus.info, "baselines": baselines, "sweep": sweeps, "lr_at_grid_edge": edge,
            "lr": {m: {str(T): lr for T, lr in r.items()} for m, r in rates.items()}, "runs": runs,
            "summary": summarize(s, runs, baselines),
            "load_average": {"start": list(load_before), "end": list(os.getloadavg())}, **runner.counts()}


# --- summary ----------------------------------------------------------------------------------


def _select(runs, mech, T):
    return sorted((r for r in runs if r["attention"] == mech and r["context"] == T), key=lambda r: r["seed"])


def _loss_at_time(run: dict, t: float):
    """Held-out loss of the last evaluation at or before t training seconds (the final one if the run
    finished sooner: a run that stops early keeps its final loss); None without a time (every run
    it would be compared with diverged)."""
    if t is None:
        return None
    before = [e for e in run["evals"] if e["seconds"] <= t]
    return before[-1]["val_loss"] if before else None


def _overlap(a: dict, b: dict):
    if a["mean"] is None or b["mean"] is None:
        return None
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def summarize(s: dict, runs: list, baselines: dict) -> dict:
    mechs, contexts = s["mechanisms"], s["contexts"]
    reference = mechs[0]
    trigram = baselines["loss"]["trigram"]
    final, per_seed, gap, overlap, vs_trigram, by_pos, spikes = ({} for _ in range(7))
    for m in mechs:
        for d in (final, per_seed, gap, overlap, vs_trigram, by_pos, spikes):
            d[m] = {}
        for T in contexts:
            rs, base = _select(runs, m, T), _select(runs, reference, T)
            k = str(T)
            values = [r["final_val_loss"] for r in rs]
            final[m][k], per_seed[m][k] = study.spread(values), values
            pairs = [(a["final_val_loss"], b["final_val_loss"]) for a, b in zip(rs, base)]  # paired by seed
            gap[m][k] = study.spread([a - b if a is not None and b is not None else None for a, b in pairs])
            overlap[m][k] = _overlap(final[m][k], study.spread([b["final_val_loss"] for b in base]))
            vs_trigram[m][k] = study.spread([v - trigram[k] if v is not None else None for v in values])
            curves = [r["final_by_position"] for r in rs if r["final_by_position"] is not None]
            by_pos[m][k] = study.spread_curves(curves) if curves else None
            spikes[m][k] = {"count": study.spread([len(r["spikes"]) for r in rs]),
                            "per_seed": [[(p["step"], round(p["size"], 3)) for p in r["spikes"]] for r in rs]}
    longest = max(contexts)
    # a diverged run stopped early: neither its seconds nor its last loss count as a finish
    at_long = {m: [r for r in _select(runs, m, longest) if not r.get("diverged")] for m in mechs}
    finish = {m: study.spread([r["train_seconds"] for r in rs]) for m, rs in at_long.items()}
    t_ref = finish[reference]["mean"]
    t_fast = min((f["mean"] for f in finish.values() if f["mean"] is not None), default=None)
    same_time = {m: {"finish_seconds": finish[m],
                     f"val_loss_at_{reference}_finish": study.spread([_loss_at_time(r, t_ref) for r in rs]),
                     "val_loss_at_fastest_finish": study.spread([_loss_at_time(r, t_fast) for r in rs])}
                 for m, rs in at_long.items()}
    return {
        "reference": reference,
        "final_val_loss": final,
        "final_val_loss_per_seed": per_seed,
        f"gap_to_{reference}": gap,
        f"band_overlaps_{reference}": overlap,
        "minus_trigram": vs_trigram,
        "by_position": by_pos,
        "position_buckets": {str(T): position_buckets(T) for T in contexts},
        "spikes": spikes,
        "longest_context": longest,
        "same_time": {"reference_finish_seconds": t_ref, "fastest_finish_seconds": t_fast, "mechanisms": same_time},
    }


# --- cost estimate ------------------------------------------------------------------------------


def plan(s: dict, out, corpus_sha256: str) -> list:
    """Every run the study trains, as (mechanism, T, finished): finished when its result is in
    ``out``/runs. A seed's run at a context whose rate depends on a sweep not yet finished counts as
    not finished (its rate, and so its key, is not known yet)."""
    store = study.RunStore(out)
    runs = []
    for m in s["mechanisms"]:
        chosen = {}
        for T in s["sweep_contexts"]:
            results = [store.get(study_spec(s, m, T, lr, 0, corpus_sha256)) for lr in s["lrs"]]
            runs += [(m, T, r is not None) for r in results]
            if all(r is not None for r in results):
                lr = study.best_lr([study.sweep_row(lr, _final(r)) for lr, r in zip(s["lrs"], results)])
                if lr is not None:
                    chosen[T] = lr
        known = len(chosen) == len(s["sweep_contexts"])
        for T in s["contexts"]:
            for seed in range(T in s["sweep_contexts"], s["seeds"]):  # a swept context's seed 0 is the sweep's
                spec = study_spec(s, m, T, interpolated_lr(chosen, T), seed, corpus_sha256) if known else None
                runs.append((m, T, known and store.get(spec) is not None))
    return runs


def estimate(s: dict, jobs: int = 1, device: str = "cpu", steps: int = 2, report=print, out=None) -> dict:
    """Seconds the study would take: a few timed training steps and one held-out chunk of every
    mechanism at every context (with the torch threads each of ``jobs`` workers gets), times the
    steps and evaluations of its runs, summed, divided by ``jobs``; with ``out``, only the runs not
    yet finished there. On the CPU two figures: from wall-clock time (this machine as loaded now)
    and from process CPU time divided by the threads (what an otherwise idle machine would take, if
    the threads scale)."""
    import time

    from .code_corpus import load

    todo: dict = {}
    planned = plan(s, out, load().info["sha256"]) if out is not None else None
    for m, T, finished in planned or ():
        todo[(m, T)] = todo.get((m, T), 0) + (not finished)
    threads = study.run_threads(jobs)  # as the runs will have them
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    n_evals = len(range(0, s["steps"], s["eval_every"])) + 1
    totals, rows = {"wall": 0.0, "cpu": 0.0}, {}

    from lintrans.bench.machine import synchronize

    on_cpu = str(device).startswith("cpu")  # else the host's CPU time says nothing of the device's

    def timed(fn):  # an accelerator's queue is drained on both sides, or only the launches are timed
        synchronize(device)
        w, c = time.perf_counter(), time.process_time()
        fn()
        synchronize(device)
        return time.perf_counter() - w, (time.process_time() - c) / threads

    try:
        for m in s["mechanisms"]:
            spec, position = split_mechanism(m)
            for T in s["contexts"]:
                swept = T in s["sweep_contexts"]
                n_runs = todo[(m, T)] if planned is not None else s["seeds"] - swept + len(s["lrs"]) * swept
                if n_runs == 0:
                    continue
                config = gpt_config(spec, n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                                    block_size=T, vocab_size=257, pos_embedding=position)
                model = GPT(config).to(device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                x = torch.randint(0, 257, (s["tokens_per_update"] // T, T), device=device)

                def step():
                    _, loss = model(x, x, return_logits=False)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()

                def evaluate():
                    with torch.no_grad():
                        token_losses(model, x, x)

                times = [timed(step) for _ in range(steps + 1)][1:]  # the first is a warm-up
                t_step = {k: min(t[i] for t in times) for i, k in enumerate(("wall", "cpu"))}
                t_eval = dict(zip(("wall", "cpu"), (v * s["val_tokens"] / s["tokens_per_update"]
                                                    for v in timed(evaluate))))
                per_run = {k: s["steps"] * t_step[k] + n_evals * t_eval[k] for k in totals}
                for k in totals:
                    totals[k] += n_runs * per_run[k]
                rows[f"{m} T={T}"] = {"update_seconds": t_step, "runs": n_runs, "run_seconds": per_run}
                cost = (f"{t_step['cpu']:6.3f} s/update (cpu; wall {t_step['wall']:6.3f})" if on_cpu
                        else f"{t_step['wall']:6.3f} s/update (wall)")
                report(f"{m:>22} T={T:<6} {cost}, {n_runs} run{'s' * (n_runs != 1)} x "
                       f"{per_run['cpu' if on_cpu else 'wall'] / 60:5.1f} min")
    finally:
        torch.set_num_threads(before)
    est = {"seconds": {k: v / jobs for k, v in totals.items()}, "jobs": jobs, "threads_per_job": threads,
           "rows": rows, "load_average": list(os.getloadavg())}
    if planned is not None:
        est["runs"] = {"planned": len(planned), "finished": sum(f for _, _, f in planned)}
        report(f"{est['runs']['finished']} of {est['runs']['planned']} runs already in {out}; the rest:")
    if on_cpu:
        report(f"estimate with --jobs {jobs} ({threads} torch thread(s) each): {est['seconds']['cpu'] / 3600:.2f} h "
               f"from CPU time (an idle machine), {est['seconds']['wall'] / 3600:.2f} h from wall-clock time "
               f"(this machine now, load average {est['load_average'][0]:.1f})")
    else:
        report(f"estimate with --jobs {jobs} on {device}: {est['seconds']['wall'] / 3600:.2f} h from wall-clock time")
    return est


# --- report -----------------------------------------------------------------------------------


def table(record: dict) -> str:
    s, summ = record["settings"], record["summary"]
    ref = summ["reference"]
    tri = record["baselines"]["loss"]["trigram"]
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
    for name in ("trigram", "bigram", "unigram"):
        lines.append(f"{name + ' (counts)':<{w}}" + "".join(
            f"{record['baselines']['loss'][name][str(T)]:>22.3f}" for T in s["contexts"]))
    lines.append(f"(in brackets: gap to {ref}, mean over seeds; a model uses its context only once it beats the "
                 f"trigram ({', '.join(f'{v:.3f}' for v in tri.values())}) clearly; lr per mechanism and context: "
                 f"{record['lr']})")
    edge = {T: ms for T, ms in record.get("lr_at_grid_edge", {}).items() if ms}
    if edge:
        lines.append(f"learning rate chosen at the edge of the grid {s['lrs']} (widen it): {edge}")
    return "\n".join(lines)


def plot(record: dict, out) -> list:
    from pathlib import Path

    out = Path(out)
    s, summ, base = record["settings"], record["summary"], record["baselines"]
    plt = study.pyplot()
    mechs, contexts = s["mechanisms"], s["contexts"]
    info = record["corpus"]
    setting = (f"{study.layers(s['n_layer'])}, width {s['n_embd']}, {s['tokens_per_update']} tokens/update, "
               f"{s['steps']} updates,\nbytes of the Python {info['python']} stdlib source "
               f"(held-out files, {s['val_tokens']} bytes)")
    colors = {m: f"C{i}" for i, m in enumerate(mechs)}
    runs = record["runs"]
    paths = []

    def ngram_lines(ax, xs, key=None):
        for name, style in (("trigram", "--"), ("bigram", ":"), ("unigram", "-.")):
            ys = [base["loss"][name][str(T)] for T in xs] if key is None else key(name)
            if ys is not None:
                ax.plot(xs, ys, style, color="gray", lw=1, label=f"{name} (counts)")

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for m in mechs:
        curves = [[r["final_val_loss"] for r in _select(runs, m, T)] for T in contexts]  # [T][seed]
        study.band(ax, contexts, [list(c) for c in zip(*curves)], label=m, color=colors[m], marker="o")
    ngram_lines(ax, contexts)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(T) for T in contexts])
    _clip(ax, runs, base, top_name="bigram")
    study.style(ax, "context length T (tokens per update fixed)", "final held-out loss (nats/byte)",
                f"final held-out loss against context, mean and min-max over {s['seeds']} seeds\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_final.png"))

    fig, axes = study.panels([f"T={T}" for T in contexts], sharey=True, size=(4.2, 3.4))
    for ax, T in zip(axes, contexts):
        buckets = position_buckets(T)
        xs = [hi for _, hi in buckets]
        for m in mechs:
            curves = [r["final_by_position"] for r in _select(runs, m, T) if r["final_by_position"] is not None]
            if curves:
                study.band(ax, xs, curves, label=m, color=colors[m], marker="o")
        ax.plot(xs, base["by_position"]["trigram"][str(T)], "--", color="gray", lw=1, label="trigram (counts)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{lo}-{hi}" for lo, hi in buckets], fontsize=6)
    study.finish_panels(fig, axes, "position in the window (bucket)", "held-out loss (nats/byte)",
                        f"held-out loss by position: falling at late positions = context used (band: seeds)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_position.png"))

    shade = {T: plt.cm.viridis(i / max(1, len(contexts) - 1)) for i, T in enumerate(contexts)}
    fig, axes = study.panels(mechs, sharey=True)
    for ax, m in zip(axes, mechs):
        for T in contexts:
            rs = _select(runs, m, T)
            tokens = [e["step"] * s["tokens_per_update"] / 1e6 for e in rs[0]["evals"]]
            study.band(ax, tokens, [[e["val_loss"] for e in r["evals"]] for r in rs], label=f"T={T}", color=shade[T])
        ax.axhline(base["loss"]["trigram"][str(max(contexts))], ls="--", color="gray", lw=1)
    _clip(axes[0], runs, base)
    study.finish_panels(fig, axes, "training tokens (millions)", "held-out loss",
                        f"held-out loss during training (band: seeds; dashed: trigram)\n{setting}")
    paths.append(study.save(fig, out / f"{NAME}_curves.png"))

    T = summ["longest_context"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    cpus = set()  # seeds trained on different CPUs (sessions get different machines) are averaged: name them all
    for m in mechs:
        rs = _select(runs, m, T)
        cpus.update((r.get("machine") or {}).get("cpu", "?") for r in rs)
        n = min(len(r["evals"]) for r in rs)
        secs = [sum(r["evals"][i]["seconds"] for r in rs) / len(rs) for i in range(n)]
        study.band(ax, secs, [[e["val_loss"] for e in r["evals"]] for r in rs], label=m, color=colors[m])
    ax.axhline(base["loss"]["trigram"][str(T)], ls="--", color="gray", lw=1, label="trigram (counts)")
    _clip(ax, runs, base)
    threads = runs[0].get("threads") if runs else None
    study.style(ax, f"training seconds (mean over seeds; {threads} torch thread(s) per run)",
                "held-out loss (nats/byte)",
                f"T={T}: held-out loss against wall-clock training time\n{setting}\nCPUs: {', '.join(sorted(cpus))}")
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

    paths.append(study.plot_sweep(record["sweep"], out / f"{NAME}_lr_sweep.png", setting, "final held-out loss",
                                  panel_title=lambda sw: f"T={sw['context']}"))
    return paths


def _clip(ax, runs, base, top_name: str = "unigram") -> None:
    """Keep the first evaluations (about ln 257) from squashing the rest of the curves."""
    finals = [r["final_val_loss"] for r in runs if r["final_val_loss"] is not None]
    tops = finals + list(base["loss"][top_name].values())
    if tops:
        ax.set_ylim(top=max(tops) + 0.3)
