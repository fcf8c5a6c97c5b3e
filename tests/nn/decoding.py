"""Decoding a layer as generation does, for the layer tests."""
import torch


def decode(layer, x, prompt, step=1):
    """The layer's output for x [B, T, C]: a prefill of ``prompt`` tokens, then ``step`` tokens per call
    through the cache; returns (the outputs concatenated, the last cache)."""
    y, cache = layer(x[:, :prompt], use_cache=True)
    ys = [y]
    for t in range(prompt, x.shape[1], step):
        y, cache = layer(x[:, t : t + step], cache=cache, use_cache=True)
        ys.append(y)
    return torch.cat(ys, 1), cache


def assert_decoding_equals_forward(layer, x, prompt, step=1, atol=1e-10, rtol=1e-10):
    """Outputs of ``decode`` and their gradients (x requires grad; a random weighting of the outputs)
    equal those of one full forward, float64."""
    w = torch.randn(x.shape, dtype=x.dtype)
    full, _ = layer(x)
    g_full, = torch.autograd.grad((full * w).sum(), x)
    stepped, _ = decode(layer, x, prompt, step)
    g_steps, = torch.autograd.grad((stepped * w).sum(), x)
    torch.testing.assert_close(stepped, full, atol=atol, rtol=rtol)
    torch.testing.assert_close(g_steps, g_full, atol=atol, rtol=rtol)
