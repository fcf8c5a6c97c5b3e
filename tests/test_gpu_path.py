"""The GPU path, checked on the CPU: no host syncs on the training hot path, and no tensor made on
the CPU while the inputs are elsewhere (the meta device stands in for CUDA: mixing a meta tensor
with a CPU one raises, and reading a meta value raises). docs/gpu.md says what this does not cover."""
import pytest
import torch

from host_sync import READS_VALUES, CopiesToDevice, HostSyncError, HostSyncs
from lintrans.models import GPT, GPTConfig
from lintrans.nn.registry import available_attention
from lintrans.ops.linear import chunked as linear_chunked
from lintrans.ops import FORMS, linear_attention, linear_attention_reference, validation
from lintrans.ops.aft import aft, aft_reference
from lintrans.ops.cross_entropy import linear_cross_entropy


def random_qkv(B, T, H, Dk, Dv=None, requires_grad=False):
    """float32, as training runs the op (a float64 input would take the float64 path throughout)."""
    q, k, v = (torch.randn(B, T, H, d) for d in (Dk, Dk, Dv or Dk))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))

MODULE_MAPS = {"hedgehog": {}, "rebased": {}, "performer": {"num_features": 8}}


@pytest.fixture
def accelerator_path(monkeypatch):
    """Make the CPU take the code path of a CUDA tensor: no value checks, no value-chosen paths, and
    the chunked op in one block (as ``chunks_per_block`` does on an accelerator), and never the fused
    CPU kernel."""
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    monkeypatch.setattr(validation, "HOST_READ_DEVICES", frozenset())
    monkeypatch.setattr(linear_chunked, "BLOCK_TOKEN_HEADS", 10**9)


# -- the detector itself ------------------------------------------------------------------------

class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 if float(g.sum()) > -1e30 else g


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: float(t.sum()), lambda t: bool(t.sum() > 0), lambda t: int(t.max()),
    lambda t: t[t > 0], lambda t: torch.nonzero(t), lambda t: torch.equal(t, t),
    lambda t: _ReadsInBackward.apply(t.requires_grad_()).sum().backward(),
])
def test_host_sync_detector_catches_reads(read):
    x = torch.randn(4, 3)
    with pytest.raises(HostSyncError):
        with HostSyncs(forbid=True):
            read(x)


def test_host_sync_detector_lets_device_work_through():
    x = torch.randn(4, 3, requires_grad=True)
    with HostSyncs(forbid=True) as syncs:
        (x.softmax(-1) @ x.T).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), 0).sum().backward()
    assert syncs.ops > 5 and not syncs.calls


# -- linear attention ---------------------------------------------------------------------------

def _feature_map(name, D, H):
    """A name, or the (phi_q, phi_k) modules the GPT's layer would build (per head)."""
    if name not in MODULE_MAPS:
        return name
    from lintrans.nn.attention import build_feature_maps

    phi_q, phi_k = build_feature_maps(name, MODULE_MAPS[name], D, H, per_head=True, shared_qk=None)
    return (phi_q, phi_q if phi_k is None else phi_k)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "softplus", "based", "identity", *MODULE_MAPS])
@pytest.mark.parametrize("decay", [None, "gate", "fixed"])
def test_chunked_linear_attention_has_no_host_sync(accelerator_path, feature_map, decay):
    """Forward and backward of the chunked op as a CUDA tensor runs it: T not a multiple of the chunk,
    an initial state, the final state returned; outputs still equal the float64 reference."""
    B, T, H, D = 2, 21, 3, 4
    q, k, v = random_qkv(B, T, H, D, Dv=5, requires_grad=True)
    ld = {None: None, "gate": -torch.rand(B, T, H), "fixed": -torch.rand(H)}[decay]
    if ld is not None:
        ld.requires_grad_()
    fm = _feature_map(feature_map, D, H)
    F = linear_attention(q[:, :1], k[:, :1], v[:, :1], feature_map=fm, form="attention",
                         output_final_state=True)[1][0].shape[2]
    S0 = (torch.rand(B, H, F, 5), torch.rand(B, H, F))
    kw = dict(feature_map=fm, initial_state=S0, log_decay=ld, normalize=feature_map != "identity")
    with HostSyncs(forbid=True) as syncs:
        o, (S, z) = linear_attention(q, k, v, form="chunked", chunk_size=8, output_final_state=True, **kw)
        (o.square().sum() + S.sum() + z.sum()).backward()
    assert syncs.ops > 50
    o_ref, (S_ref, _) = linear_attention_reference(q.detach(), k.detach(), v.detach(), **kw)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-4)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_on_the_cpu_only_the_log_decay_check_reads_values():
    """The CPU path checks log_decay's values (free there); that is its only host read."""
    q, k, v = random_qkv(1, 9, 2, 4, requires_grad=True)
    with HostSyncs() as syncs:
        o, _ = linear_attention(q, k, v, chunk_size=4, log_decay=-torch.rand(1, 9, 2))
        o.sum().backward()
    assert syncs.calls and all(" check_log_decay: " in where[-1] for _, where in syncs.calls), syncs.report()
    with pytest.raises(ValueError, match="log_decay must be finite and <= 0"):
        linear_attention(q, k, v, log_decay=torch.full((1, 9, 2), 0.5))


