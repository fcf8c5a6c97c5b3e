"""The chunked form block by block (``ChunkedAttention``): block boundaries against the float64
reference, outputs, states and gradients, with and without a decay."""
import pytest
import torch

from lintrans.ops import FORMS, linear_attention, linear_attention_reference
from lintrans.ops.linear import chunked as linear_chunked
from lintrans.ops.native import chunked as native_chunked

from native_paths import on_path, took
from qkv import random_qkv


@pytest.fixture(autouse=True, params=["blocks", "native"])
def path(request, monkeypatch):
    """Every test here runs on both CPU paths: the PyTorch blocks and the fused kernel (ops/native)."""
    return on_path(request.param, monkeypatch, native_chunked)


def chunks_per_block(monkeypatch, B, H, c, nb, keep=False):
    """Make the CPU path cut the sequence into blocks of ``nb`` chunks of ``c`` tokens (the fused
    kernel: save a state every ``nb`` chunks); ``keep``: the blocks are kept for backward (short
    calls), else recomputed (long calls)."""
    monkeypatch.setattr(native_chunked, "CHECKPOINT_CHUNKS", nb)
    monkeypatch.setattr(linear_chunked, "BLOCK_TOKEN_HEADS", B * H * c * nb)
    monkeypatch.setattr(linear_chunked, "KEEP_TOKEN_HEADS", 10**9 if keep else 0)
    assert linear_chunked.chunks_per_block(torch.device("cpu"), B * H, c, 100) == nb


@pytest.mark.parametrize("T,c,nb", [
    (24, 4, 3),   # T exactly two blocks
    (25, 4, 3),   # one token more than two blocks: a tail chunk of 1
    (23, 4, 3),   # one token less: the last block has 2 chunks and a tail of 3
    (13, 4, 3),   # one block plus a tail
    (12, 4, 3),   # exactly one block
    (16, 4, 1),   # a block per chunk
    (7, 4, 100),  # fewer chunks than a block, and a tail
    (3, 8, 2),    # the chunk longer than the sequence
    (1, 4, 2),    # T = 1
])
@pytest.mark.parametrize("decay", [None, "per-token", "fixed"])
@pytest.mark.parametrize("keep", [False, True])
def test_block_boundaries_equal_reference(monkeypatch, path, T, c, nb, decay, keep):
    B, H, Dk, Dv = 2, 3, 5, 4
    chunks_per_block(monkeypatch, B, H, min(c, T), nb, keep)
    q, k, v = (x.requires_grad_() for x in random_qkv(B, T, H, Dk, Dv))
    g = torch.Generator().manual_seed(1)
    ld = None
    if decay is not None:
        ld = (-2 * torch.rand((B, T, H) if decay == "per-token" else (H,), dtype=torch.float64, generator=g))
        ld.requires_grad_()
    S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64, generator=g).requires_grad_()
    z0 = (torch.rand(B, H, Dk, dtype=torch.float64, generator=g) + 0.5).requires_grad_()
    w = torch.randn(B, T, H, Dv, dtype=torch.float64, generator=g)
    wS = torch.randn(B, H, Dk, Dv, dtype=torch.float64, generator=g)
    wz = torch.randn(B, H, Dk, dtype=torch.float64, generator=g)
    kw = dict(log_decay=ld, initial_state=(S0, z0), scale=0.7)
    o, (S, z) = linear_attention(q, k, v, chunk_size=c, output_final_state=True, **kw)
    ref, (S_ref, z_ref) = linear_attention_reference(q, k, v, **kw)
    for got, want in ((o, ref), (S, S_ref), (z, z_ref)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    inputs = [x for x in (q, k, v, ld, S0, z0) if x is not None]
    got = torch.autograd.grad((o * w).sum() + (S * wS).sum() + (z * wz).sum(), inputs)
    want = torch.autograd.grad((ref * w).sum() + (S_ref * wS).sum() + (z_ref * wz).sum(), inputs)
    for gg, ww in zip(got, want):
        torch.testing.assert_close(gg, ww, rtol=1e-8, atol=1e-10)
    assert took(path)


@pytest.mark.parametrize("normalize,feature_map", [(False, "identity"), (True, "based"), (False, "softplus"),
                                                   (True, "relu"), (True, "module")])
@pytest.mark.parametrize("keep", [False, True])
def test_blocks_with_every_kind_of_feature_map(monkeypatch, normalize, feature_map, keep):
    """Named maps run inside the blocks (their gradient from their output, or by autograd), a module outside."""
    B, T, H, D = 1, 19, 2, 4
    chunks_per_block(monkeypatch, B, H, 3, 2, keep)
    q, k, v = (x.requires_grad_() for x in random_qkv(B, T, H, D, D, seed=2))
    if feature_map == "module":
        lin = torch.nn.Linear(D, 6, dtype=torch.float64)
        feature_map = lambda x: torch.nn.functional.softplus(lin(x))  # noqa: E731
    ld = -torch.rand(B, T, H, dtype=torch.float64).requires_grad_()
    kw = dict(normalize=normalize, scale=1.3, feature_map=feature_map, log_decay=ld)
    o, _ = linear_attention(q, k, v, chunk_size=3, **kw)
    ref, _ = linear_attention_reference(q, k, v, **kw)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    inputs = (q, k, v, ld)
    w = torch.randn_like(o)
    for gg, ww in zip(torch.autograd.grad((o * w).sum(), inputs), torch.autograd.grad((ref * w).sum(), inputs)):
        torch.testing.assert_close(gg, ww, rtol=1e-8, atol=1e-10)


def test_strided_inputs(monkeypatch):
    """q, k, v as views of one projection (as a fused qkv layer gives them) equal contiguous copies."""
    B, T, H, D = 2, 21, 3, 4
    chunks_per_block(monkeypatch, B, H, 4, 2)
    qkv = torch.randn(B, T, 3, H, D, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv.unbind(2)
    o = linear_attention(q, k, v, chunk_size=4)[0]
    ref = linear_attention_reference(q.detach(), k.detach(), v.detach())[0]
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    o.sum().backward()
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    linear_attention_reference(q2, k2, v2)[0].sum().backward()
    torch.testing.assert_close(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], 2), rtol=1e-8, atol=1e-10)


