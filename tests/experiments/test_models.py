import pytest
import torch

from lintrans.experiments.models import VectorGPT, check_specs, gpt_config, parse_attention, state_floats
from lintrans.models.config import GPTConfig
from lintrans.models.gpt import GPT


def test_parse_attention():
    assert parse_attention("softmax") == ("softmax", {})
    assert parse_attention("linear:based") == ("linear", {"feature_map": "based"})
    assert parse_attention("linear:feature_map=elu,normalize=false,eps=1e-5,chunk_size=8") == (
        "linear", {"feature_map": "elu", "normalize": False, "eps": 1e-5, "chunk_size": 8})


@pytest.mark.parametrize("spec, match", [
    ("nope", "attention must be one of"),
    ("softmax:elu", "only for 'linear'"),
    ("linear:nope", "feature map must be one of"),
    ("linear:a=1,b", "key=value"),
    ("", "non-empty"),
])
def test_parse_attention_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_attention(spec)


def test_gpt_config_gives_linear_a_form_unless_the_spec_does():
    fields = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=10)
    assert gpt_config("linear:elu", **fields).attention_options == {"feature_map": "elu", "form": "chunked"}
    assert gpt_config("linear:feature_map=elu,form=attention", **fields).attention_options["form"] == "attention"
    assert gpt_config("softmax", linear_form="attention", **fields).attention_options == {}
    # the delta rule has forms of its own: a linear-attention form it lacks is not forced on it
    assert gpt_config("deltanet", linear_form="attention", **fields).attention_options == {}
    assert gpt_config("gated-deltanet", linear_form="recurrent", **fields).attention_options == {"form": "recurrent"}


def test_check_specs_rejects_before_training():
    fields = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=10)
    check_specs(["softmax", "linear:elu", "sliding-window:window=4"], **fields)
    with pytest.raises(ValueError, match="distinct"):
        check_specs(["softmax", "softmax"], **fields)
    with pytest.raises(ValueError, match="sliding-window:bogus=1"):
        check_specs(["sliding-window:bogus=1"], **fields)
    with pytest.raises(TypeError, match="non-empty list"):
        check_specs("softmax", **fields)


def test_state_floats_per_layer():
    fields = dict(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=10)
    T = 20
    assert state_floats(GPT(gpt_config("softmax", **fields)), T) == 2 * T * 16  # keys and values
    H, D = 2, 8
    assert state_floats(GPT(gpt_config("linear:elu", **fields)), T) == H * D * (D + 1)  # S and z
    ring = state_floats(GPT(gpt_config("sliding-window:window=4", **fields)), T)
    assert 2 * 4 * 16 <= ring < 2 * T * 16
    # the delta rule: S per head and the short convolution's last 3 inputs of q, k and v
    assert state_floats(GPT(gpt_config("gated-deltanet", **fields)), T) == H * D * D + 3 * 3 * 16


def test_vector_gpt_is_causal_and_shaped():
    torch.manual_seed(0)
    model = VectorGPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=9, vocab_size=1), in_dim=3)
    assert "wte" not in model.gpt.transformer and model.gpt.lm_head is None
    x = torch.randn(2, 9, 3)
    y = model(x)
    assert y.shape == (2, 9, 1)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, 4, 3)
    torch.testing.assert_close(model(x2)[:, :5], y[:, :5])  # the future does not leak back
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randn(1, 10, 3))
    with pytest.raises(ValueError, match=r"\[B, T, 3\]"):
        model(torch.randn(1, 4, 2))


def test_vector_gpt_without_positions_takes_any_length():
    model = VectorGPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=4, vocab_size=1, pos_embedding="none"),
                      in_dim=3)
    assert model(torch.randn(2, 12, 3)).shape == (2, 12, 1)
