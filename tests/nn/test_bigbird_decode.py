"""BigBird decoding: each step's mask row sliced from its block's row (built once and cached), against
``bigbird_mask`` and the forward pass."""
import pytest
import torch

from lintrans.models import GPTConfig
from lintrans.nn.bigbird import BigBirdAttention
from lintrans.ops.bigbird import bigbird_blocked_row, bigbird_mask

from decoding import assert_decoding_equals_forward, decode

PATTERNS = [dict(block_size=1, window_blocks=1, global_blocks=0, random_blocks=1, seed=0),
            dict(block_size=2, window_blocks=3, global_blocks=1, random_blocks=1, seed=0),
            dict(block_size=3, window_blocks=2, global_blocks=2, random_blocks=3, seed=5),
            dict(block_size=4, window_blocks=1, global_blocks=0, random_blocks=2, seed=1),
            dict(block_size=5, window_blocks=3, global_blocks=1, random_blocks=0, seed=0),
            dict(block_size=7, window_blocks=2, global_blocks=3, random_blocks=2, seed=3),
            dict(block_size=64, window_blocks=3, global_blocks=1, random_blocks=2, seed=0)]  # longer than T


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_decoding_row_is_the_masks_last_row(pattern):
    """Every length from 1 (inside the first block, at and past each block boundary), global rows,
    random blocks: the cached row is ``~bigbird_mask``'s last row, on every call (a cache hit too)."""
    blocked = 0
    for T in range(1, 60):
        want = ~bigbird_mask(T, start=T - 1, causal=True, **pattern)[0]
        for _ in range(2):
            assert torch.equal(bigbird_blocked_row(T, **pattern), want), T
        blocked += int(want.sum())
    assert blocked > 0 or pattern["block_size"] == 64  # the rows do leave keys out


def test_a_block_longer_than_the_sequence_is_one_block_of_it():
    """bigbird_mask's rule, without a row of the configured block's length (2**40 keys)."""
    assert torch.equal(bigbird_blocked_row(7, block_size=2**40), torch.zeros(7, dtype=torch.bool))


def layer_of(**pattern):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=16, attention="bigbird",
                       attention_options=pattern)
    return BigBirdAttention(config).double()


@pytest.mark.parametrize("prompt, step", [(1, 1), (4, 1), (5, 4)])
def test_decoding_past_many_blocks_equals_the_forward_and_its_gradients(prompt, step):
    """Blocks of 3 over 31 tokens (a prompt inside the first block, at its end, past it), random and
    global blocks; one token at a time and several at once (bigbird_mask's rows); backward through
    the steps equals backward through the forward."""
    layer = layer_of(block_size=3, window_blocks=2, global_blocks=1, random_blocks=2, seed=4)
    x = (3 * torch.randn(2, 31, 16, dtype=torch.float64)).requires_grad_()
    assert_decoding_equals_forward(layer, x, prompt, step)


def test_a_row_first_built_in_inference_mode_serves_a_backward_later():
    """The cached row is made outside inference mode: built during an inference_mode decoding, it is
    then saved for backward by a decoding step with gradients."""
    pattern = dict(block_size=2, window_blocks=1, global_blocks=0, random_blocks=1, seed=98_765)  # rows no other test built
    layer = layer_of(**pattern)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    with torch.inference_mode():
        decode(layer, x, prompt=2)
    xg = x.clone().requires_grad_()
    stepped, _ = decode(layer, xg, prompt=2)
    stepped.sum().backward()
    assert torch.isfinite(xg.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_decoding_computes_as_the_forward(dtype):
    """The forward's op scores and averages in float32; decoding did its products in the 16-bit dtype
    (5x the forward's error against float64). Now both round alike: decode equals forward closely."""
    layer = layer_of(block_size=3, window_blocks=2, global_blocks=1, random_blocks=2, seed=4).to(dtype)
    x = (3 * torch.randn(1, 20, 16, generator=torch.Generator().manual_seed(0))).to(dtype)
    with torch.no_grad():
        full, _ = layer(x)
        stepped, _ = decode(layer, x, 4)
    torch.testing.assert_close(stepped.float(), full.float(), rtol=0, atol=4e-3 if dtype == torch.bfloat16 else 5e-4)
