import json
import os

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lintrans.models import GPT, GPTConfig  # noqa: E402
from lintrans.models.hf import (  # noqa: E402
    AttentionSwapWarning,
    from_pretrained,
    load_model,
    save_hf,
    save_model,
    state_dict_from_hf,
)

VOCAB = 97


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def hf_model(activation="gelu_new"):
    """A random GPT-2 with weights far from their init, so GELU or layout mistakes show in the logits."""
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, n_positions=48, vocab_size=VOCAB, activation_function=activation,
        bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if name.endswith("ln_1.weight") else 0.0))
    return model


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def ours_logits(model, idx):
    model.eval()
    with torch.no_grad():
        return model(idx)[0]


def test_logits_equal_huggingface_gpt2(tmp_path):
    hf = hf_model()
    save_dir = tmp_path / "hf"
    hf.save_pretrained(save_dir)
    ours = load_model(save_dir)
    assert ours.config.gelu_approximate == "tanh" and ours.config.vocab_size == VOCAB
    idx = torch.randint(0, VOCAB, (2, 48))
    ref = hf_logits(hf, idx)
    assert ref.abs().max() > 1.0  # not a degenerate comparison
    assert (ours_logits(ours, idx) - ref).abs().max() <= 1e-4
    # exact-erf GELU is measurably different: the comparison above can tell them apart
    erf = load_model(save_dir, gelu_approximate="none")
    assert (ours_logits(erf, idx) - ref).abs().max() > 1e-4


def test_exact_gelu_huggingface_config_maps_to_none(tmp_path):
    hf = hf_model(activation="gelu")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.gelu_approximate == "none"
    idx = torch.randint(0, VOCAB, (1, 20))
    assert (ours_logits(ours, idx) - hf_logits(hf, idx)).abs().max() <= 1e-4


@pytest.mark.parametrize("safe", [True, False])
def test_save_hf_round_trips_and_transformers_reads_it(tmp_path, safe):
    hf = hf_model()
    ours = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=48, vocab_size=VOCAB))
    ours.load_state_dict(state_dict_from_hf(hf.state_dict()), strict=False)
    save_hf(ours, tmp_path, safe_serialization=safe)
    expected = "model.safetensors" if safe else "pytorch_model.bin"
    assert (tmp_path / expected).is_file() and not list(tmp_path.glob("*.tmp"))
    idx = torch.randint(0, VOCAB, (2, 30))
    again = load_model(tmp_path)
    assert torch.equal(ours_logits(again, idx), ours_logits(ours, idx))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert (hf_logits(theirs, idx) - ours_logits(ours, idx)).abs().max() <= 1e-4
    # end-of-text ids the vocabulary has: GPT-2's 50256, bytes' 256, none in a smaller one
    assert theirs.config.eos_token_id is None or theirs.config.eos_token_id < VOCAB


@pytest.mark.parametrize("vocab, eot", [(50304, 50256), (320, 256), (100, None)])
def test_save_hf_names_an_end_of_text_id_the_vocabulary_has(tmp_path, vocab, eot):
    import json

    save_hf(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=vocab)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == eot


@pytest.mark.filterwarnings("ignore::lintrans.models.hf.AttentionSwapWarning")  # tested on its own elsewhere
@pytest.mark.parametrize("saved, load", [
    (dict(attention="gated-linear"), dict(attention="softmax")),
    (dict(attention="linear", attention_options={"feature_map": "hedgehog"}),
     dict(attention_options={"feature_map": "elu"})),
])
def test_a_swap_leaves_out_the_old_attention_own_parameters(tmp_path, saved, load):
    """A gate or feature-map modules have no place in the new attention: left out with a warning, every
    shared weight loaded."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11, **saved))
    save_model(model, tmp_path)
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) of the attention it was trained with are not used"):
        again = from_pretrained(tmp_path, **load)
    assert torch.equal(again.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight)


def test_untied_embeddings_are_refused(tmp_path):
    """Our lm_head is wte: loading a GPT-2 with its own lm_head matrix would keep one of the two."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, n_positions=8, vocab_size=11, tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tie_word_embeddings=False is not supported"):
        from_pretrained(tmp_path)


def test_save_hf_refuses_what_gpt2_cannot_express(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11, attention="linear"))
    with pytest.raises(ValueError, match="cannot express attention='linear'.*save_model"):
        save_hf(model, tmp_path)
    rev = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11, reversible=True))
    with pytest.raises(ValueError, match="cannot express reversible=True"):
        save_hf(rev, tmp_path)


