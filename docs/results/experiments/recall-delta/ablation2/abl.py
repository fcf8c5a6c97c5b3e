"""One ablation run of the deltanet layer in the recall study's setting (MQAR, T = 64, 16 pairs, vocabulary
8192, 2 layers), patched in-process: python abl.py VARIANT [--steps N] [--width W --heads H] [--lr LR] [--seed S]
[--batch B] [--options K=V,...]. Prints one JSON line (the run's evals). Variants:

  base          the layer as shipped
  no-gate       output_gate=false (flash-linear-attention's DeltaNet default): y = RMSNorm(o) W_o
  additive      the same layer with the delta rule's erasure removed: S_t = S_{t-1} + beta_t k_t v_t^T
                (linear attention on the same L2-normalised q, k): isolates the erasure
  beta-0.1      the delta rule with beta fixed at 0.1 (each write erases 10% of what its key held)
  beta-1        the delta rule with beta fixed at 1 (each write replaces what its key held)
  beta-init-X   beta = sigmoid(x W_beta + logit(X)): learnable as shipped, but starting near X instead of 0.5
  conv-dirac    the short convolution starting as the identity (current tap 1, earlier taps 0) instead of
                PyTorch's default (uniform in +-1/sqrt(kernel)), so q, k, v start as their own token's
  no-qk-silu    no SiLU on q and k (v keeps it): keys no longer confined near the positive orthant
  no-decay      gated-deltanet with its decay removed (log a = 0; its decay parameters unused)
  decay-A1      gated-deltanet with A starting uniform in (0, 1) instead of Mamba-2's (0, 16): the state
                forgets about 16x more slowly at first (dt keeps Mamba-2's init)
"""
import argparse
import json

import torch

from lintrans.experiments import recall, study
from lintrans.nn import delta as D
from lintrans.ops.delta.reference import l2_normalized

p = argparse.ArgumentParser()
p.add_argument("variant")
p.add_argument("--steps", type=int, default=2000)
p.add_argument("--width", type=int, default=64)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--mechanism", default="deltanet")
p.add_argument("--options", default="", help="layer options appended to the spec, e.g. conv_size=0,output_gate=false")
a = p.parse_args()
torch.set_num_threads(1)

real_rule = D.delta_rule


def additive(q, k, v, beta, *, log_decay=None, form=None, chunk_size=None, initial_state=None,
             output_final_state=False, **_):
    q, k = l2_normalized(q) * q.shape[-1] ** -0.5, l2_normalized(k)
    T = q.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q, k)  # [B,H,T,T]
    if log_decay is not None:
        c = log_decay.cumsum(1).transpose(1, 2)  # [B,H,T]
        scores = scores * torch.exp((c[..., :, None] - c[..., None, :]).clamp(max=0))
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0)
    return torch.einsum("bhts,bshd->bthd", scores, beta[..., None] * v), None


def fixed_beta(value):
    def rule(q, k, v, beta, **kw):
        return real_rule(q, k, v, torch.full_like(beta, value), **kw)
    return rule


mechanism = a.mechanism
if a.variant == "additive":
    D.delta_rule = additive
elif a.variant == "conv-dirac":
    _init0 = D.DeltaNet.__init__

    def init(self, config):
        _init0(self, config)
        with torch.no_grad():
            self.conv.weight.zero_()[..., -1] = 1.0  # GPT's init leaves the convolution alone
    D.DeltaNet.__init__ = init
elif a.variant.startswith("beta-init-"):
    offset = float(torch.logit(torch.tensor(float(a.variant[10:]))))
    _fwd0 = D.DeltaNet.forward

    def forward(self, x, cache=None, use_cache=False):
        proj = self.beta_proj
        proj.forward = lambda inp: torch.nn.Linear.forward(proj, inp) + offset
        try:
            return _fwd0(self, x, cache, use_cache)
        finally:
            del proj.forward
    D.DeltaNet.forward = forward
elif a.variant.startswith("beta-"):
    D.delta_rule = fixed_beta(float(a.variant[5:]))
elif a.variant == "no-gate":
    mechanism += ":output_gate=false"
elif a.variant == "no-qk-silu":  # the layer's first SiLU (on q, k, v together) becomes the identity; v gets it back
    import types
    raw = {"on": False}
    D.F = types.SimpleNamespace(**{n: getattr(torch.nn.functional, n) for n in dir(torch.nn.functional)
                                   if not n.startswith("__")})
    D.F.silu = lambda x: x if raw.pop("on", False) else torch.nn.functional.silu(x)
    _fwd, _split = D.DeltaNet.forward, D.DeltaNet.qkv_split

    def forward(self, x, cache=None, use_cache=False):
        raw["on"] = True
        return _fwd(self, x, cache, use_cache)

    def qkv_split(self, u):
        q, k, v = _split(self, u)
        return q, k, torch.nn.functional.silu(v)
    D.DeltaNet.forward, D.DeltaNet.qkv_split = forward, qkv_split
elif a.variant == "no-decay":
    D.GatedDeltaNet.log_decay = lambda self, x: None
elif a.variant == "decay-A1":
    _decay0 = D.mamba2_decay_init

    def decay_init(n_head, **kw):
        A_log, dt_bias = _decay0(n_head, **kw)
        return A_log - torch.log(torch.tensor(16.0)), dt_bias  # A / 16: uniform in (0, 1)
    D.mamba2_decay_init = decay_init
elif a.variant != "base":
    raise SystemExit(f"unknown variant {a.variant}")
if a.options:
    mechanism += ("," if ":" in mechanism else ":") + a.options

s = dict(recall.DEFAULT, steps=a.steps, batch_size=a.batch, eval_every=max(a.steps // 8, 1),
         answers="shown")  # the task these records were made with (answers hidden is the default since 2026-11-27)
spec = recall.run_spec(s, mechanism, [a.width, a.heads], a.lr, a.seed)
r = recall.run(spec, study.RunEnv(None, lambda n: None))
print(json.dumps({"variant": a.variant, **{k: v for k, v in vars(a).items() if k != "variant"},
                  "accuracy": r["accuracy"], "final_loss": r["final_loss"], "state_floats": r["state_floats"],
                  "seconds": round(r["train_seconds"]),
                  "evals": [[e["step"], round(e["loss"], 3), round(e["accuracy"], 4)] for e in r["evals"]]}), flush=True)
