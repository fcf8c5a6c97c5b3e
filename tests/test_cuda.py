"""On a real CUDA device (skipped without one): every linear form against the float64 reference,
every mechanism's GPT against the same GPT on the CPU, decoding against the full forward, no host
syncs in training (CUDA's own sync detector), and mixed-precision training steps. test_gpu_path.py
checks on the CPU what can be checked there; this is what it cannot."""
import math

import pytest
import torch

from host_sync import READS_VALUES
from lintrans.models import GPT, GPTConfig
from lintrans.nn.registry import available_attention
from lintrans.ops import FORMS, linear_attention, linear_attention_reference

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("exact_float32")]

DEVICE = "cuda"


def _inputs(B, T, H, Dk, Dv, decay, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (Dk, Dk, Dv))
    ld = {None: None, "gate": -torch.rand(B, T, H, generator=g, dtype=torch.float64),
          "fixed": -torch.rand(H, generator=g, dtype=torch.float64)}[decay]
    return q, k, v, ld


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("decay", [None, "gate", "fixed"])
@pytest.mark.parametrize("feature_map", ["elu", "based"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 37])
def test_every_form_on_cuda_equals_the_reference(form, decay, feature_map, dtype, T):
    """Outputs, final states and gradients (q, k, v, log_decay, initial state) on CUDA against the float64
    reference on the CPU; T=37 is not a multiple of the chunk, Dk=5 != Dv=7."""
    B, H, Dk, Dv = 2, 3, 5, 7
    q, k, v, ld = _inputs(B, T, H, Dk, Dv, decay)
    F = linear_attention_reference(q[:, :1], k[:, :1], v[:, :1], feature_map=feature_map)[1][0].shape[2]
    g = torch.Generator().manual_seed(1)
    S0 = (torch.randn(B, H, F, Dv, generator=g, dtype=torch.float64) * 0.1,
          torch.rand(B, H, F, generator=g, dtype=torch.float64) + 0.5)
    leaves = {"ref": [t for t in (q, k, v, ld, *S0) if t is not None]}
    leaves["dev"] = [t.to(DEVICE, dtype) for t in leaves["ref"]]
    results = {}
    for where, ts in leaves.items():
        ts = [t.clone().requires_grad_() for t in ts]
        q_, k_, v_ = ts[:3]
        ld_ = ts[3] if ld is not None else None
        S0_ = tuple(ts[-2:])
        kw = dict(feature_map=feature_map, log_decay=ld_, initial_state=S0_)
        if where == "ref":
            o, (S, z) = linear_attention_reference(q_, k_, v_, **kw)
        else:
            o, (S, z) = linear_attention(q_, k_, v_, form=form, chunk_size=16, output_final_state=True, **kw)
            assert o.device.type == DEVICE and S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        (o.square().sum() + S.sum() + z.sum()).backward()
        results[where] = [o, S, z, *(t.grad for t in ts)]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    for i, (a, b) in enumerate(zip(results["dev"], results["ref"])):
        torch.testing.assert_close(a.detach().cpu().double(), b.detach(), **tol, msg=lambda m: f"result {i}: {m}")


def _gpt(attention, device, **options):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=96, attention=attention,
                    attention_options=options)
    with torch.device(device):
        return GPT(cfg)


@pytest.mark.parametrize("attention", sorted(available_attention()))
def test_every_mechanism_on_cuda_equals_the_cpu(attention):
    """The same weights on both devices: loss and every parameter's gradient agree."""
    cpu = _gpt(attention, "cpu")
    gpu = _gpt(attention, DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randint(0, 96, (2, 50), generator=torch.Generator().manual_seed(2))
    losses = {}
    for name, model, idx in (("cpu", cpu, x), ("dev", gpu, x.to(DEVICE))):
        _, losses[name] = model(idx, idx, return_logits=False)
        losses[name].backward()
    torch.testing.assert_close(losses["dev"].cpu(), losses["cpu"], rtol=1e-5, atol=1e-5)
    grads = dict(gpu.named_parameters())
    for name, p in cpu.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad.cpu(), p.grad, rtol=1e-3, atol=1e-5,
                                       msg=lambda m: f"{attention} {name}: {m}")


@pytest.mark.parametrize("attention", sorted(set(available_attention()) - READS_VALUES))
def test_training_forward_backward_has_no_host_sync_on_cuda(attention):
    """CUDA's own detector: any synchronising call (a copy to the host, ``.item()``, a value-dependent
    shape) inside forward and backward raises."""
    model = _gpt(attention, DEVICE)
    x = torch.randint(0, 96, (2, 48), device=DEVICE)
    model(x, x, return_logits=False)[1].backward()  # first call: lazy initialisation and cached constants
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, loss = model(x, x, return_logits=False)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@pytest.mark.parametrize("attention", ["softmax", "linear", "gated-linear", "retention", "sliding-window"])
def test_decoding_on_cuda_equals_the_full_forward(attention):
    """Prefill then one token at a time with the cache or state: the logits of the full forward."""
    if attention not in available_attention():
        pytest.skip(f"{attention} is not registered")
    model = _gpt(attention, DEVICE).eval()
    x = torch.randint(0, 96, (2, 40), device=DEVICE)
    with torch.no_grad():
        full, _ = model(x)
        logits, cache = model.forward_cached(x[:, :24])
        steps = [logits[:, -1]]
        for t in range(24, 39):
            logits, cache = model.forward_cached(x[:, t:t + 1], cache)
            steps.append(logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 23:39], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("attention", ["softmax", "linear", "gated-linear"])
def test_training_on_cuda_learns(tmp_path, precision, attention):
    """A short ``lintrans train`` run on CUDA (fused AdamW; fp16 with the GradScaler): the loss falls."""
    from lintrans.train.config import load_config
    from lintrans.train.loop import train

    (tmp_path / "corpus.txt").write_text("the cat sees the moon. a dog finds a red ball.\n" * 400)
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "data.source": tmp_path / "corpus.txt", "data.tokenizer": "bytes", "data.cache_dir": tmp_path / "cache",
        "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64,
        "model.attention": attention, "train.batch_size": 16, "train.max_steps": 60,
        "train.eval_interval": 60, "train.checkpoint_interval": 60, "optim.warmup_steps": 5, "optim.lr": 2e-3,
        "train.out_dir": tmp_path / "run", "train.progress": False, "train.device": DEVICE,
        "train.precision": precision,
    }.items()])
    result = train(cfg)
    assert result.stopped == "done" and result.step == 60
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert all(map(math.isfinite, losses)) and sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


def test_context_estimate_on_cuda_times_the_device(tmp_path, capsys):
    """``--estimate --device cuda``: the queue drained around each timed step, costs from wall-clock
    time only (the host's CPU time while a GPU works says nothing of the GPU)."""
    from lintrans.cli import main

    assert main(["experiment", "context", "--quick", "--estimate", "--device", DEVICE, "--out", str(tmp_path),
                 "--mechanisms", "softmax@rope"]) == 0
    out = capsys.readouterr().out
    assert "s/update (wall)" in out and "(cpu;" not in out
    assert f"estimate with --jobs 1 on {DEVICE}" in out and "CPU time" not in out
