"""LM-head loss benchmark: forward + backward of ``h @ W.T`` then cross-entropy, the plain way (full
[T, V] logits) against ``linear_cross_entropy`` (chunked, gradient in the same pass), against T."""
from __future__ import annotations

from typing import Callable

import torch

from .measure import Caps, Point, Series, sweep_side_by_side

SERIES = ("logits + F.cross_entropy", "linear_cross_entropy")


def make_loss_step(name: str, T: int, *, D: int = 128, V: int = 50257, device: str = "cpu") -> Callable[[], None]:
    from lintrans.ops import linear_cross_entropy

    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, D, generator=g).to(device).requires_grad_()  # [T, D] final hidden states
    w = (0.02 * torch.randn(V, D, generator=g)).to(device).requires_grad_()  # [V, D] the (tied) head
    targets = torch.randint(0, V, (T,), generator=g).to(device)

    def plain():
        h.grad = w.grad = None
        torch.nn.functional.cross_entropy(h @ w.t(), targets).backward()  # logits [T, V]

    def chunked():
        h.grad = w.grad = None
        linear_cross_entropy(h, w, targets).backward()

    return plain if name == SERIES[0] else chunked


def run_loss(Ts: list[int], caps: Caps, *, D: int = 128, V: int = 50257, device: str = "cpu",
             on_point=None) -> list[Point]:
    series = [Series(name, lambda T, name=name: make_loss_step(name, T, D=D, V=V, device=device)) for name in SERIES]
    return sweep_side_by_side(series, Ts, caps, device=device, on_point=on_point)
