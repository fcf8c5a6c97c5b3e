"""Cross-entropy of a linear LM head without the [N, V] logits.

At long context the logits dominate training memory: T = 16k positions times a 50257-word
vocabulary is 3.3 GB in float32, and autograd keeps them plus their softmax. ``linear_cross_entropy``
walks the rows in chunks, and when a gradient will be needed it computes it in the same pass
(softmax minus one-hot, times the head), so only [N, d] and [V, d] gradients are kept: the same
6*N*d*V FLOPs as the plain path, no recomputation, and memory of one chunk of logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .validation import check_number, check_positive_int, check_tensor, reads_values

DEFAULT_CHUNK_ROWS = 2048  # logits of 2048 x 50257 float32 are 411 MB; the fastest of 256..4096 on CPU


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logsumexp in float32 at least (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows: int, ignore_index: int, reduction: str, grad_mode: bool):
        N = h.shape[0]
        keep = targets != ignore_index  # [N]
        count = keep.sum()
        # needs_input_grad follows requires_grad, not grad mode: under no_grad (an evaluation) nothing
        # will call backward, so the gradients are not computed
        needs_grad = grad_mode and reduction != "none" and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        acc = _acc_dtype(h.dtype)
        per_row = torch.zeros(N, dtype=acc, device=h.device)  # [N] loss of each row
        grad_h = torch.empty_like(h) if needs_grad else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_grad else None
        # mean over the rows that count; an all-ignored batch gives nan, as F.cross_entropy does
        denom = count.to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=h.device)
        # each counted row's weight in the gradient: ignored rows get none; an all-ignored batch none at all
        # (its loss is nan, its gradient 0, as F.cross_entropy's), not 0 / 0
        row_weight = 1.0 / denom.clamp(min=1)
        # the logits chunk is kept transposed, [V, n]: W @ h^T runs faster than h @ W^T on CPU
        buf = torch.empty(weight.shape[0] * min(chunk_rows, N), dtype=acc, device=h.device)
        for s in range(0, N, chunk_rows):
            hs, ts, ks = h[s:s + chunk_rows], targets[s:s + chunk_rows], keep[s:s + chunk_rows]
            n = hs.shape[0]
            logits = buf[:weight.shape[0] * n].view(weight.shape[0], n)  # [V, n]
            if h.dtype == acc:  # into one reused buffer: fresh pages for every chunk are slow on CPU
                torch.mm(weight, hs.t(), out=logits)
            else:
                logits.copy_(weight @ hs.t())
            # one exp pass serves both the loss and the gradient: shift by the column max, exp in place
            logits.sub_(logits.amax(dim=0))
            safe_t = ts.masked_fill(~ks, 0)[None]  # [1, n]
            picked = logits.gather(0, safe_t).squeeze(0)  # [n] shifted logit of the target
            sums = logits.exp_().sum(dim=0)  # [n]
            per_row[s:s + n] = torch.where(ks, sums.log() - picked, 0.0)
            if needs_grad:
                gh = grad_h[s:s + n]
                if h.dtype == acc:
                    # exp - sums * onehot is sums * (softmax - onehot): the 1 / sums goes onto the
                    # [n, d] operands instead of a pass over the [V, n] chunk
                    w_row = torch.where(ks, row_weight, 0.0).to(acc)
                    g = logits.scatter_add_(0, safe_t, -sums[None])
                    scale = (w_row / sums)[:, None]  # [n, 1]
                    torch.mm(g.t(), weight, out=gh).mul_(scale)  # [n, d]
                    grad_w.addmm_(g, hs * scale)  # [V, d]
                else:
                    # low precision: normalise first, so that no entry can overflow (fp16 < 65504). The mean's
                    # 1 / count waits: in 16 bits it would put a large batch's gradients under the normal range
                    # (grad_h takes it in backward, with the loss scale; grad_w in acc, below)
                    g = logits.mul_(1.0 / sums).scatter_add_(0, safe_t, -torch.ones_like(sums)[None])  # acc
                    keep_rows = ks[:, None]
                    torch.mm(g.to(h.dtype).t(), weight, out=gh).mul_(keep_rows.to(h.dtype))  # [n, d]
                    grad_w.addmm_(g, hs.to(acc) * keep_rows.to(acc))  # [V, d], the products in acc
        if needs_grad and h.dtype != acc:
            grad_w.mul_(row_weight)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if needs_grad else None)
        ctx.reduction = reduction
        # what grad_h still lacks (16 bits: the mean's 1 / count), applied in acc with the incoming gradient
        ctx.h_factor = None if h.dtype == acc else row_weight
        if reduction == "none":
            return per_row
        total = per_row.sum()
        return total / denom if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        if ctx.reduction == "none":
            raise RuntimeError(
                "linear_cross_entropy(reduction='none') gives no gradient; use 'mean' or 'sum' to train"
            )
        gh = None
        if ctx.needs_input_grad[0]:
            if ctx.h_factor is None:
                gh = grad_h * grad_out.to(grad_h.dtype)
            else:  # the loss scale times 1 / count in acc first, then into the 16-bit rows
                gh = grad_h * (grad_out.to(ctx.h_factor.dtype) * ctx.h_factor).to(grad_h.dtype)
        gw = grad_w * grad_out.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ignore_index: int = -1,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, targets)`` without materialising the logits.

    h [N, d] hidden states, weight [V, d] (the LM head), targets [N] int64 with ``ignore_index``
    rows left out. ``reduction`` is "mean" (over the rows that count), "sum" or "none" ([N] per
    row, no gradient). With gradients enabled they are computed during the forward pass, chunk by
    chunk, so calling backward costs nothing more.
    """
    check_tensor("h", h, 2, "[N, d]")
    check_tensor("weight", weight, 2, "[V, d]")
    if h.shape[1] != weight.shape[1]:
        raise ValueError(f"h [N, d] and weight [V, d] must share d, got {tuple(h.shape)} and {tuple(weight.shape)}")
    if h.dtype != weight.dtype:
        raise TypeError(f"h and weight must share one dtype, got {h.dtype} and {weight.dtype}")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an int64 tensor [N], got {getattr(targets, 'dtype', type(targets))}")
    if targets.shape != h.shape[:1]:
        raise ValueError(f"targets must have shape [N] = ({h.shape[0]},), got {tuple(targets.shape)}")
    check_positive_int("chunk_rows", chunk_rows)
    check_number("ignore_index", ignore_index, integer=True)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    targets = targets.long()
    if reads_values(targets.device):  # on an accelerator the gather asserts on the device instead
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"targets must lie in [0, {weight.shape[0]}) or equal ignore_index={ignore_index}")
    return _LinearCrossEntropy.apply(h, weight, targets, chunk_rows, ignore_index, reduction,
                                     torch.is_grad_enabled())


def linear_cross_entropy_reference(h, weight, targets, *, ignore_index: int = -1, reduction: str = "mean"):
    """The plain path in float64: full logits, then ``F.cross_entropy``."""
    logits = h.double() @ weight.double().t()  # [N, V]
    return F.cross_entropy(logits, targets.long(), ignore_index=ignore_index, reduction=reduction)
