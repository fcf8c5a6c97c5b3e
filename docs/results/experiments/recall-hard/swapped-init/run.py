"""Ablation: is Gated DeltaNet's failure at the hard MQAR point its layer, or its initial draw?

Trains one recall run (the hard preset, width 64, one head, rate 2e-3, seed SEED, default 0) of
`mechanism`, with every weight the two layers share copied from `donor` built at the same seed; the
weights only the gated layer has (A_log, dt_bias, W_a) keep their own draws. Usage, from the repository root:
  python docs/results/experiments/recall-hard/swapped-init/run.py MECHANISM DONOR OUT.json [SEED]"""
import json
import platform
import sys
import time

import torch

from lintrans.experiments import recall, study
from lintrans.experiments.models import gpt_config

mechanism, donor, out = sys.argv[1:4]
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
torch.set_num_threads(1)
settings = {**recall.DEFAULT, **recall.PRESETS["hard"], "answers": "shown"}  # the recorded task (answers hidden is the default since 2026-11-27)
spec = recall.run_spec(settings, mechanism, [64, 1], 2e-3, seed)
built = recall.ShiftGPT
copied = {}


def with_donor_weights(config):
    model = built(config)
    torch.manual_seed(spec["seed"])  # the donor as its own run at this seed would draw it
    donor_config = gpt_config(donor, n_layer=spec["n_layer"], n_head=1, n_embd=64, block_size=config.block_size,
                              vocab_size=spec["vocab_size"], linear_form="attention")
    theirs = built(donor_config).state_dict()
    ours = model.state_dict()
    shared = {n: t for n, t in theirs.items() if n in ours}
    model.load_state_dict(shared, strict=False)
    copied.update(shared=len(shared), own=sorted(n for n in ours if n not in theirs))
    return model


recall.ShiftGPT = with_donor_weights
t0 = time.time()
result = recall.run(spec, study.RunEnv(None, lambda n: None))
tl = result["train_loss"]
record = {"spec": spec, "donor": donor, "copied": copied, "accuracy": result["accuracy"],
          "evals": result["evals"], "train_loss_per_500": [sum(tl[i:i + 100]) / 100 for i in range(0, len(tl), 500)],
          "decay_half_lives_start": result.get("decay_half_lives_start"),
          "decay_half_lives_end": result.get("decay_half_lives_end"),
          "seconds": time.time() - t0, "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
with open(out, "w") as f:
    json.dump(record, f, indent=1)
print(mechanism, "from", donor, "accuracy", result["accuracy"])
