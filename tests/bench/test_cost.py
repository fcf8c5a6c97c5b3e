"""The cost model against torch's FlopCounterMode and the model's real parameter count."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lintrans.bench.cost import (
    ModelShape, arithmetic_intensity, attention_core_flops, attention_crossover, cache_bytes, forward_flops, mfu, parameters,
    speedup_bounds, training_flops,
)
from lintrans.models import GPT, GPTConfig
from lintrans.nn import available_attention

CONFIGS = [
    ("softmax", {}, 96, {}),
    ("softmax", {}, 64, {"n_kv_head": 2, "mlp": "swiglu", "bias": False}),
    ("linear", {"form": "chunked", "chunk_size": 32}, 100, {}),  # T not a multiple of the chunk
    ("linear", {"form": "chunked", "chunk_size": 16, "feature_map": "based"}, 48, {}),
    ("linear", {"form": "chunked", "chunk_size": 16, "feature_map": "based", "qk_dim": 8}, 48, {}),  # Based's d'
    ("linear", {"form": "attention"}, 64, {}),
    ("linear", {"form": "attention_blocked", "chunk_size": 16}, 50, {}),
    ("linear", {"form": "state_parallel"}, 40, {}),
    ("gated-linear", {"chunk_size": 16, "qk_dim": 8}, 48, {}),  # the gate's projection; F from qk_dim
    ("none", {}, 64, {}),  # the no-mixing floor: every matmul but the attention
    ("reformer", {"n_buckets": 8, "chunk_size": 16, "n_hashes": 3}, 72, {}),  # one shared qk projection
    ("reformer", {"n_buckets": 1, "chunk_size": 64}, 40, {}),  # one chunk, no hashing
]


def _model(attention, opts, extra):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=500, block_size=128, attention=attention,
                    attention_options=opts, **extra)
    torch.manual_seed(0)
    return GPT(cfg), ModelShape.from_config(cfg)


def counter():
    """FlopCounterMode that also counts the in-place batched products the PyTorch blocks use
    (``baddbmm_``, ``addmm_``): its registry knows only the out-of-place ones."""
    def product(self_shape, a_shape, b_shape, *args, **kwargs):  # a [(b,) m, k] @ b [(b,) k, n]
        batch = a_shape[0] if len(a_shape) == 3 else 1
        return 2 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]

    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={aten.baddbmm_: product, aten.addmm_: product})


@pytest.mark.parametrize("attention,opts,T,extra", CONFIGS)
def test_flops_match_flop_counter(monkeypatch, attention, opts, T, extra):
    # the counter sees torch's matmuls: the PyTorch blocks, not the fused kernel (the same algebra)
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    model, shape = _model(attention, opts, extra)
    idx = torch.randint(0, 500, (2, T))
    # the math backend spells SDPA out in matmuls, which the counter can see on CPU
    with sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad(), counter() as fwd:
            model(idx)
        with counter() as train:
            model(idx, idx)[1].backward()
    assert fwd.get_total_flops() == pytest.approx(forward_flops(shape, T, 2)["total"], rel=0.05)
    # training is modelled as 3x the forward; the chunked blocks' hand-derived backward does up to ~7%
    # more at wide feature maps (Based with qk_dim 8: 45 features against a head of 16)
    assert train.get_total_flops() == pytest.approx(training_flops(shape, T, 2)["total"], rel=0.08)
    if attention != "none":  # the mechanism's own share, which can be a few % of the total: on its own
        floor, floor_shape = _model("none", {}, extra)
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad(), counter() as base:
            floor(idx)
        want = forward_flops(shape, T, 2)["total"] - forward_flops(floor_shape, T, 2)["total"]
        assert fwd.get_total_flops() - base.get_total_flops() == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("attention,opts,T,extra", CONFIGS[:5] + CONFIGS[-1:] + [
    ("gated-linear", {"qk_dim": 8}, 32, {"n_kv_head": 2})])
def test_parameters_match_the_model(attention, opts, T, extra):
    model, shape = _model(attention, opts, extra)
    counts = parameters(shape)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == model.transformer.wte.weight.numel()


def test_softmax_attention_overtakes_at_the_closed_form_context():
    # without the LM head seed 001 gives T = 8D for attention vs matmuls with F = 4D; ours counts
    # the same terms forward: 4 N T^2 h = 24 D^2 T  ->  T = 6D, pushed later by the LM head
    shape = ModelShape(n_layer=12, n_head=12, n_embd=768, vocab_size=1)
    assert attention_crossover(shape) == pytest.approx(6 * 768, abs=1)
    with_head = ModelShape(n_layer=12, n_head=12, n_embd=768, vocab_size=50257)
    assert attention_crossover(with_head) > 6 * 768
    assert attention_crossover(ModelShape(attention="linear", form="chunked")) is None


def test_kv_cache_grows_and_the_state_does_not():
    shape = ModelShape(n_layer=2, n_head=4, n_embd=64)
    small, large = cache_bytes(shape, 256), cache_bytes(shape, 16384)
    assert large == 64 * small == 64 * 2 * 2 * 4 * 16 * 256 * 4
    lin = ModelShape(n_layer=2, n_head=4, n_embd=64, attention="linear")
    assert cache_bytes(lin, 16384) == cache_bytes(lin, 256) == 2 * 4 * 16 * 17 * 4


def test_intensity_and_mfu():
    ai = arithmetic_intensity(ModelShape(), 4096)
    assert ai["softmax attention (flash)"] == pytest.approx(4096 / 4)  # 4 T^2 h / (4 T h * 4 bytes)
    assert ai["decode: softmax over KV cache"] == pytest.approx(0.5)  # reads 2 T h * 4 bytes for 4 T h FLOPs
    assert mfu(1e12, 2.0, 1e12) == 0.5
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 0.0, 1.0)


def test_unknown_attention_rejected():
    with pytest.raises(ValueError, match="attention must be"):
        forward_flops(ModelShape(attention="aft"), 16)


@pytest.mark.parametrize("attention", ["softmax", "linear", "gated-linear", "retention", "sliding-window",
                                       "aft-full", "aft-local", "aft-conv", "aft-simple", "cosformer", "bigbird", "reformer",
                                       "none"])
def test_every_registered_mechanism_reports_its_cost(attention):
    from lintrans.nn.registry import available_attention

    assert attention in available_attention()
    m = ModelShape(n_layer=2, n_head=4, n_embd=64, attention=attention)
    f1, f2 = (forward_flops(m, T)["attention"] for T in (256, 1024))
    assert f1 >= 0 and f2 >= 0
    if attention not in ("aft-local", "aft-conv"):  # those switch to their cheaper banded path as T grows
        assert f2 >= f1
    b1, b2 = cache_bytes(m, 256), cache_bytes(m, 1024)
    assert 0 <= b1 <= b2


def test_cost_follows_the_mechanisms_options():
    from lintrans.bench.cost import attention_core_flops

    narrow = ModelShape(n_layer=1, n_head=4, n_embd=64, attention="sliding-window", attention_options={"window": 16})
    wide = ModelShape(n_layer=1, n_head=4, n_embd=64, attention="sliding-window", attention_options={"window": 64})
    assert attention_core_flops(wide, 4096) == 4 * attention_core_flops(narrow, 4096) == 4 * 4 * 4 * 4096 * 16 * 16
    assert cache_bytes(wide, 4096) == 4 * cache_bytes(narrow, 4096) == 2 * 4 * 16 * 64 * 4  # a ring of w rows (dilation 1)
    gated = ModelShape(n_layer=1, n_head=4, n_embd=64, attention="gated-linear")  # no normaliser, z still kept
    assert cache_bytes(gated, 10) == 4 * 16 * 17 * 4


def test_speedup_bounds():
    soft = ModelShape(n_layer=12, n_head=2, n_embd=128)
    lin = ModelShape(n_layer=12, n_head=2, n_embd=128, attention="linear", chunk_size=64)
    none = ModelShape(n_layer=12, n_head=2, n_embd=128, attention="none")
    b = speedup_bounds(soft, lin, 16384)
    fs, fl, fn = (training_flops(m, 16384)["total"] for m in (soft, lin, none))
    assert b["dense"] == pytest.approx(fs / fl)
    half = fs - training_flops(soft, 16384)["attention"] / 2
    assert b["causal"] == pytest.approx(half / fl) and b["no_mixing"] == pytest.approx(half / fn)
    assert 1 < b["causal"] < b["no_mixing"] < b["dense"] * 2


def test_cost_model_and_config_load_without_torch():
    # `lintrans cost` is arithmetic: it must not pay torch's import (a fresh interpreter checks it)
    import subprocess
    import sys

    code = ("import sys, lintrans.bench.cost, lintrans.models.config, lintrans.train.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("attention", ["linear", "retention", "gated-linear"])
@pytest.mark.parametrize("options", [{}, {"feature_map": "elu", "normalize": True}, {"normalize": False}, {"qk_dim": 6},
                                     {"feature_map": "based", "qk_dim": 4}, {"feature_map": "relu", "normalize": True}])
def test_linear_family_cache_is_what_the_layer_keeps(attention, options):
    """The cost model's cache size equals the bytes of the generation cache a model actually keeps
    (the state S and z, which the op keeps normalised or not), at any length."""
    from lintrans.experiments.models import state_floats
    from lintrans.models import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=20, block_size=64, attention=attention,
                    attention_options=options)
    shape = ModelShape.from_config(cfg)
    kept = state_floats(GPT(cfg), 9) * 4 * cfg.n_layer
    assert kept == cache_bytes(shape, 9) == cache_bytes(shape, 50)


MECHANISM_CASES = [(a, {}) for a in sorted(available_attention())] + [  # every registered mechanism, and options
    ("sliding-window", {"global_tokens": [0, 40]}), ("aft-full", {"per_head": True}),
    ("aft-local", {"window": 8, "per_head": True}), ("aft-conv", {"kernel": 5})]  # that change what a model has or keeps


@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("attention, options", MECHANISM_CASES)
def test_cost_model_counts_what_every_model_has_and_keeps(attention, options, n_kv_head):
    """Parameters (position biases, global projections, gates, convolutions) and the generation cache
    (rings allocated whole, AFT's running maximum, keys repeated over grouped heads, a global prefix) as
    a built model has them, before and after the window fills."""
    if attention == "reformer" and n_kv_head:
        pytest.skip("reformer shares q and k: no grouped heads")
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=20, block_size=256, attention=attention,
                    attention_options=options, n_kv_head=n_kv_head)
    model, shape = GPT(cfg).eval(), ModelShape.from_config(cfg)
    assert parameters(shape)["total"] == sum(p.numel() for p in model.parameters())
    for T in (9, 130):
        with torch.no_grad():
            _, cache = model.forward_cached(torch.zeros(1, T, dtype=torch.long))
        assert cache_bytes(shape, T) == cache.nbytes(), T


def test_banded_aft_flops_follow_the_op():
    """AFT-local/conv run banded (O(T W D)) once the band is smaller than the bias matrix: the FLOPs
    follow that choice instead of counting T^2 at every length."""
    shape = ModelShape(n_layer=1, n_head=4, n_embd=128, attention="aft-conv", attention_options={"kernel": 32})
    short, long = attention_core_flops(shape, 256), attention_core_flops(shape, 65536)
    assert short == 4.0 * 256 * 256 * 128  # the bias matrix is smaller: T^2
    assert long == 4.0 * 65536 * 32 * 128  # the band: linear in T


def test_intensity_reads_keys_and_values_at_the_kv_heads():
    """Grouped-query attention: k and v are read at n_kv_head heads, q and o at n_head (the seed's
    4BHK(TG + S) bytes with G = N / K): fewer bytes, a higher intensity than full multi-head."""
    mha = ModelShape(n_layer=1, n_head=12, n_embd=768)
    gqa = ModelShape(n_layer=1, n_head=12, n_embd=768, n_kv_head=1)
    T, h, N, K = 4096, 64, 12, 1
    want = 4 * N * T * T * h / (2 * T * (N + K) * h * 4)
    assert arithmetic_intensity(gqa, T)["softmax attention (flash)"] == pytest.approx(want)
    assert arithmetic_intensity(mha, T)["softmax attention (flash)"] == pytest.approx(T / 4)
    lin_mha, lin_gqa = (ModelShape(**{**m.__dict__, "attention": "linear"}) for m in (mha, gqa))
    assert (arithmetic_intensity(lin_gqa, T)["linear attention (chunked)"]
            > arithmetic_intensity(lin_mha, T)["linear attention (chunked)"])


def test_intensity_counts_the_qk_width():
    """With qk_dim, q and k are narrower: the chunked op moves fewer bytes and the qkv projection is
    narrower than 3 heads' width."""
    full = ModelShape(n_layer=1, n_head=4, n_embd=256, attention="linear")
    narrow = ModelShape(n_layer=1, n_head=4, n_embd=256, attention="linear", attention_options={"qk_dim": 16})
    a, b = arithmetic_intensity(full, 4096), arithmetic_intensity(narrow, 4096)
    BT, D, width = 4096, 256, (4 + 4) * 16 + 4 * 64
    assert b["qkv projection"] == pytest.approx(2 * BT * D * width / ((BT * D + D * width + BT * width) * 4))
    assert b["qkv projection"] < a["qkv projection"]
    assert b["linear attention (chunked)"] != a["linear attention (chunked)"]