def test_lintrans_checkpoint_round_trip_with_learned_feature_map(tmp_path):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=23, attention="linear",
                    attention_options={"feature_map": "hedgehog"} if _has_module_maps() else {}, n_kv_head=1,
                    mlp="swiglu")
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_model(model, tmp_path, extra_config={"train": {"lr": 1e-3}})
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["model"] == cfg.to_dict() and cfg_json["train"] == {"lr": 1e-3}
    again = load_model(tmp_path)
    assert again.config == cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    # a plain GPTConfig dict as config.json (no "model" key) is accepted too
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert load_model(tmp_path).config == cfg


def _has_module_maps():
    from lintrans.nn.attention import feature_map_names

    return "hedgehog" in feature_map_names()


def nanogpt_checkpoint(path, compiled=True):
    """What nanoGPT's train.py saves: exact-erf GELU model, maybe torch.compile-prefixed keys."""
    args = dict(n_layer=2, n_head=2, n_embd=16, block_size=20, bias=False, vocab_size=29, dropout=0.0)
    ref = GPT(GPTConfig(**args, gelu_approximate="none"))
    prefix = "_orig_mod." if compiled else ""
    state = {prefix + k: v for k, v in ref.state_dict().items()}
    state[prefix + "transformer.h.0.attn.bias"] = torch.ones(1, 1, 20, 20).tril()  # non-flash mask buffer
    torch.save({"model": state, "model_args": args, "iter_num": 5, "best_val_loss": torch.tensor(2.0),
                "config": {"dataset": "shakespeare"}}, path)
    return ref


@pytest.mark.parametrize("compiled", [True, False])
def test_nanogpt_checkpoint(tmp_path, compiled):
    ref = nanogpt_checkpoint(tmp_path / "ckpt.pt", compiled)
    model = load_model(tmp_path / "ckpt.pt")
    assert model.config.gelu_approximate == "none" and model.config.bias is False
    idx = torch.randint(0, 29, (2, 20))
    assert torch.equal(ours_logits(model, idx), ours_logits(ref, idx))
    assert load_model(tmp_path).config == model.config  # a folder holding ckpt.pt


def test_mismatched_checkpoints_fail_clearly(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["n_embd"] = 64
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"shape mismatches: \['transformer.wte.weight: \(97, 32\) in"):
        load_model(tmp_path / "hf")

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=23))
    save_model(model, tmp_path / "lt")
    cfg = json.loads((tmp_path / "lt" / "config.json").read_text())
    cfg["model"]["n_layer"] = 3
    (tmp_path / "lt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing keys: \['transformer.h.2"):
        load_model(tmp_path / "lt")
    cfg["model"]["n_layer"] = 1
    (tmp_path / "lt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unexpected keys: \['transformer.h.1"):
        load_model(tmp_path / "lt")
    with pytest.raises(ValueError, match=r"cannot override \['n_layer'\]"):
        load_model(tmp_path / "lt", n_layer=2)
    with pytest.raises(ValueError, match=r"attention_options\['qk_dim'\] = 4 would change c_attn's shape"):
        load_model(tmp_path / "lt", attention="linear", attention_options={"qk_dim": 4})
    with pytest.raises(FileNotFoundError, match="neither config.json"):
        (tmp_path / "empty").mkdir()
        load_model(tmp_path / "empty")


def fake_hf_cache(root, name="gpt2"):
    snap = root / "hub" / f"models--{name.replace('/', '--')}" / "snapshots" / "abc123"
    hf = hf_model()
    hf.save_pretrained(snap)
    (root / "hub" / f"models--{name.replace('/', '--')}" / "refs").mkdir()
    (root / "hub" / f"models--{name.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    return hf


def test_from_pretrained_reads_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    hf = fake_hf_cache(tmp_path)
    model = GPT.from_pretrained("gpt2")
    idx = torch.randint(0, VOCAB, (1, 16))
    assert (ours_logits(model, idx) - hf_logits(hf, idx)).abs().max() <= 1e-4
    # HF_HUB_CACHE wins over HF_HOME
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="elsewhere.*models--gpt2.*never downloads"):
        GPT.from_pretrained("gpt2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert GPT.from_pretrained("gpt2").config.n_embd == 32
    with pytest.raises(FileNotFoundError, match="models--openai-community--gpt2-xl"):
        GPT.from_pretrained("openai-community/gpt2-xl")
    # a mistyped path is a missing path, not a model name to look up in the cache
    for path in (str(tmp_path / "no-such-run"), "./typo/checkpoint", tmp_path / "absent"):
        with pytest.raises(FileNotFoundError, match="^name_or_path '.*(no-such-run|typo/checkpoint|absent)': no such "
                                                    "file or folder"):
            GPT.from_pretrained(path)
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is expanded: a saved model under the home folder loads
    save_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11)), tmp_path / "mine")
    assert GPT.from_pretrained("~/mine").config.n_embd == 16


