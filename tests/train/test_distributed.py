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


def torchrun(cfg, nproc: int = 2, ok: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc -m lintrans train`` with every key of ``cfg`` on the command line
    (``ok``: it must succeed)."""
    args = []
    for key, value in cfg.to_dict()["train"].items():
        if value is not None:
            args.append(f"--set=train.{key}={value}")
    for key in ("source", "tokenizer", "cache_dir"):
        args.append(f"--set=data.{key}={getattr(cfg.data, key)}")
    args += [f"--set=model.{k}={v}" for k, v in cfg.model.items()]
    args += [f"--set=optim.{k}={v}" for k, v in cfg.to_dict()["optim"].items() if v is not None]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "lintrans", "train", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 or not ok, proc.stderr[-3000:]
    return proc


def weights(cfg) -> dict:
    return load_file(os.path.join(cfg.train.out_dir, "checkpoint", "model.safetensors"))


def assert_weights_close(got: dict, want: dict, C: int) -> None:
    assert set(got) == set(want)
    for k in want:
        a, b = got[k], want[k]
        if k.endswith("attn.c_attn.bias"):
            # the key bias adds q.b_k to every score of a row, which softmax ignores: its gradient is
            # zero but for rounding, and AdamW turns that noise into steps of ~1e-6 whose sign depends
            # on the summation order. Checked loosely; the query and value biases exactly.
            torch.testing.assert_close(a[C:2 * C], b[C:2 * C], rtol=0, atol=1e-4)
            a, b = torch.cat([a[:C], a[2 * C:]]), torch.cat([b[:C], b[2 * C:]])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def read_state(cfg) -> dict:
    return json.loads(open(os.path.join(cfg.train.out_dir, "checkpoint", "trainer_state.json")).read())


@pytest.mark.slow
def test_ddp_and_fsdp_match_one_process(tiny_config):
    """2 processes, DDP and FSDP2 (fully_shard), train like one process with the same global batch;
    FSDP's checkpoint is the unsharded format, and an FSDP run stopped and resumed continues with
    bit-identical losses and weights (one test: each torchrun launch costs seconds)."""
    settings = {"train.max_steps": 4, "train.eval_interval": 2, "model.dropout": 0.0, "model.n_layer": 2}
    single = tiny_config("single", **settings)
    train(single)
    C = single.model["n_embd"]
    per_process = {**settings, "train.micro_batch_size": 1}  # 2 processes x 1 x 2 accumulation
    ddp, fsdp = tiny_config("ddp", **per_process), tiny_config("fsdp", **per_process, **{"train.parallel": "fsdp"})
    assert "2 process(es) x 1 micro-batch x 2 accumulation" in torchrun(ddp).stderr
    proc = torchrun(fsdp)
    assert ", FSDP" in proc.stderr and "peak memory per process (peak resident set): " in proc.stderr
    assert "peak memory per process" in open(os.path.join(fsdp.train.out_dir, "train.log")).read()
    (train_1, val_1) = losses(single.train.out_dir)
    assert len(train_1) == 4 and len(val_1) == 2
    for run in (ddp, fsdp):
        train_2, val_2 = losses(run.train.out_dir)
        assert train_2 == pytest.approx(train_1, rel=1e-5) and val_2 == pytest.approx(val_1, rel=1e-5)
        assert_weights_close(weights(run), weights(single), C)
        state = read_state(run)
        assert state["world_size"] == 2 and len(state["rng"]) == 2
    o_ddp, o_fsdp = (load_file(os.path.join(c.train.out_dir, "checkpoint", "optimizer.safetensors")) for c in (ddp, fsdp))
    assert {k: v.shape for k, v in o_ddp.items()} == {k: v.shape for k, v in o_fsdp.items()}
    assert read_state(fsdp)["optimizer"] == read_state(ddp)["optimizer"]  # param groups, scalars

    resumed = tiny_config("fsdp-resumed", **per_process, **{"train.parallel": "fsdp", "train.stop_after_steps": 2})
    torchrun(resumed)
    assert len(losses(resumed.train.out_dir)[0]) == 2
    resumed = tiny_config("fsdp-resumed", **per_process, **{"train.parallel": "fsdp"})
    assert "resuming from" in torchrun(resumed).stderr
    assert losses(resumed.train.out_dir) == losses(fsdp.train.out_dir)  # bitwise
    w_resumed, w_fsdp = weights(resumed), weights(fsdp)
    assert all(torch.equal(w_resumed[k], w_fsdp[k]) for k in w_fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("attention,nproc,parallel", [("linear", 2, "ddp"), ("gated-linear", 4, "fsdp")])
def test_context_parallel_matches_one_process(tiny_config, attention, nproc, parallel):
    """Every sequence split over 2 processes (with 4: 2 data-parallel groups of 2) trains like one
    process over 20 steps."""
    settings = {"train.max_steps": 20, "train.eval_interval": 10, "model.dropout": 0.0, "model.attention": attention,
                "model.n_layer": 2, "model.attention_options": '{"chunk_size": 4}'}
    single = tiny_config("single", **settings)
    train(single)
    cp = tiny_config("cp", **settings, **{"train.context_parallel": 2, "train.parallel": parallel})
    proc = torchrun(cp, nproc)
    assert f"{nproc // 2} process(es) x {4 * 2 // nproc} micro-batch x 1 accumulation, each sequence split over 2 " \
           "processes (8 tokens each)" in proc.stderr
    (train_1, val_1), (train_2, val_2) = losses(single.train.out_dir), losses(cp.train.out_dir)
    assert len(train_1) == len(train_2) == 20 and len(val_2) == 2
    assert train_2 == pytest.approx(train_1, rel=1e-5) and val_2 == pytest.approx(val_1, rel=1e-5)


def test_a_folder_in_use_stops_every_rank_with_one_message(tiny_config):
    """Rank 0 finds the run folder locked; every rank must stop with the message (the others used to
    go on into their next collective and fail there, or wait)."""
    from lintrans._io import FileLock
    from lintrans.train.loop import LOCK_NAME

    cfg = tiny_config(**{"train.max_steps": 2})
    os.makedirs(cfg.train.out_dir)
    held = FileLock(os.path.join(cfg.train.out_dir, LOCK_NAME), blocking=False)
    assert held.acquire()
    try:
        proc = torchrun(cfg, ok=False)
    finally:
        held.release()
    assert proc.returncode != 0
    message = f"is in use by another run (pid {os.getpid()})"
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]  # both ranks, one line each
    assert "Connection closed by peer" not in proc.stderr
