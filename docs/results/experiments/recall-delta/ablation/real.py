"""One ablation run of deltanet in the recall study's own setting (T=64, 16 pairs, width 64, 4 heads, lr 2e-3, seed 0)."""
import json, sys, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from lintrans.experiments import recall, study
from lintrans.nn import delta as D
sys.path.insert(0, "/tmp/abl")
from small import make_forward  # noqa: E402  (runs nothing when imported with argv naming no variant? see guard)

variant = sys.argv[1]
if variant == "no-qk-silu":
    D.DeltaNet.forward = make_forward(qk_silu=False)
elif variant == "beta-init-0.05":
    orig_init = D.DeltaNet.__init__
    def init(self, config):
        orig_init(self, config)
        self.beta_bias0 = torch.log(torch.tensor(0.05 / 0.95)).item()
    D.DeltaNet.__init__ = init
    orig_fwd = D.DeltaNet.forward
    # beta = sigmoid(x W_beta + b0): each write starts near 0.05, so 48 writes before the queries erase little
    orig_proj_forward = torch.nn.Linear.forward
    def forward(self, x, cache=None, use_cache=False):
        bp = self.beta_proj
        saved = bp.forward
        bp.forward = lambda inp: orig_proj_forward(bp, inp) + self.beta_bias0
        try:
            return orig_fwd(self, x, cache, use_cache)
        finally:
            bp.forward = saved
    D.DeltaNet.forward = forward
s = dict(recall.DEFAULT, answers="shown")  # as recorded
env = study.RunEnv(None, lambda n: None)
r = recall.run(recall.run_spec(s, "deltanet", [64, 4], 2e-3, 0), env)
print(variant, json.dumps({"accuracy": r["accuracy"], "final_loss": r["final_loss"], "state_floats": r["state_floats"],
                           "eval_loss": [round(e["loss"], 3) for e in r["evals"]],
                           "eval_acc": [round(e["accuracy"], 4) for e in r["evals"]]}), flush=True)