def test_linearising_keeps_every_weight(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    fake_hf_cache(tmp_path)
    soft = GPT.from_pretrained("gpt2")
    opts = {"feature_map": "rebased"} if _has_module_maps() else {"feature_map": "softplus"}
    with pytest.warns(AttentionSwapWarning, match="trained with 'softmax' attention and is loaded with 'linear'"):
        lin = GPT.from_pretrained("gpt2", attention="linear", attention_options=opts)
    assert lin.config.attention == "linear"
    assert isinstance(lin.transformer.h[0].attn, type(GPT(lin.config).transformer.h[0].attn))
    soft_sd = soft.state_dict()
    for k, v in lin.state_dict().items():
        if k in soft_sd:
            assert torch.equal(v, soft_sd[k]), k
        else:
            assert ".attn.phi_" in k  # only the feature map's own parameters are new
    idx = torch.randint(0, VOCAB, (1, 16))
    assert not torch.allclose(ours_logits(lin, idx), ours_logits(soft, idx))


def test_bin_weights_are_loaded_safely(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)  # config.json; then swap the weights for the older .bin format
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = load_model(tmp_path)
    idx = torch.randint(0, VOCAB, (1, 10))
    assert (ours_logits(ours, idx) - hf_logits(hf, idx)).abs().max() <= 1e-4

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    # a pickle that is not plain tensors is refused by weights_only loading
    torch.save({"transformer.wte.weight": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_model(tmp_path)


def test_swapping_attention_leaves_out_saved_options_the_new_one_cannot_take(tmp_path):
    """Options the new mechanism does not have, or has with other values (linear's form="attention"
    is not a delta-rule form), are left out with a warning; the rest carry over."""
    saved = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64, attention="linear",
                          attention_options={"form": "attention", "chunk_size": 8, "feature_map": "elu"}))
    save_model(saved, tmp_path)
    with pytest.warns(UserWarning, match=r"\['feature_map', 'form'\] of 'linear' are not options of 'deltanet'"):
        loaded = load_model(tmp_path, attention="deltanet")
    assert loaded.config.attention_options == {"chunk_size": 8}


def test_swapping_attention_keeps_options_that_work_only_together(tmp_path):
    """A feature map and its options carry over as a pair: alone, neither builds."""
    saved = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64, attention="linear",
                          attention_options={"feature_map": "performer", "feature_map_options": {"num_features": 8}}))
    save_model(saved, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(tmp_path, attention="retention")
    assert loaded.config.attention_options == {"feature_map": "performer", "feature_map_options": {"num_features": 8}}


def shard_as_bin(folder):
    """The older sharded format: pytorch_model-0000N-of-0000M.bin files and their index."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        torch.save(load_file(str(folder / shard)), folder / shard.replace("model", "pytorch_model").replace(
            ".safetensors", ".bin"))
        (folder / shard).unlink()
    index["weight_map"] = {k: v.replace("model", "pytorch_model").replace(".safetensors", ".bin")
                           for k, v in index["weight_map"].items()}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors.index.json").unlink()


@pytest.mark.parametrize("safe", [True, False])
def test_sharded_huggingface_folders_load(tmp_path, monkeypatch, safe):
    """transformers' save_pretrained with a shard limit writes an index and several files (gpt2-large
    and -xl are shared that way): loaded as one, also from the local cache."""
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    if not safe:
        shard_as_bin(tmp_path / "hf")
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    assert (tmp_path / "hf" / index).is_file() and len(list((tmp_path / "hf").glob("*-of-*"))) > 2
    idx = torch.randint(0, VOCAB, (1, 16))
    assert (ours_logits(load_model(tmp_path / "hf"), idx) - hf_logits(hf, idx)).abs().max() <= 1e-4
    snap = tmp_path / "hub" / "models--tiny--sharded" / "snapshots" / "abc"
    snap.parent.mkdir(parents=True)
    (tmp_path / "hf").rename(snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert GPT.from_pretrained("tiny/sharded").config.n_embd == 32
    shards = json.loads((snap / index).read_text())["weight_map"]
    (snap / sorted(set(shards.values()))[-1]).unlink()
    with pytest.raises(ValueError, match=r"names the shard .*-of-.*, which is missing"):
        load_model(snap)
    (snap / index).write_text(json.dumps({"weight_map": {"a": index}}))  # itself: not a weights file
    with pytest.raises(ValueError, match="that is not a weights file beside it"):
        load_model(snap)


def test_damaged_nanogpt_checkpoints_and_hf_configs_fail_in_one_line(tmp_path):
    nanogpt_checkpoint(tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    for name, content in (("cut.pt", data[: len(data) // 2]), ("empty.pt", b"")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name} cannot be read as a nanoGPT checkpoint: \S"):
            load_model(tmp_path / name)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"model": Evil(), "model_args": {}}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="evil.pt cannot be read as a nanoGPT checkpoint"):
        load_model(tmp_path / "evil.pt")
    hf_model().save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "n_head": 3}))
    with pytest.raises(ValueError, match=r"hf/config.json: .*divisible by n_head \(3\)"):
        load_model(tmp_path / "hf")


def test_an_lm_head_other_than_the_embedding_is_refused(tmp_path):
    """A GPT-2 file whose config says tied but whose lm_head.weight differs (a fine-tune saved
    untied): the GPT has one matrix for both, so loading either silently changed the model."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=8,
                                                                 vocab_size=11))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1.0
    model.config.save_pretrained(tmp_path)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items() if not k.endswith(".attn.bias")},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight that differs from the token embedding"):
        from_pretrained(tmp_path)