def test_blocks_cover_every_token_once():
    for T in (1, 5, 63, 64, 65, 129, 1000):
        for chunk in (1, 4, 64):
            for block in (1, 3, 16):
                blocks = linear_chunked._blocks(T, chunk, block)
                starts = [t0 for t0, _, _ in blocks]
                ends = [t0 + nb * c for t0, nb, c in blocks]
                assert starts[0] == 0 and ends[-1] == T and starts[1:] == ends[:-1]
                assert all(nb <= block and c == chunk for _, nb, c in blocks[:-1])


def test_form_function_equals_attention_form():
    """FORMS["chunked"] keeps the forms' interface: features and v with its normaliser column."""
    B, H, T, F, E = 2, 2, 11, 3, 4
    g = torch.Generator().manual_seed(3)
    fq, fk = (torch.rand(B, H, T, F, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, E, dtype=torch.float64, generator=g)
    S0 = torch.randn(B, H, F, E, dtype=torch.float64, generator=g)
    ld = -torch.rand(1, H, T, dtype=torch.float64, generator=g)
    y, S = FORMS["chunked"](fq, fk, v, S0, 4, ld)
    y_ref, S_ref = FORMS["attention"](fq, fk, v, S0, 4, ld)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients(monkeypatch, dtype):
    """16-bit inputs: gradients in the inputs' dtype, close to float32's (the math runs in float32)."""
    chunks_per_block(monkeypatch, 1, 2, 8, 2)
    q, k, v = random_qkv(1, 45, 2, 8, 8, dtype=torch.float32, seed=4)
    ld = -torch.rand(1, 45, 2) / 4
    grads = {}
    for dt in (torch.float32, dtype):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v, ld)]
        o, _ = linear_attention(*xs[:3], chunk_size=8, log_decay=xs[3])
        o.float().square().sum().backward()
        grads[dt] = [x.grad for x in xs]
    for lo, hi in zip(grads[dtype], grads[torch.float32]):
        assert lo.dtype == dtype
        assert ((lo.float() - hi).abs().max() / hi.abs().max()).item() < 3e-2


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("decay", [False, True])
def test_bf16_autocast_leaves_the_op_in_float32(monkeypatch, decay, keep):
    """Under bf16 autocast (as a mixed-precision training step runs it) the op still accumulates in
    float32: float32 inputs give exactly what they give without autocast, gradients included."""
    chunks_per_block(monkeypatch, 1, 2, 8, 2, keep=keep)
    q, k, v = random_qkv(1, 45, 2, 8, 5, dtype=torch.float32, seed=6)
    ld = -torch.rand(1, 45, 2) / 4 if decay else None
    results = []
    for autocast in (False, True):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o, (S, z) = linear_attention(*xs, chunk_size=8, log_decay=ld, output_final_state=True)
            loss = o.square().sum() + S.sum() + z.sum()
        loss.backward()
        results.append([o, S, z] + [x.grad for x in xs])
    for a, b in zip(*results):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