def test_accelerator_path_skips_value_checks(accelerator_path):
    """What a CUDA tensor is not checked for (each would be a sync): log_decay values, target and
    token ids out of range. The GPT's embedding and the loss's gather fail on the device instead."""
    q, k, v = random_qkv(1, 9, 2, 4)
    linear_attention(q, k, v, log_decay=torch.full((1, 9, 2), 0.5))  # no error: not read
    with pytest.raises(ValueError, match="log_decay must have shape"):  # shapes are still checked
        linear_attention(q, k, v, log_decay=torch.zeros(1, 9, 3))
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with HostSyncs(forbid=True):
        linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4]))


def test_aft_simple_without_host_reads_is_exact_for_any_keys(accelerator_path):
    """On an accelerator causal AFT-simple always takes the log-space scans: no path chosen from the
    keys' values, and exact for ordinary keys and for a huge one late in the sequence alike."""
    q, k, v = random_qkv(2, 40, 2, 4, requires_grad=True)
    with torch.no_grad():
        k[:, 30, 0, 1] += 500.0
    for keys in (k, k / 100):
        with HostSyncs(forbid=True):
            o = aft(q, keys, v, variant="simple")
            o.sum().backward()
        torch.testing.assert_close(o.double(), aft_reference(q, keys, v, variant="simple"), rtol=1e-5, atol=1e-5)


# -- the GPT ----------------------------------------------------------------------------------

def _gpt(attention, device=None, **options):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=64, attention=attention,
                    attention_options=options)
    with torch.device(device or "cpu"):
        return GPT(cfg)


@pytest.mark.parametrize("attention", sorted(set(available_attention()) - READS_VALUES))
def test_gpt_training_forward_backward_has_no_host_sync(accelerator_path, attention):
    torch.manual_seed(0)
    model = _gpt(attention)
    x = torch.randint(0, 64, (2, 24))
    with HostSyncs(forbid=True) as syncs:
        _, loss = model(x, x, return_logits=False)
        loss.backward()
    assert syncs.ops > 50 and torch.isfinite(loss)


@pytest.mark.parametrize("attention", sorted(READS_VALUES))
def test_aft_with_a_position_bias_reads_one_value_per_layer(accelerator_path, attention):
    """The documented exception: one host read per layer and call, nowhere else."""
    model = _gpt(attention)
    x = torch.randint(0, 64, (2, 24))
    with HostSyncs() as syncs:
        model(x, x, return_logits=False)[1].backward()
    assert len(syncs.calls) == model.config.n_layer, syncs.report()
    assert all(" _aft_causal: " in where[-1] for _, where in syncs.calls), syncs.report()


@pytest.mark.parametrize("attention", ["linear", "gated-linear", "retention"])
def test_a_training_step_reads_the_host_only_for_its_log_line(accelerator_path, attention, tmp_path):
    """A whole optimizer step of ``lintrans train`` (bf16 autocast, gradient accumulation): the only
    host reads are the step's loss and gradient norm (logged every step, and the run stops on a
    non-finite one), and on the CPU AdamW's step counters (fused AdamW on CUDA keeps them on the device)."""
    from lintrans.train.config import load_config
    from lintrans.train.distributed import init_distributed
    from lintrans.train.loop import _Run

    (tmp_path / "corpus.txt").write_text("the cat sees the moon. a dog finds a red ball.\n" * 200)
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "data.source": tmp_path / "corpus.txt", "data.tokenizer": "bytes", "data.cache_dir": tmp_path / "cache",
        "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 16, "model.block_size": 16,
        "model.attention": attention, "train.batch_size": 4, "train.micro_batch_size": 2,
        "train.out_dir": tmp_path / "run", "train.progress": False, "train.device": "cpu",
        "train.precision": "bf16",
    }.items()])
    run = _Run(cfg, init_distributed("cpu", 1))
    run.plan()
    run.load_data()
    run.build()
    with HostSyncs() as syncs:
        loss, grad_norm = run.train_step(1e-3)
    assert all(where[-1].split(": ")[0].endswith(" train_step") for _, where in syncs.calls), syncs.report()
    lines = [where[-1].split(": ", 1)[1] for _, where in syncs.calls]
    in_optimizer = [line for line in lines if "scaler.step(self.optimizer)" in line]
    assert len(in_optimizer) == len(run.params)  # one per parameter: CPU AdamW's step count
    assert len(lines) - len(in_optimizer) == 2 and any("loss_sum.item()" in line for line in lines), syncs.report()
    assert loss is not None and grad_norm is not None


