"""Cheap ablation of the delta layer's parts on a small MQAR (vocab 64, 4 pairs, T=16, width 32, 2 heads)."""
import json, sys, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from lintrans.experiments import recall, study
from lintrans.nn import delta as D
from lintrans.ops.delta import delta_rule

orig_forward = D.DeltaNet.forward

def make_forward(gate=True, norm=True, qk_silu=True, beta_one=False):
    def forward(self, x, cache=None, use_cache=False):
        B, T, _ = x.shape
        u = self.c_attn(x)
        if self.conv is not None:
            u, _ = D.causal_conv(u, self.conv.weight, None)
        q, k, v = self.qkv_split(u)
        v = F.silu(v)
        if qk_silu:
            q, k = F.silu(q), F.silu(k)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)
        beta = torch.ones(B, T, self.n_head) if beta_one else torch.sigmoid(self.beta_proj(x)) * self.beta_max
        o, _ = delta_rule(q, k, v, beta, log_decay=self.log_decay(x), form=self.form, chunk_size=self.chunk_size)
        if norm:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm
        if gate:
            o = o * F.silu(self.g_proj(x)).view(B, T, self.n_head, self.head_dim)
        return self.out(o), None
    return forward

VARIANTS = {
    "as-is": ("deltanet", {}),
    "no-conv": ("deltanet:conv_size=0", {}),
    "no-gate": ("deltanet", dict(gate=False)),
    "no-norm": ("deltanet", dict(norm=False)),
    "no-norm-no-gate": ("deltanet", dict(gate=False, norm=False)),
    "no-qk-silu": ("deltanet", dict(qk_silu=False)),
    "beta-1": ("deltanet", dict(beta_one=True)),
    "neg-eig": ("deltanet:allow_neg_eigval=true", {}),
    "elu": ("linear:elu", {}),
    "gated-linear": ("gated-linear", {}),
}
s = dict(recall.DEFAULT, vocab_size=64, pairs=4, steps=400, eval_every=400, eval_batch=256, answers="shown")  # as recorded
env = study.RunEnv(None, lambda n: None)
names = (sys.argv[1:] or list(VARIANTS)) if __name__ == "__main__" else []
for name in names:
    spec_name, kw = VARIANTS[name]
    D.DeltaNet.forward = make_forward(**kw) if kw else orig_forward
    accs = {}
    for lr in (1e-3, 3e-3, 1e-2):
        accs[lr] = [round(recall.run(recall.run_spec(s, spec_name, [32, 2], lr, seed), env)["accuracy"], 3) for seed in (0, 1)]
    print(name, json.dumps(accs), flush=True)
