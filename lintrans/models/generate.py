"""Choosing the next token from logits: greedy, temperature, top-k, nucleus (top-p)."""
from __future__ import annotations

from typing import Optional

import torch

from lintrans.checks import check_number


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed, label=lambda name: name) -> None:
    """``label``: how an error names each argument (the command line's flags, say)."""
    check_number(label("max_new_tokens"), max_new_tokens, integer=True, low=1)
    check_number(label("temperature"), temperature, low=0)  # 0 = greedy
    check_number(label("top_k"), top_k, integer=True, low=1, allow_none=True)
    check_number(label("top_p"), top_p, low=0, high=1, low_open=True, allow_none=True)
    check_number(label("seed"), seed, integer=True, allow_none=True, low=-(2**63), high=2**64 - 1)  # torch's generator's range


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """logits [B, V] -> next token ids [B, 1]."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or one that float32 cannot divide by: greedy
        return logits.argmax(dim=-1, keepdim=True)
    # the row's largest logit first: a tiny temperature would otherwise turn logits into inf - inf = nan
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B,1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        # drop a token when the tokens before it already reach top_p (the first always stays). The mass
        # before each token in float64, summed without it (float32's cumsum over 50k tokens drifted by 2e-5,
        # which moved the nucleus's edge by a token)
        wide = torch.float32 if sorted_logits.device.type == "mps" else torch.float64  # MPS has no float64
        probs = sorted_logits.to(wide).softmax(-1)
        before = torch.cat([probs.new_zeros(probs.shape[0], 1), probs[:, :-1].cumsum(-1)], dim=-1)
        drop_sorted = before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)
