"""Attention op benchmark: forward + backward of every linear form, softmax (SDPA) and the other
mechanisms and peers that import here, against T, side by side in one run."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .measure import Caps, Point, Series, sweep_side_by_side


class PerT:
    """An op whose settings depend on T: ``make(T)`` returns fn(q, k, v) -> o."""

    def __init__(self, make: Callable[[int], Callable]):
        self.make = make


def op_series(chunk_size, feature_map: str = "elu", gated_chunk=None, device: str = "cpu") -> dict[str, Callable]:
    """name -> fn(q, k, v) -> o on [B, T, H, D], or a maker T -> such a fn (for a per-T chunk size).

    ``chunk_size``: an int or a function T -> int; ``gated_chunk``: the same for the gated series
    (default: ``chunk_size``).
    """
    gated_chunk = chunk_size if gated_chunk is None else gated_chunk
    from lintrans.ops import FORMS, linear_attention, softmax_attention

    series: dict[str, Callable] = {"softmax (SDPA)": lambda q, k, v: softmax_attention(q, k, v)}
    for form in FORMS:
        def make(T, form=form):
            # the chunk is resolved (and tuned, if it must be) here, outside the timed step
            c = chunk_size(T) if callable(chunk_size) else chunk_size
            return lambda q, k, v: linear_attention(q, k, v, form=form, feature_map=feature_map, chunk_size=c)[0]

        series[f"linear {form}"] = PerT(make)
        if form == "chunked":
            series[GATED_OP] = PerT(lambda T: _gated(gated_chunk(T) if callable(gated_chunk) else gated_chunk, feature_map))
    series.update(delta_ops())
    series.update(_other_ops())
    from .peers import peer_ops

    series.update(peer_ops(feature_map, device))
    return series


GATED_OP = "linear chunked gated"


_GATE_LOGITS: dict = {}


def gate_logits(q: torch.Tensor) -> torch.Tensor:
    """Two logits per token and head, [2, B, T, H], for q's shape: leaf tensors that take gradients
    when q does, as a layer's gate projections give them, made once per shape. (A gate computed from q
    itself would time a gradient of q's slice as large as q, which no layer has.)"""
    key = (tuple(q.shape[:3]), q.device, q.dtype, q.requires_grad)
    if key not in _GATE_LOGITS:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, *q.shape[:3], generator=g).to(q.device, q.dtype)
        _GATE_LOGITS[key] = x.requires_grad_(q.requires_grad)
    x = _GATE_LOGITS[key]
    x.grad = None  # each step's backward writes a fresh gradient, as for q, k, v: none added into the last
    return x


def _gated(chunk: int, feature_map: str, backend: str = "torch") -> Callable:
    """Chunked linear attention with a data-dependent decay per token and head, log_decay =
    -softplus(a) / 16 [B, T, H] from ``gate_logits``, so its backward is timed too, as a trained
    gate's would be. ``backend="fla"``: the same through fla's kernel (bench/peers.py)."""
    from lintrans.ops import linear_attention

    def fn(q, k, v):
        log_decay = -torch.nn.functional.softplus(gate_logits(q)[0]) / 16  # [B,T,H]
        return linear_attention(q, k, v, feature_map=feature_map, chunk_size=chunk, log_decay=log_decay,
                                backend=backend)[0]

    return fn


DELTA_OP, GATED_DELTA_OP = "delta", "gated-delta"


def delta_gates(q: torch.Tensor):
    """The write strength and gate of the delta series, from ``gate_logits`` (so that their backward
    is timed too, as trained ones' would be): beta = sigmoid(b), log_decay = -softplus(a) / 16, the
    gate of ``linear chunked gated``."""
    a, b = gate_logits(q)
    return torch.sigmoid(b), -torch.nn.functional.softplus(a) / 16


def delta_ops() -> dict[str, Callable]:
    """DeltaNet and Gated DeltaNet (``lintrans.ops.delta_rule``, chunked, L2-normalised q and k)."""
    from lintrans.ops import delta_rule

    def delta(q, k, v, gated: bool):
        beta, log_decay = delta_gates(q)
        return delta_rule(q, k, v, beta, log_decay=log_decay if gated else None)[0]

    return {DELTA_OP: lambda q, k, v: delta(q, k, v, False), GATED_DELTA_OP: lambda q, k, v: delta(q, k, v, True)}


