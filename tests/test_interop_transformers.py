"""lintrans.interop.transformers: our delta rule as transformers' Gated DeltaNet functions (same signature,
grouped value heads) and inside a tiny randomly initialised Qwen3-Next model (prefill and cached decoding)."""
import pytest
import torch

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

import lintrans.interop.transformers as interop  # noqa: E402
from lintrans.interop.transformers import (  # noqa: E402
    chunk_gated_delta_rule,
    patch_qwen3_next,
    patched_qwen3_next,
    recurrent_gated_delta_rule,
    unpatch_qwen3_next,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def grouped_case(B, T, Hk, Hv, Dk, Dv, seed=0, dtype=torch.float32):
    g = gen(seed)
    q, k = (torch.randn(B, T, Hk, Dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, Hv, Dv, generator=g)
    beta = torch.rand(B, T, Hv, generator=g)
    ld = -2 * torch.rand(B, T, Hv, generator=g)
    S0 = torch.randn(B, Hv, Dk, Dv, generator=g)
    return [x.to(dtype) for x in (q, k, v, beta, ld)] + [S0]


def assert_close(x, y, rel, what):
    err = (x.double() - y.double()).abs().max().item()
    tol = rel * max(1.0, y.double().abs().max().item())
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 6), (1, 3)])
@pytest.mark.parametrize("T,chunk", [(1, 64), (45, 16), (64, 64)])
@pytest.mark.parametrize("l2", [True, False])
def test_functions_equal_transformers(Hk, Hv, T, chunk, l2):
    q, k, v, beta, g, S0 = grouped_case(2, T, Hk, Hv, 8, 6)
    if not l2:
        k = k / (k.norm(dim=-1, keepdim=True) * 1.1)
    kw = dict(g=g, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o_ref, S_ref = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, chunk_size=chunk, **kw)
    o, S = chunk_gated_delta_rule(q, k, v, chunk_size=chunk, **kw)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and S.shape == S_ref.shape
    assert_close(o, o_ref, 2e-5, "chunk o")
    assert_close(S, S_ref, 2e-5, "chunk S")
    o_ref, S_ref = qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, **kw)
    o, S = recurrent_gated_delta_rule(q, k, v, **kw)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert_close(o, o_ref, 2e-5, "recurrent o")
    assert_close(S, S_ref, 2e-5, "recurrent S")


def test_grouping_is_transformers_order():
    """Value head h reads key head h // (Hv // Hk) (repeat_interleave), not h % Hk (repeat): a case where
    the two differ, so a wrong grouping fails."""
    q, k, v, beta, g, S0 = grouped_case(1, 20, 2, 4, 8, 8, seed=3)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o_ref, _ = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    wrong, _ = qwen3_next.torch_chunk_gated_delta_rule(q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1), v, g, beta,
                                                       use_qk_l2norm_in_kernel=True)
    assert_close(o, o_ref, 2e-5, "o")
    assert (o - wrong).abs().max() > 1e-2


def test_gradients_equal_transformers():
    base = grouped_case(1, 30, 2, 4, 8, 6)
    outs = []
    for fn in (chunk_gated_delta_rule, qwen3_next.torch_chunk_gated_delta_rule):
        leaves = [x.clone().requires_grad_() for x in base]
        q, k, v, beta, g, S0 = leaves
        o, S = fn(q, k, v, g=g, beta=beta, chunk_size=16, initial_state=S0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        loss = (o * torch.randn(o.shape, generator=gen(1))).sum() + (S * torch.randn(S.shape, generator=gen(2))).sum()
        outs.append(torch.autograd.grad(loss, leaves))
    for name, a, b in zip(["q", "k", "v", "beta", "g", "initial_state"], *outs):
        assert_close(a, b, 1e-4, f"d{name}")


def test_low_precision_and_no_state():
    q, k, v, beta, g, _ = grouped_case(1, 33, 2, 4, 8, 8, dtype=torch.bfloat16)
    o, S = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, use_qk_l2norm_in_kernel=True)
    o_ref, _ = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, use_qk_l2norm_in_kernel=True)
    assert S is None and o.dtype == torch.bfloat16
    # both compute in float32 and round to bf16: a few bf16 steps (2^-8) of the output's own size
    err, size = (o.double() - o_ref.double()).abs().max().item(), o_ref.double().abs().max().item()
    assert err <= 4 * 2**-8 * size, f"o: max abs error {err:.3g} against outputs up to {size:.3g}"
    _, S = recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g=g[:, :1].float(), beta=beta[:, :1],
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert S.dtype == torch.float32