def test_overriding_some_attention_options_names_the_saved_ones_left_out(tmp_path):
    """attention_options replace the saved ones as a whole: a saved feature map left out would become
    elu; the load says so (it was silent) and keeps them when they are given."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11, attention="linear",
                          attention_options={"feature_map": "softplus", "chunk_size": 4}))
    save_model(model, tmp_path)
    with pytest.warns(UserWarning, match=r"\{'feature_map': 'softplus'\} are not given and take their defaults"):
        load_model(tmp_path, attention_options={"chunk_size": 8})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_model(tmp_path, attention_options={"feature_map": "softplus", "chunk_size": 8})
    assert again.config.attention_options == {"feature_map": "softplus", "chunk_size": 8}


def test_weights_and_config_of_different_saves_are_refused(tmp_path):
    """save_model writes two files, each atomically; a save killed between them, over an older one,
    left one save's weights under the other's config, which loaded as the wrong model."""
    a = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11))
    b = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11, attention="linear"))
    save_model(a, tmp_path / "a")
    save_model(b, tmp_path / "b")
    load_model(tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").write_bytes((tmp_path / "b" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="come from different saves"):
        load_model(tmp_path / "a")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    del config["save_id"]  # a folder saved before the id: loads as before
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    load_model(tmp_path / "b")


def test_saves_carry_their_format_and_a_newer_one_is_refused_by_name(tmp_path):
    from lintrans.models.hf import MODEL_FORMAT

    save_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["lintrans_format"] == MODEL_FORMAT == 1
    for fmt, match in ((MODEL_FORMAT + 1, "written by a newer lintrans \\(model format 2"), ("1", "must be an int")):
        (tmp_path / "config.json").write_text(json.dumps({**config, "lintrans_format": fmt}))
        with pytest.raises(ValueError, match=match):
            load_model(tmp_path)
    del config["lintrans_format"]  # saved before the format was written: format 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    load_model(tmp_path)


def test_a_gpt2_config_without_model_type_loads_and_meta_is_refused(tmp_path):
    """transformers loads a GPT-2 config.json without model_type; it was read as a flat lintrans
    config and refused with 'unknown GPTConfig keys'. Loading under torch.device('meta') returned a
    model whose weights were dropped, with torch's warnings only."""
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    idx = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        assert (load_model(tmp_path).eval()(idx)[0] - hf(idx).logits).abs().max() < 1e-4
    with torch.device("meta"), pytest.raises(ValueError, match="meta device builds no weights"):
        load_model(tmp_path)


def test_tied_weights_with_a_nan_are_not_called_untied(tmp_path):
    """NaN != NaN: a tied state with a NaN in its embedding was refused as 'untied weights'."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11))
    state = model.state_dict()
    state["transformer.wte.weight"][0, 0] = float("nan")
    state = {**state, "lm_head.weight": state["transformer.wte.weight"].clone()}
    from lintrans.models.hf import load_state_dict_checked

    load_state_dict_checked(GPT(model.config), state)


def test_the_tokenizer_of_gpt2_weights_without_model_type(tmp_path):
    from lintrans.models.hf import trained_tokenizer

    hf_model().config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model_type"]
    config["vocab_size"] = 50257
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert trained_tokenizer(tmp_path) == "gpt2"
