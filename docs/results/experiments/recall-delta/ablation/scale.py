"""Which part of the hard setting stops the delta rule: many pairs (16, T=64) with a small vocabulary (64),
or few pairs (4, T=16) with the study's vocabulary (8192)? deltanet beside linear:elu, width 64, 4 heads,
1000 steps of 16, lr 2e-3, seed 0."""
import json, sys, torch
torch.set_num_threads(1)
from lintrans.experiments import recall, study
env = study.RunEnv(None, lambda n: None)
mech, vocab, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = dict(recall.DEFAULT, vocab_size=vocab, pairs=pairs, answers="shown")  # as recorded
r = recall.run(recall.run_spec(s, mech, [64, 4], 2e-3, 0), env)
print(mech, vocab, pairs, json.dumps({"accuracy": r["accuracy"], "chance": 2 / vocab, "eval_acc": [round(e["accuracy"], 4) for e in r["evals"]]}), flush=True)
