"""Reversible residual layers (RevNet; the Reformer's Transformer, Kitaev et al. 2020).

Each block maps two streams (x1, x2) to

    y1 = x1 + F(x2),   F = attention(ln_1(.))
    y2 = x2 + G(y1),   G = mlp(ln_2(.))

and its inputs follow from its outputs: x2 = y2 - G(y1), x1 = y1 - F(x2). So training keeps only
the last block's outputs: ``reversible_blocks`` runs each block as an autograd Function that keeps
nothing (the last one keeps its outputs) and, going backward, rebuilds the block's inputs from its
outputs, recomputes F and G with autograd, and hands the rebuilt inputs to the block before.
Activation memory does not grow with depth; the price is one more forward of every block, and
inputs rebuilt by subtraction (exact in exact arithmetic, rounded in floating point). Dropout (any random op in F or G) is replayed: the RNG state before each F and G
is saved in the forward and restored for the recomputation, so the masks are the same.
"""
from __future__ import annotations

import contextlib
import torch
import torch.nn as nn


def reversible_step(block: nn.Module, x1: torch.Tensor, x2: torch.Tensor, cache=None, use_cache: bool = False):
    """One block on the two streams, with ordinary autograd: (y1, y2, the attention's cache)."""
    a, cache = block.attend(x2, cache=cache, use_cache=use_cache)
    y1 = x1 + a
    return y1, x2 + block.feed(y1), cache


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed(state, device: torch.device):
    """Run with the RNG as it was at ``state`` (None: as it is), leaving the RNG untouched after."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _autocast_state(device_type: str):
    """(enabled, dtype) of autocast for ``device_type``, or None where it has no autocast (meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast_as(device_type: str, state):
    """Autocast as it was in the forward (``_autocast_state``), for the recomputation."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=state[1], enabled=state[0])


def _halves(block: nn.Module) -> tuple[list, list]:
    """The parameters of F (ln_1, attention) and of G (ln_2, mlp) that need gradients."""
    f = [p for m in (block.ln_1, block.attn) for p in m.parameters() if p.requires_grad]
    g = [p for m in (block.ln_2, block.mlp) for p in m.parameters() if p.requires_grad]
    return f, g


class _Outputs:
    """Passed down the chain of blocks in the backward pass: the outputs of the block whose backward
    runs next, rebuilt by the block after it (the last block's are the only ones stored)."""

    outputs: tuple = ()


class _ReversibleBlock(torch.autograd.Function):
    """One block whose backward rebuilds its inputs from its outputs. One Function per block, so
    each block's parameter gradients are handed to autograd (and freed) as soon as they exist."""

    @staticmethod
    def forward(ctx, x1, x2, block, chain, last, replay_rng, *params):
        dev = x1.device
        ctx.block, ctx.chain, ctx.last = block, chain, last
        ctx.amp = (dev.type, _autocast_state(dev.type))
        f_state = _rng_state(dev) if replay_rng else None
        y1 = x1 + block.attend(x2)[0]  # autograd is off in here: nothing is kept
        g_state = _rng_state(dev) if replay_rng else None
        y2 = x2 + block.feed(y1)
        ctx.rng = (f_state, g_state)
        if last:
            ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        if ctx.last:
            ctx.chain.outputs = ctx.saved_tensors
        y1, y2 = ctx.chain.outputs
        dy1 = torch.zeros_like(y1) if dy1 is None else dy1
        dy2 = torch.zeros_like(y2) if dy2 is None else dy2
        block, (f_state, g_state) = ctx.block, ctx.rng
        f_params, g_params = _halves(block)
        with torch.enable_grad(), _autocast_as(*ctx.amp):
            y1_ = y1.detach().requires_grad_()
            with _replayed(g_state, y1.device):
                g = block.feed(y1_)
            gy1, *g_grads = torch.autograd.grad(g, [y1_, *g_params], dy2, allow_unused=True)
        dy1 = dy1 + gy1  # y1 reaches the loss directly and through G
        x2 = y2 - g.detach()
        with torch.enable_grad(), _autocast_as(*ctx.amp):
            x2_ = x2.detach().requires_grad_()
            with _replayed(f_state, y1.device):
                f = block.attend(x2_)[0]
            gx2, *f_grads = torch.autograd.grad(f, [x2_, *f_params], dy1, allow_unused=True)
        ctx.chain.outputs = (y1 - f.detach(), x2)  # this block's inputs: the block before's outputs
        return (dy1, dy2 + gx2, None, None, None, None, *f_grads, *g_grads)


def reversible_blocks(blocks: nn.ModuleList, x1: torch.Tensor, x2: torch.Tensor, *, replay_rng: bool = False,
                      recompute: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The two streams through every block. ``recompute`` (the point of it): activations rebuilt in
    the backward pass, memory flat in depth; False: ordinary autograd, storing every block's
    activations (the same function and gradients; for tests). ``replay_rng``: save and restore the
    RNG around each F and G (needed when they draw random numbers, e.g. dropout in training)."""
    if not recompute or not torch.is_grad_enabled():
        for block in blocks:
            x1, x2, _ = reversible_step(block, x1, x2)
        return x1, x2
    chain = _Outputs()
    for i, block in enumerate(blocks):
        f_params, g_params = _halves(block)
        x1, x2 = _ReversibleBlock.apply(x1, x2, block, chain, i == len(blocks) - 1, replay_rng, *f_params, *g_params)
    return x1, x2
