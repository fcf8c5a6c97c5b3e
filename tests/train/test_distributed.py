"""Two CPU processes under torchrun (gloo) must train exactly like one process with the same global batch."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lintrans.train.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def losses(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [r["loss"] for r in rows], [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.slow
def test_two_processes_match_one(tiny_config, tmp_path):
    settings = {"train.max_steps": 4, "train.eval_interval": 2, "model.dropout": 0.0}
    single = tiny_config("single", **settings)
    train(single)
    ddp = tiny_config("ddp", **settings, **{"train.micro_batch_size": 1})  # 2 processes x 1 x 2 accumulation
    args = []
    for key, value in ddp.to_dict()["train"].items():
        if value is not None:
            args.append(f"--set=train.{key}={value}")
    for key in ("source", "tokenizer", "cache_dir"):
        args.append(f"--set=data.{key}={getattr(ddp.data, key)}")
    args += [f"--set=model.{k}={v}" for k, v in ddp.model.items()]
    args += [f"--set=optim.{k}={v}" for k, v in ddp.to_dict()["optim"].items() if v is not None]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "lintrans", "train", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) x 1 micro-batch x 2 accumulation" in proc.stderr
    (train_1, val_1), (train_2, val_2) = losses(single.train.out_dir), losses(ddp.train.out_dir)
    assert len(train_1) == len(train_2) == 4 and len(val_1) == len(val_2) == 2
    assert train_2 == pytest.approx(train_1, rel=1e-5) and val_2 == pytest.approx(val_1, rel=1e-5)
    w1, w2 = (load_file(os.path.join(c.train.out_dir, "checkpoint", "model.safetensors")) for c in (single, ddp))
    C = ddp.model["n_embd"]
    for k in w1:
        a, b = w2[k], w1[k]
        if k.endswith("attn.c_attn.bias"):
            # the key bias adds q.b_k to every score of a row, which softmax ignores: its gradient is
            # zero but for rounding, and AdamW turns that noise into steps of ~1e-6 whose sign depends
            # on the summation order. Checked loosely; the query and value biases exactly.
            torch.testing.assert_close(a[C:2 * C], b[C:2 * C], rtol=0, atol=1e-4)
            a, b = torch.cat([a[:C], a[2 * C:]]), torch.cat([b[:C], b[2 * C:]])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    state = json.loads(open(os.path.join(ddp.train.out_dir, "checkpoint", "trainer_state.json")).read())
    assert state["world_size"] == 2 and len(state["rng"]) == 2
