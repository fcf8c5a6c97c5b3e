"""Training-step benchmark: forward + backward + AdamW step of a GPT-2-style model (batch 1,
vocabulary 50257) against context length, softmax (SDPA) against every linear form."""
from __future__ import annotations

from typing import Optional

import torch

from lintrans.ops.linear import FORMS

from .measure import Caps, Point, Series, sweep_side_by_side
from .sizes import ModelSize, is_linear, model_size

# the op's forms, the fast one first (the order of the benchmark's series)
LINEAR_FORMS = ("chunked", *(f for f in FORMS if f != "chunked"))


FLOOR = "no mixing (floor)"


def train_series(forms=LINEAR_FORMS, floor: bool = True, mechanisms=()) -> list[tuple[str, str, Optional[str]]]:
    """(series name, attention, form) in plotting order. The floor is the same GPT with attention
    "none": everything but the token mixing, so softmax / floor bounds what any mechanism can gain.
    ``mechanisms``: other registered attention names (e.g. ``gated-linear``), each a series of its
    own, chunked where it is a linear-attention layer."""
    series = [("softmax (SDPA)", "softmax", None)] + [(f"linear {f}", "linear", f) for f in forms]
    series += [(m, m, "chunked" if is_linear(m) else None) for m in mechanisms]
    return series + ([(FLOOR, "none", None)] if floor else [])


def make_train_step(config, T: int, device: str = "cpu", precision: str = "fp32"):
    """One training step as ``lintrans train`` takes it: ``precision`` bf16/fp16 runs the forward under
    ``torch.autocast`` (fp16 with a GradScaler, which needs CUDA), the weights and AdamW in float32."""
    from lintrans.models import GPT
    from lintrans.train.precision import autocast, grad_scaler, resolve_precision

    precision = resolve_precision(precision, device, what="precision")
    torch.manual_seed(0)
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler, context = grad_scaler(precision), autocast(precision, device)
    g = torch.Generator().manual_seed(T)
    idx = torch.randint(0, config.vocab_size, (1, T + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with context:
            _, loss = model(x, y, return_logits=False)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def run_train(Ts: list[int], caps: Caps, *, sizes=("4L-128",), forms=LINEAR_FORMS, device: str = "cpu",
              tuned_chunk: bool = True, floor: bool = True, mechanisms=(), on_point=None,
              precision: str = "fp32") -> list[Point]:
    points: list[Point] = []
    for size in sizes:
        model = model_size(size, "--sizes")
        softmax = f"{size} softmax (SDPA)"
        series = []
        for name, attention, form in train_series(forms, floor, mechanisms):
            def make(T, attention=attention, form=form):
                chunk = model.chunk_size(T, attention, form, tuned=tuned_chunk, device=device)
                step = make_train_step(model.gpt_config(T, attention, form, chunk), T, device, precision)
                return step, {"chunk_size": chunk} if form in ("chunked", "attention_blocked") else {}

            # the floor only bounds softmax's speed-up, so it is timed where softmax was, and without
            # peak memory: it is not a competitor (a good part of `make demo`'s time saved)
            is_floor = attention == "none"
            series.append(Series(f"{size} {name}", make, measure_memory=not is_floor,
                                 within=softmax if is_floor else None))
        together = _fits_together(model, len(series), max(Ts), caps)
        for p in sweep_side_by_side(series, Ts, caps, device=device, together=together, on_point=on_point):
            p.extra.setdefault("size", size)
            p.extra.setdefault("interleaved", together)  # False: series timed one after another
            points.append(p)
    return points


def _fits_together(model: ModelSize, n_series: int, T: int, caps: Caps) -> bool:
    """Whether every series' model, gradients and AdamW state (16 bytes a parameter) fit in a
    quarter of the memory cap at once, leaving the rest for one step's activations."""
    from .cost import parameters

    params = parameters(model.shape(T))["total"]
    return caps.memory_bytes is None or 16 * params * n_series <= caps.memory_bytes / 4
