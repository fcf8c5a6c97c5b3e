"""Count-based n-gram baselines: what a model must beat before it can be said to use its context.

Interpolated (Dirichlet-prior) smoothing, each order backing off to the one below:

    p0(w)        = 1 / V
    p1(w)        = (c(w)     + a1 p0(w))   / (N     + a1)          unigram
    p2(w | b)    = (c(b w)   + a2 p1(w))   / (c(b)  + a2)          bigram
    p3(w | a b)  = (c(a b w) + a3 p2(w|b)) / (c(a b) + a3)         trigram

where c(b) and c(a b) count the contexts followed by some token. Held-out tokens are scored in the
windows the models see: the first target of a window has one token of context, so there the trigram
is the bigram. Losses are mean -ln p, in nats per token (per byte for a byte-level corpus).
"""
from __future__ import annotations

import numpy as np

# bump when what the baselines compute changes: studies cache them on disk under a key holding it
VERSION = 1
ORDERS = {"unigram": 1, "bigram": 2, "trigram": 3}
ALPHA_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)


class NGram:
    """Counts of 1-, 2- and 3-grams of ``tokens`` (ids below ``vocab_size``) with smoothing ``alphas``
    (a1, a2, a3)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, alphas=(1.0, 1.0, 1.0)):
        t = np.asarray(tokens, dtype=np.int64)
        V = self.V = int(vocab_size)
        if t.ndim != 1 or t.size < 3:
            raise ValueError(f"tokens must be a 1-D array of at least 3 ids, got shape {t.shape}")
        if t.min() < 0 or t.max() >= V:
            raise ValueError(f"token ids must be in [0, {V - 1}], got {t.min()}..{t.max()}")
        if len(alphas) != 3 or not all(a > 0 for a in alphas):
            raise ValueError(f"alphas must be three positive numbers, got {alphas!r}")
        self.alphas = tuple(float(a) for a in alphas)
        self.c1 = np.bincount(t, minlength=V).astype(np.float64)
        self.c2 = np.bincount(t[:-1] * V + t[1:], minlength=V * V).reshape(V, V).astype(np.float64)
        self.c2_ctx = self.c2.sum(1)
        self.c3 = np.bincount((t[:-2] * V + t[1:-1]) * V + t[2:], minlength=V ** 3).astype(np.float32)
        self.c3_ctx = self.c3.reshape(V * V, V).sum(1, dtype=np.float64)

    def p1(self, w):
        a1 = self.alphas[0]
        return (self.c1[w] + a1 / self.V) / (self.c1.sum() + a1)

    def p2(self, b, w):
        a2 = self.alphas[1]
        return (self.c2[b, w] + a2 * self.p1(w)) / (self.c2_ctx[b] + a2)

    def p3(self, a, b, w):
        a3 = self.alphas[2]
        ctx = a * self.V + b
        return (self.c3[ctx * self.V + w].astype(np.float64) + a3 * self.p2(b, w)) / (self.c3_ctx[ctx] + a3)

    def token_losses(self, windows: np.ndarray, order: int) -> np.ndarray:
        """-ln p of every target of ``windows`` [B, T + 1] (inputs w[:, :-1], targets w[:, 1:]):
        [B, T], the context cut at the window's start as a model's is."""
        w = np.asarray(windows, dtype=np.int64)
        if w.ndim != 2 or w.shape[1] < 2:
            raise ValueError(f"windows must be [B, T + 1] with T >= 1, got shape {w.shape}")
        y = w[:, 1:]
        if order == 1:
            p = self.p1(y)
        elif order == 2:
            p = self.p2(w[:, :-1], y)
        elif order == 3:
            p = np.empty(y.shape)
            p[:, 0] = self.p2(w[:, 0], y[:, 0])
            p[:, 1:] = self.p3(w[:, :-2], w[:, 1:-1], y[:, 1:])
        else:
            raise ValueError(f"order must be 1, 2 or 3, got {order!r}")
        return -np.log(p)


def windows_of(tokens: np.ndarray, n_tokens: int, T: int) -> np.ndarray:
    """The first ``n_tokens`` targets of ``tokens`` cut into windows of T: [n_tokens / T, T + 1]
    (n_tokens + 1 consecutive tokens; window i holds tokens i*T .. i*T + T)."""
    if n_tokens % T or n_tokens + 1 > len(tokens):
        raise ValueError(f"n_tokens ({n_tokens}) must be a multiple of T ({T}) and below the "
                         f"{len(tokens)} tokens given")
    idx = np.arange(n_tokens // T)[:, None] * T + np.arange(T + 1)[None, :]
    return np.asarray(tokens[: n_tokens + 1], dtype=np.int64)[idx]


def choose_alphas(train: np.ndarray, vocab_size: int, dev_fraction: float = 0.1, grid=ALPHA_GRID) -> tuple:
    """Smoothing per order, chosen order by order on the last ``dev_fraction`` of the training tokens
    with the counts of the rest (the held-out tokens are never looked at)."""
    cut = int(len(train) * (1 - dev_fraction))
    fit, dev = train[:cut], np.asarray(train[cut:], dtype=np.int64)
    dev = dev[None, :]  # one window: the dev tokens in order
    alphas = [1.0, 1.0, 1.0]
    model = NGram(fit, vocab_size, alphas)
    for order in (1, 2, 3):
        best = None
        for a in grid:
            alphas[order - 1] = a
            model.alphas = tuple(alphas)
            loss = float(model.token_losses(dev, order).mean())
            if best is None or loss < best[0]:
                best = (loss, a)
        alphas[order - 1] = best[1]
    return tuple(alphas)


def baselines(train: np.ndarray, val_windows: dict, vocab_size: int, buckets: dict | None = None) -> dict:
    """Held-out loss of each n-gram order on ``val_windows`` ({T: [B, T + 1]}), fit on ``train``
    with smoothing chosen on a slice of it: {"alphas", "loss": {name: {T: nats}},
    "by_position": {name: {T: [bucket means]}}} (by_position only with ``buckets`` {T: [(lo, hi)]},
    1-based inclusive positions)."""
    alphas = choose_alphas(train, vocab_size)
    model = NGram(train, vocab_size, alphas)
    loss: dict = {name: {} for name in ORDERS}
    by_pos: dict = {name: {} for name in ORDERS}
    for T, w in val_windows.items():
        for name, order in ORDERS.items():
            tl = model.token_losses(w, order)
            loss[name][str(T)] = float(tl.mean())
            if buckets is not None:
                by_pos[name][str(T)] = [float(tl[:, lo - 1:hi].mean()) for lo, hi in buckets[T]]
    out = {"alphas": dict(zip(ORDERS, alphas)), "loss": loss,
           "smoothing": "interpolated, Dirichlet prior on the order below; alphas chosen on the last 10% of train"}
    if buckets is not None:
        out["by_position"] = by_pos
    return out