# -- the meta device: every tensor made where the inputs are ----------------------------------

@pytest.mark.parametrize("attention,options", [
    *[(a, {}) for a in sorted(set(available_attention()) - READS_VALUES)],
    *[("linear", {"feature_map": name, "feature_map_options": opts}) for name, opts in MODULE_MAPS.items()],
    *[("linear", {"form": form}) for form in ("attention_loop", "state_loop", "attention", "attention_blocked",
                                              "state_parallel")],
    ("gated-linear", {"form": "state_parallel"}),
])
def test_gpt_runs_on_the_meta_device(attention, options):
    """Training forward and backward, then prefill and decoding, with the model and the tokens on
    the meta device: a tensor made on the CPU in there (no ``device=``) raises when it meets them,
    and from the second training step on none is made on the CPU and copied over either."""
    model = _gpt(attention, "meta", **options)
    x = torch.randint(0, 64, (2, 24), device="meta")
    model(x, x, return_logits=False)[1].backward()  # the first call may copy constants over once
    with CopiesToDevice() as copies:  # after it, nothing made on the CPU and moved over, in training
        _, loss = model(x, x, return_logits=False)
        loss.backward()
    assert not copies.calls, copies.report()
    assert loss.device.type == "meta" and model.lm_head.weight.grad.device.type == "meta"
    model.eval()
    with torch.no_grad():
        logits, cache = model.forward_cached(x[:, :20])
        for _ in range(3):
            logits, cache = model.forward_cached(x[:, :1], cache, check_ids=False)
    assert logits.device.type == "meta"


@pytest.mark.parametrize("variant", ["reversible", "gradient_checkpointing"])
def test_gpt_variants_run_on_the_meta_device(variant):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=64, attention="gated-linear",
                    **{variant: True})
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.randint(0, 64, (2, 24), device="meta")
    model(x, x, return_logits=False)[1].backward()
    assert model.lm_head.weight.grad.device.type == "meta"


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("decay", [None, "gate"])
def test_every_linear_form_runs_on_the_meta_device(form, decay):
    B, T, H = 2, 13, 2
    q, k, v = (torch.randn(B, T, H, 4, device="meta", requires_grad=True) for _ in range(3))
    ld = None if decay is None else torch.randn(B, T, H, device="meta", requires_grad=True)
    o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=4, log_decay=ld, output_final_state=True)
    (o.sum() + S.sum() + z.sum()).backward()
    assert o.device.type == S.device.type == q.grad.device.type == "meta"


def test_benchmark_steps_run_on_the_meta_device():
    """``lintrans bench ops|train --device cuda`` build their steps with ``device=``: every op series
    and a training step of each attention kind run on the meta device (one untimed call each)."""
    from lintrans.bench.ops import make_op_step, op_series
    from lintrans.bench.sizes import model_size
    from lintrans.bench.train import make_train_step

    for name, fn in op_series(16).items():
        make_op_step(fn, 64, H=2, D=16, device="meta")()
    for attention, form in [("softmax", None), ("linear", "chunked"), ("gated-linear", "chunked"),
                            ("retention", "chunked"), ("linear", "state_parallel")]:
        make_train_step(model_size("4L-128").gpt_config(64, attention, form, 16), 64, "meta")()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is missing")
@pytest.mark.parametrize("argv", [["bench", which, "--device", "cuda"] for which in ("ops", "train", "generate",
                                                                                     "loss", "all")])
def test_bench_on_cuda_without_cuda_is_one_line(argv, capsys):
    from lintrans.cli import main

    assert main(argv) == 2
    message = capsys.readouterr().err
    assert message == "lintrans bench: --device is 'cuda' but no CUDA device is available\n", message
