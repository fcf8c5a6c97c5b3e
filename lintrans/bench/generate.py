"""Generation benchmark: time per generated token against context length, softmax KV cache against
the linear recurrent state, on the same small model. The context is built by one prefill (SDPA /
the chunked form, not timed); then single-token decode steps are timed."""
from __future__ import annotations

import time

import torch

from .measure import Caps, Point, Series, peak_memory, sweep_side_by_side
from .sizes import DEFAULT_CHUNK, model_size


def make_decode_step(size: str, T: int, attention: str, max_T: int, device: str = "cpu", steps: int = 256):
    from lintrans.models import GPT

    # room for the ``steps`` decode steps after the longest context: learned positions must cover them;
    # the prefill is not timed, so a fixed chunk size spares tuning at every context
    config = model_size(size).gpt_config(max_T + steps, attention, "chunked" if attention == "linear" else None,
                                         DEFAULT_CHUNK)
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
    prefill_cold_s = time.perf_counter() - t0  # one first call, with the memory probe around it: not a timing
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

    extra = {"peak_bytes": prefill_peak, "prefill_cold_s": prefill_cold_s, "cache_bytes": cache.nbytes(), "context": T}
    return step, extra


# attention -> series name, for the series older records hold; every other attention is "<name> cache"
NAMED = {"softmax": "softmax KV cache", "linear": "linear state", "gated-deltanet": "gated-deltanet state"}


def decoder_series() -> dict[str, str]:
    """Every attention a GPT can decode with -> its series name."""
    from lintrans.nn import available_attention

    return {**NAMED, **{a: f"{a} cache" for a in available_attention() if a not in NAMED and a != "none"}}


def run_generate(Ts: list[int], caps: Caps, *, size: str = "4L-128", device: str = "cpu", on_point=None,
                 decoders=tuple(NAMED)) -> list[Point]:
    """``decoders``: which attentions of ``decoder_series()`` to run (the softmax prefill of a long context with a
    large model takes minutes; its cache is in ``decode_lines`` from the cost model either way)."""
    max_T = max(Ts)
    # every step a point can time: warm-up, the repeats, and the repeats of each retime (with slack)
    steps = max(256, 2 * caps.repeats * (1 + caps.retimes) + 16)
    names = decoder_series()
    series = [Series(names[a], lambda T, a=a: make_decode_step(size, T, a, max_T, device, steps),
                     measure_memory=False)
              for a in names if a in decoders]
    return sweep_side_by_side(series, Ts, caps, device=device, on_point=on_point)


def decode_lines(rows: list[dict], size: str) -> list[str]:
    """Per decoder: time per token at the longest context over the shortest; and what decoding keeps
    there, the softmax KV cache against the linear state (the cost model's bytes, which the
    measured ``cache_bytes`` equal)."""
    from .cost import cache_bytes

    lines = []
    for name in decoder_series().values():
        ok = sorted((r["T"], r["time_s"], r.get("cpu_s")) for r in rows if r["series"] == name and r["status"] == "ok")
        if len(ok) >= 2:
            (T0, t0, c0), (T1, t1, c1) = ok[0], ok[-1]
            cpu = f"; process CPU time {c1 * 1e3:.2f} ms and {c0 * 1e3:.2f} ms ({c1 / c0:.2f}x)" if c0 and c1 else ""
            lines.append(f"{name}: {t1 * 1e3:.2f} ms per token at T = {T1}, {t0 * 1e3:.2f} ms at T = {T0} "
                         f"({t1 / t0:.2f}x){cpu}")
    Ts = [r["T"] for r in rows if r["status"] == "ok"]
    if Ts:
        T = max(Ts)
        model = model_size(size)
        kv = cache_bytes(model.shape(T + 256), T)
        state = cache_bytes(model.shape(T + 256, "linear", "chunked"), T)
        lines.append(f"at T = {T} the softmax KV cache holds {kv / 2**20:.1f} MiB, the linear state "
                     f"{state / 2**20:.2f} MiB ({kv / state:.3g}x)")
    return lines
