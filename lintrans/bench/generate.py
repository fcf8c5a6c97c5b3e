"""Generation benchmark: time per generated token against context length, softmax KV cache against
the linear recurrent state, on the same small model. The context is built by one prefill (SDPA /
the chunked form, not timed); then single-token decode steps are timed."""
from __future__ import annotations

import time

import torch

from .measure import Caps, Point, Series, peak_memory, sweep_side_by_side
from .train import gpt_config


def make_decode_step(size: str, T: int, attention: str, max_T: int, device: str = "cpu"):
    from lintrans.models import GPT

    # the prefill is not timed: a fixed chunk size spares tuning at every context
    chunk = 64
    # room for the decode steps after the longest context: learned positions must cover them
    config = gpt_config(size, max_T + 256, attention, "chunked", chunk)
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    g = torch.Generator().manual_seed(T)
    prompt = torch.randint(0, config.vocab_size, (1, T), generator=g).to(device)
    state = {}

    def prefill():
        with torch.no_grad():
            state["logits"], state["cache"] = model.forward_cached(prompt, None, last_only=True)

    t0 = time.perf_counter()
    prefill_peak = peak_memory(prefill, device)
    prefill_s = time.perf_counter() - t0
    tok = state["logits"][:, -1].argmax(-1, keepdim=True)  # [1,1]
    cache = state.pop("cache")
    budget = config.block_size - T - 1  # decode steps left before positions run out

    def step():
        nonlocal budget
        if budget <= 0:
            raise RuntimeError("decode budget exhausted: raise the block_size margin")
        budget -= 1
        with torch.no_grad():
            model.forward_cached(tok, cache, check_ids=False)

    extra = {"peak_bytes": prefill_peak, "prefill_s": prefill_s, "cache_bytes": cache.nbytes(), "context": T}
    return step, extra


def run_generate(Ts: list[int], caps: Caps, *, size: str = "4L-128", device: str = "cpu", on_point=None) -> list[Point]:
    max_T = max(Ts)
    series = [Series(name, lambda T, a=attention: make_decode_step(size, T, a, max_T, device), measure_memory=False)
              for name, attention in (("softmax KV cache", "softmax"), ("linear state", "linear"))]
    return sweep_side_by_side(series, Ts, caps, device=device, on_point=on_point)