def test_bad_input():
    q, k, v, beta, g, _ = grouped_case(1, 4, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, beta, g, _ = grouped_case(1, 4, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="log_decay"):
        chunk_gated_delta_rule(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="beta"):
        recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], 3 * beta[:, :1] + 2)
    chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, some_other_kwarg=1)  # ignored, as transformers
    with pytest.raises(TypeError, match="model"):
        patch_qwen3_next("model")
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        patch_qwen3_next(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------ the model


def tiny_model(seed=0, dtype=torch.float32):
    """Two Gated DeltaNet layers with grouped value heads (2 key heads, 4 value heads, Dk != Dv), one
    full-attention layer, a small MoE; weights larger than the default init so the delta rule's output
    matters to the logits."""
    cfg = Qwen3NextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_position_embeddings=256, initializer_range=0.2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )
    torch.manual_seed(seed)
    return Qwen3NextForCausalLM(cfg).to(dtype).eval()


@pytest.fixture
def calls(monkeypatch):
    """Counts of our op's calls from the interop functions: proof that the patched model runs ours."""
    counts = {"delta_rule": 0, "delta_rule_step": 0}
    for name in counts:
        fn = getattr(interop, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            counts[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(interop, name, counted)
    return counts


def decode(model, ids, prefill):
    """Logits of a prefill of ``prefill`` tokens, then one token at a time through the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        cache, logits = out.cache, [out.logits]
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def test_prefill_logits_equal_transformers(calls):
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 150), generator=gen(4))
    with torch.no_grad():
        ref = model(ids).logits
        assert patch_qwen3_next(model) == 2
        ours = model(ids).logits
    assert calls["delta_rule"] == 2
    assert_close(ours, ref, 1e-4, "logits")
    # the delta rule matters here: a model whose layers ignore their state gives other logits
    unpatch_qwen3_next(model)
    with torch.no_grad():
        for layer in (0, 2):
            model.model.layers[layer].linear_attn.A_log.data += 5.0  # much faster forgetting
        changed = model(ids).logits
    assert (changed - ref).abs().max() > 1e-2


def test_decoding_logits_equal_transformers(calls):
    model = tiny_model(seed=1)
    ids = torch.randint(0, 97, (2, 40), generator=gen(5))
    ref = decode(model, ids, prefill=30)
    with patched_qwen3_next(model):
        ours = decode(model, ids, prefill=30)
    assert calls["delta_rule_step"] == 2 * 10 and calls["delta_rule"] == 2
    assert_close(ours, ref, 1e-4, "decoded logits")
    with torch.no_grad():
        full = model(ids).logits
    assert_close(ours, full, 1e-4, "decoded vs one pass")


def test_a_copy_of_a_patched_model_runs_its_own_weights(calls):
    """The patch is a method bound to each layer: copy.deepcopy rebinds it to the copy's layer."""
    import copy

    model = tiny_model()
    patch_qwen3_next(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in (0, 2):
            twin.model.layers[layer].linear_attn.A_log.data += 5.0
    ids = torch.randint(0, 97, (1, 20), generator=gen(7))
    with torch.no_grad():
        a, b = model(ids).logits, twin(ids).logits
    assert calls["delta_rule"] == 4  # both ran ours
    assert (a - b).abs().max() > 1e-2  # and each its own weights
    unpatch_qwen3_next(twin)
    with torch.no_grad():
        assert_close(twin(ids).logits, b, 1e-4, "the copy unpatched")


def test_a_layer_with_its_own_forward_hook_is_patched_around_it(calls):
    """accelerate's offloading sets an instance-level forward on layers with parameters: ours wraps
    it, calls it, and unpatch puts it back."""
    import functools

    model = tiny_model()
    layer = model.model.layers[2].linear_attn
    seen = []

    def hook(module, *args, **kwargs):
        seen.append(1)
        return type(module).forward(module, *args, **kwargs)

    layer.forward = functools.partial(hook, layer)
    ids = torch.randint(0, 97, (1, 20), generator=gen(8))
    with torch.no_grad():
        ref = model(ids).logits
        assert patch_qwen3_next(model) == 2
        ours = model(ids).logits
    assert seen == [1, 1] and calls["delta_rule"] == 2  # the hook ran both times, ours inside it
    assert_close(ours, ref, 1e-4, "logits")
    unpatch_qwen3_next(model)
    assert isinstance(layer.__dict__["forward"], functools.partial)


def _gdn_layers(model):
    return [model.model.layers[i].linear_attn for i in (0, 2)]


def test_threads_running_a_patched_and_an_unpatched_model_at_once(calls):
    """Each layer call waits for the other thread's, so the two models' layers run at the same time: the
    unpatched one must still run transformers' function, and nothing stays swapped afterwards (a swap
    of the module's globals per call got both wrong)."""
    import functools
    import threading

    model, other = tiny_model(seed=0), tiny_model(seed=1)
    ids = torch.randint(0, 97, (1, 30), generator=gen(9))
    with torch.no_grad():
        ref_model, ref_other = model(ids).logits, other(ids).logits
    barrier = threading.Barrier(2, timeout=120)

    def in_step(module, *args, **kwargs):
        barrier.wait()
        return type(module).forward(module, *args, **kwargs)

    for layer in _gdn_layers(model) + _gdn_layers(other):
        layer.forward = functools.partial(in_step, layer)
    patch_qwen3_next(model)
    out, errors = {}, []

    def run(name, m):
        try:
            with torch.no_grad():
                out[name] = m(ids).logits
        except BaseException as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=a) for a in (("model", model), ("other", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert calls["delta_rule"] == 2  # the patched model's two layers, not the other's
    assert_close(out["model"], ref_model, 1e-4, "patched model's logits")
    assert torch.equal(out["other"], ref_other)  # transformers' own function, bit for bit
    unpatch_qwen3_next(model)
    for layer in _gdn_layers(model) + _gdn_layers(other):
        layer.forward = functools.partial(type(layer).forward, layer)
    with torch.no_grad():
        model(ids), other(ids)
    assert calls["delta_rule"] == 2  # nothing left running ours


def test_a_compiled_patched_model_runs_ours(calls):
    """torch.compile reads the layers' globals as it traces: the patched model must still reach ours."""
    model = tiny_model()
    ids = torch.randint(0, 97, (1, 20), generator=gen(10))
    with torch.no_grad():
        ref = model(ids).logits
        patch_qwen3_next(model)
        torch._dynamo.reset()
        try:
            got = torch.compile(model, backend="eager")(ids).logits
        finally:
            torch._dynamo.reset()
    assert calls["delta_rule"] == 2
    assert_close(got, ref, 1e-4, "compiled logits")


def test_a_hook_installed_after_patching_survives_unpatch(calls):
    """accelerate's add_hook_to_module after patching keeps ours as its _old_forward: unpatch leaves the
    hook's chain whole (ours then calls through), its remove_hook_from_module leaves a working layer, and
    patching again runs ours again."""
    import functools

    model = tiny_model()
    layer = model.model.layers[0].linear_attn
    ids = torch.randint(0, 97, (1, 20), generator=gen(11))
    with torch.no_grad():
        ref = model(ids).logits
    patch_qwen3_next(model)
    seen = []

    def hooked(module, *args, **kwargs):  # accelerate's new_forward, in short
        seen.append(1)
        return module._old_forward(*args, **kwargs)

    layer._old_forward = layer.forward
    layer.forward = functools.partial(hooked, layer)
    assert unpatch_qwen3_next(model) == 2
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)  # transformers' functions again
    assert seen == [1] and calls["delta_rule"] == 0
    layer.forward = layer._old_forward  # remove_hook_from_module
    del layer._old_forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    assert patch_qwen3_next(model) == 2
    with torch.no_grad():
        assert_close(model(ids).logits, ref, 1e-4, "patched again")
    assert calls["delta_rule"] == 2


def test_a_saved_patched_model_loads_and_runs_ours(calls, monkeypatch):
    """torch.save / pickle of a patched model (its layers' forward stored by name), loaded where the
    module's functions are transformers' own again, as in a new process."""
    import io
    import pickle

    model = tiny_model()
    ids = torch.randint(0, 97, (1, 20), generator=gen(12))
    with torch.no_grad():
        ref = model(ids).logits
    patch_qwen3_next(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for name in interop._GLOBAL_NAMES:  # a fresh process: no dispatcher installed yet
        monkeypatch.setattr(qwen3_next, name, getattr(qwen3_next, name).__wrapped__)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert_close(loaded(ids).logits, ref, 1e-4, "loaded logits")
        assert_close(twin(ids).logits, ref, 1e-4, "unpickled logits")
    assert calls["delta_rule"] == 4
    assert unpatch_qwen3_next(loaded) == 2
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)


def test_unpatch_and_context_manager_restore_transformers(calls):
    model, other = tiny_model(), tiny_model()
    ids = torch.randint(0, 97, (1, 20), generator=gen(6))
    with patched_qwen3_next(model):
        with torch.no_grad():
            other(ids)  # another model of the class: still transformers' functions
        assert calls["delta_rule"] == 0
        with torch.no_grad():
            model(ids)
        assert calls["delta_rule"] == 2  # one per Gated DeltaNet layer
    assert qwen3_next.torch_chunk_gated_delta_rule is not chunk_gated_delta_rule
    with torch.no_grad():
        model(ids)
    assert calls["delta_rule"] == 2  # unpatched on leaving the block
    assert patch_qwen3_next(model) == patch_qwen3_next(model) == 2  # idempotent
    assert unpatch_qwen3_next(model) == 2 and unpatch_qwen3_next(model) == 0


def test_bf16_model_runs_and_agrees():
    model = tiny_model(seed=2, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (1, 70), generator=gen(7))
    with torch.no_grad():
        ref = model(ids).logits
        with patched_qwen3_next(model):
            ours = model(ids).logits
    assert ours.dtype == torch.bfloat16
    assert_close(ours, ref, 5e-2, "bf16 logits")


def test_older_layers_with_function_attributes():
    """transformers 4 stored the two functions on the layer (``self.chunk_gated_delta_rule``) and called
    those: patching replaces the attributes and unpatching puts them back."""

    class OldLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.chunk_gated_delta_rule = qwen3_next.torch_chunk_gated_delta_rule
            self.recurrent_gated_delta_rule = qwen3_next.torch_recurrent_gated_delta_rule

        def forward(self, q, k, v, g, beta):
            return self.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    layer = OldLayer()
    assert patch_qwen3_next(layer) == 1
    assert layer.chunk_gated_delta_rule is chunk_gated_delta_rule
    q, k, v, beta, g, _ = grouped_case(1, 10, 2, 4, 8, 8)
    assert_close(layer(q, k, v, g, beta), qwen3_next.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0], 2e-5, "o")
    unpatch_qwen3_next(layer)
    assert layer.chunk_gated_delta_rule is qwen3_next.torch_chunk_gated_delta_rule