def _other_ops() -> dict[str, Callable]:
    """AFT, sliding-window, cosFormer, BigBird and Reformer attention beside the linear forms
    (Reformer's shared query-key is q; k goes unused)."""
    from lintrans.ops.aft import aft
    from lintrans.ops.bigbird import bigbird_attention
    from lintrans.ops.cosformer import cosformer_attention
    from lintrans.ops.lsh import lsh_attention
    from lintrans.ops.sliding_window import sliding_window_attention

    return {"aft simple": lambda q, k, v: _first(aft(q, k, v, variant="simple", causal=True)),
            "sliding window 256": lambda q, k, v: _first(sliding_window_attention(q, k, v, window=256, causal=True)),
            "cosformer": lambda q, k, v: cosformer_attention(q, k, v, causal=True)[0],
            "bigbird 64x(3+1+2)": lambda q, k, v: bigbird_attention(q, k, v, block_size=64, causal=True),
            REFORMER_OP: lambda q, k, v: lsh_attention(q, v, n_buckets=64, n_hashes=2, chunk_size=64, causal=True,
                                                       lookback="window")[0]}


REFORMER_OP = "reformer 2 hashes 64 buckets"


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def make_op_step(fn: Callable, T: int, *, B: int = 1, H: int = 8, D: int = 64, dtype=torch.float32,
                 device: str = "cpu", backward: bool = True) -> Callable[[], None]:
    """One timed step of the op: forward + backward, or with ``backward=False`` the forward alone
    under ``torch.no_grad()`` (what inference and prefill pay)."""
    if isinstance(fn, PerT):
        fn = fn.make(T)
    g = torch.Generator(device="cpu").manual_seed(T)
    q, k, v = (torch.randn(B, T, H, D, generator=g).to(device, dtype).requires_grad_(backward) for _ in range(3))
    grad = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    if not backward:
        def forward():
            with torch.no_grad():
                fn(q, k, v)

        return forward

    def step():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v).backward(grad)

    return step


def select_series(series: dict[str, Callable], only: list[str]) -> dict[str, Callable]:
    """The series named exactly in ``only`` or whose name contains one of ``only``; a peer's
    companion is matched by its peer's name (or its own in full)."""
    from .peers import COMPANION_OF

    def picks(n: str, name: str) -> bool:
        if n in series:  # a full series name picks that series only
            return n == name
        return n in COMPANION_OF.get(name, name)

    blank = [n for n in only if not n.strip()]
    if blank:  # "" is in every name: it would pick every series, the slow peers too
        raise ValueError(f"an empty name picks nothing; available: {list(series)}")
    unknown = [n for n in only if not any(picks(n, name) for name in series)]
    if unknown:
        raise ValueError(f"unknown op series {unknown}; available: {list(series)}")
    return {name: fn for name, fn in series.items() if any(picks(n, name) for n in only)}


def run_ops(Ts: list[int], caps: Caps, *, only: Optional[list[str]] = None, chunk_size=64, gated_chunk=None,
            H: int = 8, D: int = 64, device: str = "cpu", on_point=None, backward: bool = True,
            dtype=torch.float32) -> list[Point]:
    series = op_series(chunk_size, gated_chunk=gated_chunk, device=device)
    if only:
        series = select_series(series, only)
    def make(T, name, fn):
        step = make_op_step(fn, T, H=H, D=D, device=device, backward=backward, dtype=dtype)
        chunk = gated_chunk if name == GATED_OP and gated_chunk is not None else chunk_size
        if name in ("linear chunked", "linear attention_blocked", GATED_OP):  # what the FLOP count depends on
            return step, {"chunk_size": chunk(T) if callable(chunk) else chunk}
        return step

    specs = [Series(name, lambda T, name=name, fn=fn: make(T, name, fn)) for name, fn in series.items()]
    return sweep_side_by_side(specs, Ts, caps, device=device, on_point=on_point)
