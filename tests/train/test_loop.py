import json
import math
import os
import signal

import pytest
import torch

from lintrans.models.gpt import GPT
from lintrans.train import checkpoint as ckpt
from lintrans.train.loop import build_optimizer, lr_at, train


def read_state(out_dir):
    return json.loads((out_dir / "checkpoint" / "trainer_state.json").read_text())


def test_loss_goes_down_and_everything_is_written(tiny_config):
    cfg = tiny_config(**{"train.max_steps": 40, "train.eval_interval": 20})
    result = train(cfg)
    out = cfg.train.out_dir
    assert result.stopped == "done" and result.step == 40 and result.exit_code == 0
    first, last = result.losses[1], sum(result.losses[s] for s in range(36, 41)) / 5
    assert math.log(257) - 0.5 < first < math.log(320) + 0.5
    assert last < first - 1.0, (first, last)
    assert set(result.val_losses) == {20, 40}
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "loss.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0  # raises if the file is missing
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["tokens"] == 40 * 4 * 16
    from lintrans.models import load_model

    model = load_model(os.path.join(out, "checkpoint"))
    assert model.config.vocab_size == 320 and model.config.n_embd == 16


@pytest.mark.parametrize("extra", [{}, {"model.dropout": 0.1, "train.micro_batch_size": 2}])
def test_resume_gives_identical_losses(tiny_config, extra):
    straight = train(tiny_config("a", **extra))
    first = train(tiny_config("b", **extra, **{"train.stop_after_steps": 3}))
    assert first.stopped == "stop_after" and first.step == 3 and read_state(first.out_dir)["step"] == 3
    second = train(tiny_config("b", **extra))
    assert second.step == 6 and sorted(second.losses) == [4, 5, 6]
    for step in range(1, 7):
        got = first.losses.get(step, second.losses.get(step))
        assert got == straight.losses[step], step  # bitwise: same data, RNG, optimizer state
    rows = [json.loads(line) for line in open(first.out_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 7))
    a = ckpt.read_checkpoint(straight.out_dir / "checkpoint")
    b = ckpt.read_checkpoint(second.out_dir / "checkpoint")
    assert a["trainer_state"]["sampler"] == b["trainer_state"]["sampler"]
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r.out_dir / "checkpoint" / "model.safetensors")) for r in (straight, second))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_after_crash_between_renames(tiny_config):
    cfg = tiny_config(**{"train.stop_after_steps": 2})
    train(cfg)
    out = cfg.train.out_dir
    os.replace(os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.old"))  # as if killed mid-swap
    result = train(tiny_config(**{"train.stop_after_steps": 1}))
    assert result.step == 3
    assert os.path.isdir(os.path.join(out, "checkpoint")) and not os.path.exists(os.path.join(out, "checkpoint.old"))


def test_a_second_run_on_a_folder_in_use_is_refused(tiny_config, tmp_path):
    """Two runs on one folder would interleave their metrics and overwrite each other's checkpoints:
    while one trains there (here: holds the lock, as a run does), another is refused before it reads
    or removes anything; once the first is gone, the folder is free again."""
    import subprocess
    import sys

    from lintrans.train.loop import LOCK_NAME

    train(tiny_config(**{"train.stop_after_steps": 1}))
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom lintrans._io import FileLock\n"
        f"assert FileLock({str(out / LOCK_NAME)!r}, blocking=False).acquire()\n"
        "print('held', flush=True)\ntime.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / ".checkpoint.tmp-1-abc").mkdir()  # what a live run's save looks like: must stay
        with pytest.raises(ValueError, match=rf"train.out_dir .*run is in use by another run \(pid {holder.pid}\)"):
            train(tiny_config())
        assert (out / ".checkpoint.tmp-1-abc").is_dir() and read_state(out)["step"] == 1
    finally:
        holder.kill()
        holder.wait()
    assert train(tiny_config(**{"train.stop_after_steps": 1})).step == 2  # killed holder: lock gone


def test_a_file_system_without_locks_trains_without_one(tiny_config, monkeypatch):
    """Lustre's noflock, NFS without lockd: flock fails with ENOSYS/ENOLCK; the run goes on, warned."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="no file lock can be had here"):
        assert train(tiny_config(**{"train.max_steps": 1})).step == 1


def test_a_finished_run_on_a_read_only_folder_says_so(tiny_config, monkeypatch):
    """A read-only mount or another user's finished run: the lock file cannot be opened for writing."""
    import errno

    from lintrans import _io

    train(tiny_config(**{"train.max_steps": 1}))
    real_open = os.open

    def read_only(path, flags, *a):
        if flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(_io.os, "open", read_only)
    assert train(tiny_config(**{"train.max_steps": 1})).stopped == "already_done"


def test_a_resume_checks_the_data_by_content_not_by_spelling(tiny_config, text_file):
    """A changed data file would give the saved sampler other text: refused. The same file named
    another way (./a.txt, an absolute path) is the same data: resumed."""
    train(tiny_config(**{"train.stop_after_steps": 2}))
    same = os.path.relpath(text_file, os.getcwd())
    assert train(tiny_config(**{"data.source": same, "train.stop_after_steps": 1})).step == 3
    original = text_file.read_text()
    text_file.write_text(original[len(original) // 2:] + original[: len(original) // 2])  # same length, moved
    with pytest.raises(ValueError, match=r"is not the data checkpoint .* was trained on .*other tokens"):
        train(tiny_config())
    text_file.write_text(original)
    assert train(tiny_config()).step == 6


def test_another_source_is_refused_before_it_is_read_and_sources_may_live_in_the_run(tiny_config, tmp_path,
                                                                                      monkeypatch):
    from lintrans.train import loop

    train(tiny_config(**{"train.stop_after_steps": 1}))
    (tmp_path / "other.txt").write_text("other text " * 300)
    monkeypatch.setattr(loop, "prepare_data", lambda *a, **k: pytest.fail("read before the refusal"))
    with pytest.raises(ValueError, match=r"data.source: .* in checkpoint, .*other.txt' now"):
        train(tiny_config(**{"data.source": str(tmp_path / "other.txt")}))
    monkeypatch.undo()
    # a data folder inside the cache folder or the run's folder is the user's data, not theirs to leave out
    corpus = tmp_path / "scratch" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text("some text to train on " * 200)
    for key in ("data.cache_dir", "train.out_dir"):
        cfg = tiny_config(f"run-{key}", **{"data.source": str(corpus), key: str(tmp_path / "scratch"),
                                           "train.max_steps": 1})
        assert train(cfg).step == 1


def test_a_changed_embedded_corpus_is_reported_not_refused(tiny_config, capsys):
    """The embedded corpus is read from the installed Python and NumPy: on another machine it differs."""
    cfg = tiny_config(**{"data.source": "builtin:python-docs", "data.cache_dir": "none", "train.stop_after_steps": 1})
    train(cfg)
    state = cfg.train.out_dir + "/checkpoint/trainer_state.json"
    saved = json.loads(open(state).read())
    saved["data"]["sample_sha256"] = "0" * 64  # as if made with another Python
    open(state, "w").write(json.dumps(saved))
    capsys.readouterr()
    assert train(tiny_config(**{"data.source": "builtin:python-docs", "data.cache_dir": "none",
                                "train.stop_after_steps": 1})).step == 2
    assert "resume: the embedded corpus differs from the checkpoint's" in capsys.readouterr().err


def test_bad_checkpoints_fail_before_training(tiny_config, tmp_path):
    train(tiny_config(**{"train.stop_after_steps": 1}))
    with pytest.raises(ValueError, match="model.n_layer: 1 in checkpoint, 2 now.*to continue that run, pass "
                                         "--config .*run/config.yaml"):
        train(tiny_config(**{"model.n_layer": 2}))
    assert (tmp_path / "run" / "config.yaml").is_file()  # the file the message names
    with pytest.raises(ValueError, match="data.tokenizer"):
        train(tiny_config(**{"data.tokenizer": "gpt2", "model.vocab_size": 50304}))
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        train(tiny_config(**{"train.resume": "never"}))
    with pytest.raises(ValueError, match="holds no checkpoint"):
        train(tiny_config("empty", **{"train.resume": "must"}))
    # the run's checkpoint given as its folder, and a file: each says what to give instead, writing nothing
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir())
    with pytest.raises(ValueError, match=f"is a checkpoint, not a run's folder; set train.out_dir={tmp_path / 'run'} "):
        train(tiny_config("run/checkpoint"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == before
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="train.out_dir .*a-file is a file; it must be a folder"):
        train(tiny_config("a-file"))
    weights = tmp_path / "run" / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="damaged"):
        train(tiny_config())
    (tmp_path / "run" / "checkpoint" / "optimizer.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete.*optimizer.safetensors"):
        train(tiny_config())


def test_missing_data_and_small_vocab_fail_clearly(tiny_config, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        train(tiny_config(**{"data.source": str(tmp_path / "absent.txt")}))
    with pytest.raises(ValueError, match="smaller than the bytes tokenizer"):
        train(tiny_config(**{"model.vocab_size": 100}))
    assert not (tmp_path / "run").exists()


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tiny_config, monkeypatch, capsys):
    calls = {"n": 0}
    forward = GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 5:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    cfg = tiny_config(**{"train.checkpoint_interval": 2})
    result = train(cfg)
    assert result.stopped == "nonfinite" and result.exit_code == 1 and result.step == 4
    assert read_state(result.out_dir)["step"] == 4
    assert "non-finite by step 5" in capsys.readouterr().err


def test_non_finite_weights_never_replace_a_good_checkpoint(tiny_config, monkeypatch):
    from lintrans.train import loop

    original = loop.build_optimizer

    def poisoning_optimizer(model, cfg, device):  # the 3rd update writes a NaN weight, loss still finite
        opt = original(model, cfg, device)
        step, calls = opt.step, {"n": 0}

        def poisoned_step(*a, **k):
            out = step(*a, **k)
            calls["n"] += 1
            if calls["n"] == 3:
                with torch.no_grad():
                    next(model.parameters())[0, 0] = float("nan")
            return out

        opt.step = poisoned_step
        return opt

    monkeypatch.setattr(loop, "build_optimizer", poisoning_optimizer)
    result = train(tiny_config(**{"train.checkpoint_interval": 2}))
    assert result.stopped == "nonfinite" and result.exit_code == 1
    assert read_state(result.out_dir)["step"] == 2  # the good one, not the NaN weights of step 4
    from safetensors.torch import load_file

    weights = load_file(str(result.out_dir / "checkpoint" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_resuming_a_finished_run_says_nothing_was_trained(tiny_config, capsys):
    first = train(tiny_config(**{"train.max_steps": 4, "train.eval_interval": 2}))
    assert first.stopped == "done"
    out = capsys.readouterr().out
    # one line per evaluation on stdout and in train.log, readable without the progress bar
    assert out.count("train loss") == 2 and "step 4/4: train loss" in out and "tokens/s" in out
    assert (first.out_dir / "train.log").read_text().count("val loss") == 2
    again = train(tiny_config(**{"train.max_steps": 4}))
    assert again.stopped == "already_done" and again.step == 4 and again.losses == {}
    err = capsys.readouterr().err
    assert "nothing to train" in err and "--train.max_steps 8" in err
    more = train(tiny_config(**{"train.max_steps": 6}))
    assert more.stopped == "done" and sorted(more.losses) == [5, 6]


def test_lr_schedule(tiny_config):
    cfg = tiny_config(**{"optim.warmup_steps": 10, "train.max_steps": 100, "optim.lr": 1.0, "optim.min_lr": 0.1})
    lrs = [lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[55] == pytest.approx(0.55) and lrs[100] == lrs[119] == 0.1


def test_weight_decay_on_matrices_only(tiny_config):
    cfg = tiny_config()
    model = GPT(cfg.gpt_config(vocab_size=320))
    decay, no_decay = build_optimizer(model, cfg, torch.device("cpu")).param_groups
    assert decay["weight_decay"] == cfg.optim.weight_decay and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_frozen_decay_stays_frozen_under_weight_decay(tiny_config):
    """gated-deltanet with decay_trainable=False: the optimizer leaves A_log, dt_bias and W_a out (weight
    decay would otherwise move W_a), and a step changes every other parameter."""
    cfg = tiny_config(**{"model.attention": "gated-deltanet",
                         "model.attention_options": {"decay_trainable": False, "chunk_size": 4}})
    model = GPT(cfg.gpt_config(vocab_size=320))
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.split(".")[-1] in ("A_log", "dt_bias") or ".a_proj." in n for n in frozen)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters())) - len(frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(0, 320, (2, 8))
    model(idx, targets=idx)[1].backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n


def test_bf16_autocast_on_cpu_trains(tiny_config):
    result = train(tiny_config(**{"train.precision": "bf16", "train.max_steps": 2}))
    assert all(math.isfinite(v) for v in result.losses.values())
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        train(tiny_config("fp16", **{"train.precision": "fp16"}))


def test_sigterm_saves_a_checkpoint(tiny_config, tmp_path, monkeypatch, capsys):
    """SIGTERM arriving during step 3 of 100,000: the step finishes, a checkpoint is saved at it, and
    `lintrans train` returns 128 + SIGTERM. The signal is sent from inside the step, not after a
    wall-clock wait, so what is checked does not depend on how fast the machine is."""
    from lintrans.cli import main
    from lintrans.train import loop

    step, handler = loop._Run.train_step, signal.getsignal(signal.SIGTERM)

    def train_step(self, lr):
        out = step(self, lr)
        assert self.step < 10, "SIGTERM did not stop the loop"
        if self.step == 2:  # the third step (self.step counts those done before it)
            assert signal.getsignal(signal.SIGTERM) not in (handler, signal.SIG_DFL), "no handler: it would kill pytest"
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(loop._Run, "train_step", train_step)
    cfg = tiny_config(**{"train.max_steps": 100000})
    args = [f"--set={k}={v}" for k, v in {
        "data.source": cfg.data.source, "data.tokenizer": "bytes", "data.cache_dir": cfg.data.cache_dir,
        "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16, "model.block_size": 16,
        "train.batch_size": 4, "train.max_steps": 100000, "train.out_dir": cfg.train.out_dir,
        "train.progress": False, "train.device": "cpu", "train.eval_interval": 1000,
    }.items()]
    assert main(["train", *args]) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == handler  # the loop's handler is gone again
    assert "stopped by signal at step 3" in capsys.readouterr().err
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[-1])["step"] == read_state(tmp_path / "run")["step"] == 3


def test_linear_attention_trains_and_resumes(tiny_config):
    settings = {"model.attention": "linear", "train.max_steps": 4}
    straight = train(tiny_config("a", **settings))
    train(tiny_config("b", **settings, **{"train.stop_after_steps": 2}))
    resumed = train(tiny_config("b", **settings))
    assert [resumed.losses[s] for s in (3, 4)] == [straight.losses[s] for s in (3, 4)]


@pytest.mark.parametrize("name, text, message", [
    ("trainer_state.json", '{"format": 1}', "trainer_state.json lacks ['step', 'tokens', 'sampler', 'rng', 'optimizer']"),
    ("config.json", "{}", "config.json lacks ['model']"),
    ("train_config.json", "[]", "train_config.json must hold a JSON object"),
])
def test_resume_from_a_checkpoint_missing_fields_is_one_error(tiny_config, name, text, message):
    first = train(tiny_config(**{"train.stop_after_steps": 1}))
    (first.out_dir / "checkpoint" / name).write_text(text)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        train(tiny_config())


def test_resume_applies_changed_optimizer_settings_and_says_so(tiny_config, capsys):
    train(tiny_config(**{"train.stop_after_steps": 1}))
    capsys.readouterr()
    result = train(tiny_config(**{"train.stop_after_steps": 1, "optim.weight_decay": 0.3, "optim.beta2": 0.9}))
    err = capsys.readouterr().err
    assert "optim.weight_decay changed from 0.1 in the checkpoint to 0.3" in err
    assert "optim.beta1/beta2 changed from (0.9, 0.95) in the checkpoint to (0.9, 0.9)" in err
    state = ckpt.read_checkpoint(result.out_dir / "checkpoint")["trainer_state"]["optimizer"]["param_groups"]
    assert state[0]["weight_decay"] == 0.3 and state[1]["weight_decay"] == 0.0 and list(state[0]["betas"]) == [0.9, 0.9]


def test_resume_says_what_changes_the_schedule_or_the_batches(tiny_config, capsys):
    train(tiny_config(**{"train.stop_after_steps": 1}))
    capsys.readouterr()
    train(tiny_config(**{"train.stop_after_steps": 1, "optim.lr": 2e-3, "train.max_steps": 50}))
    err = capsys.readouterr().err
    assert "resume: optim.lr changed from 0.003 in the checkpoint to 0.002" in err
    assert "resume: train.max_steps changed from" in err


def test_resume_survives_a_metrics_line_cut_short(tiny_config, capsys):
    """A crash mid-append leaves a torn last line in metrics.jsonl: resume leaves it out and says so."""
    first = train(tiny_config(**{"train.stop_after_steps": 2}))
    with open(first.out_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.')
    capsys.readouterr()
    result = train(tiny_config(**{"train.stop_after_steps": 1}))
    assert "left out 1 unreadable line(s)" in capsys.readouterr().err
    rows = [json.loads(line) for line in open(result.out_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_abandoned_save_folders_are_removed_at_the_next_start(tiny_config, capsys):
    first = train(tiny_config(**{"train.stop_after_steps": 1}))
    junk = first.out_dir / ".checkpoint.tmp-abc123"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"x" * 100)
    train(tiny_config(**{"train.stop_after_steps": 1}))
    assert not junk.exists() and "removed" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_init_from_starts_from_the_weights_and_can_swap_attention(tiny_config, attention, capsys):
    import warnings

    teacher = train(tiny_config("teacher", **{"train.max_steps": 40}))
    fresh = train(tiny_config("fresh", **{"train.max_steps": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fine-tuning the swapped attention is what the run does: no warning
        tuned = train(tiny_config("tuned", **{"train.max_steps": 1, "model.attention": attention,
                                             "train.init_from": str(teacher.out_dir / "checkpoint")}))
    err = capsys.readouterr().err
    assert f"initial weights from {teacher.out_dir / 'checkpoint'}, run with {attention} attention" in err
    assert ("this run fine-tunes them" in err) == (attention != "softmax") and "until it is fine-tuned" not in err
    assert tuned.losses[1] < fresh.losses[1] - 0.5  # it starts where the teacher got to, not from scratch
    from lintrans.models import load_model

    assert load_model(tuned.out_dir / "checkpoint").config.attention == attention
    with pytest.raises(FileNotFoundError, match="^train.init_from: name_or_path '.*nope': no such file or folder"):
        train(tiny_config("bad", **{"train.init_from": str(teacher.out_dir / "nope")}))


def test_bare_cli_init_from_keeps_the_checkpoints_attention(tiny_config, capsys):
    """With no --config the CLI reads the shipped tiny config, whose model says softmax: with
    train.init_from that section must not swap a linear checkpoint to softmax; the command line's
    own model keys still apply."""
    from lintrans.cli import main
    from lintrans.models import load_model

    cfg = tiny_config("lin", **{"model.attention": "linear", "train.max_steps": 1})
    train(cfg)
    start = f"{cfg.train.out_dir}/checkpoint"
    common = [f"--set=data.source={cfg.data.source}", f"--set=data.cache_dir={cfg.data.cache_dir}",
              "--set=train.batch_size=2", "--set=train.max_steps=1", "--set=train.eval_batches=1",
              "--set=train.progress=false", f"--set=train.init_from={start}"]
    out = str(cfg.train.out_dir) + "-tuned"
    assert main(["train", *common, f"--set=train.out_dir={out}"]) == 0
    assert load_model(out + "/checkpoint").config.attention == "linear"
    assert "the model is train.init_from's" in capsys.readouterr().err
    assert main(["train", *common, f"--set=train.out_dir={out}-softmax", "--model.attention", "softmax"]) == 0
    assert load_model(out + "-softmax/checkpoint").config.attention == "softmax"
    # an option of the checkpoint's attention is checked against it, not against the tiny config's softmax
    assert main(["train", *common, f"--set=train.out_dir={out}-chunk", "--set=model.attention_options.chunk_size=8"]) == 0
    assert load_model(out + "-chunk/checkpoint").config.attention_options == {"chunk_size": 8}
    # an empty init_from starts from nothing: the tiny config's model, not GPTConfig's GPT-2 defaults
    capsys.readouterr()
    assert main(["train", "--train.init_from", "", "--print-config"]) == 0
    assert "n_layer: 4" in capsys.readouterr().out


def test_folders_that_cannot_be_created_name_their_key(tiny_config, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="^train.out_dir .* cannot be created"):
        train(tiny_config(**{"train.out_dir": str(tmp_path / "file" / "run")}))
    with pytest.raises(ValueError, match="^data.cache_dir .* cannot be created"):
        train(tiny_config(**{"data.cache_dir": str(tmp_path / "file" / "cache")}))


@pytest.mark.parametrize("setting, message", [
    ({"train.out_dir": "FILE/run"}, "^train.out_dir .* cannot be created: .* is not a directory"),
    ({"train.device": "auto", "train.precision": "fp16"}, "fp16"),
])
def test_settings_that_cannot_work_fail_before_the_data_is_read(tiny_config, tmp_path, monkeypatch, setting, message):
    """Tokenising a large corpus takes hours: an out_dir that cannot be made, or fp16 on a CPU reached
    through train.device=auto, fails before it, and the out_dir is not made."""
    import lintrans.train.loop as loop

    if setting.get("train.precision") == "fp16" and torch.cuda.is_available():
        pytest.skip("fp16 is allowed on CUDA")
    (tmp_path / "FILE").write_text("x")
    setting = {k: v.replace("FILE", str(tmp_path / "FILE")) for k, v in setting.items()}
    monkeypatch.setattr(loop._Run, "load_data", lambda self: pytest.fail("read the data first"))
    with pytest.raises(ValueError, match=message):
        train(tiny_config(**setting))


def test_resume_drops_train_log_lines_after_the_checkpoint(tiny_config):
    """A run killed after an evaluation it had not checkpointed trains those steps again: their old
    train.log lines go, as their metrics rows do, so each evaluation has one line."""
    first = train(tiny_config(**{"train.stop_after_steps": 3}))
    log = first.out_dir / "train.log"
    with open(log, "a") as f:
        f.write("step 6/6: train loss 9.9, val loss 9.9 (from the killed process)\n")
    train(tiny_config())
    lines = log.read_text().splitlines()
    assert not any("killed process" in ln for ln in lines)
    assert sum(ln.startswith("step 6/6") for ln in lines) == sum(ln.startswith("step 3/6") for ln in lines) == 1


def test_invalid_attention_is_reported_as_such_when_a_run_folder_exists(tiny_config):
    train(tiny_config(**{"train.stop_after_steps": 1}))
    with pytest.raises(ValueError, match="attention must be one of .* got 'flash'"):
        train(tiny_config(**{"model.attention": "flash"}))


def test_context_parallel_needs_as_many_processes(tiny_config):
    with pytest.raises(ValueError, match="splits every sequence over 2 processes: launch a multiple of 2"):
        train(tiny_config(**{"model.attention": "linear", "train.context_parallel": 2}))


def test_fsdp_in_one_process_is_the_plain_model(tiny_config):
    """train.parallel = "fsdp" without torchrun: nothing to shard, the plain path runs (the same losses)
    and peak memory is still reported. Real sharding is tested in test_distributed.py (slow)."""
    plain = train(tiny_config("plain", **{"train.max_steps": 3}))
    fsdp = train(tiny_config("fsdp", **{"train.max_steps": 3, "train.parallel": "fsdp"}))
    assert fsdp.losses == plain.losses
    assert len(fsdp.peak_memory) == 1 and fsdp.peak_memory[0] > 2**20


def test_resume_with_init_from_does_not_read_the_initial_weights(tiny_config, capsys):
    import shutil

    teacher = train(tiny_config("teacher", **{"train.max_steps": 2}))
    init = teacher.out_dir.parent / "init"
    shutil.copytree(teacher.out_dir / "checkpoint", init)
    first = train(tiny_config("tuned", **{"train.max_steps": 4, "train.stop_after_steps": 2,
                                          "model.attention": "linear", "train.init_from": str(init)}))
    assert first.stopped == "stop_after" and "initial weights from" in capsys.readouterr().err
    shutil.rmtree(init)  # resuming needs only the run's own checkpoint
    resumed = train(tiny_config("tuned", **{"train.max_steps": 4, "model.attention": "linear",
                                            "train.init_from": str(init)}))
    err = capsys.readouterr().err
    assert "initial weights from" not in err and "resuming from" in err and resumed.step == 4
    # a weight-preserving key that disagrees with the checkpoint is still caught
    with pytest.raises(ValueError, match="model.attention"):
        train(tiny_config("tuned", **{"train.max_steps": 6, "model.attention": "softmax",
                                      "train.init_from": str(init)}))


@pytest.mark.parametrize("options", [
    {"feature_map": "rebased"},
    {"feature_map": "hedgehog", "feature_map_options": {"bias": True}},
])
@pytest.mark.parametrize("per_head", [True, False])
def test_feature_map_gains_and_biases_are_not_decayed(options, per_head):
    """ReBased's norm gain and bias and Hedgehog's bias are 2-D when stacked per head (the default):
    they were decayed then (the gain pulled toward 0) and not when shared across heads. AFT's position
    biases decay, as position embeddings do."""
    from lintrans.models import GPTConfig
    from lintrans.train.config import load_config

    cfg = load_config(None, [])
    for attention, opts in (("linear", {**options, "per_head": per_head}), ("aft-conv", {})):
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, attention=attention,
                              attention_options=opts))
        decay, no_decay = build_optimizer(model, cfg, torch.device("cpu")).param_groups
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay["params"]}
        kept = {names[id(p)] for p in no_decay["params"]}
        if attention == "linear":
            special = {n for n in names.values() if n.rsplit(".", 1)[-1] in ("gamma", "beta", "bias") and ".phi_" in n}
            assert special and special <= kept, (special, decayed)
            assert any(".phi_" in n for n in decayed) == (options["feature_map"] == "hedgehog")  # its weight
        else:
            assert "transformer.h.0.attn.pos_bias" in decayed


def test_a_checkpoint_grouped_by_dimension_resumes(tiny_config, monkeypatch, capsys):
    """A checkpoint saved when per-head feature-map gains were decayed (by dimension only) resumes with
    that grouping, said once, instead of failing on the optimizer state."""
    import lintrans.train.loop as loop

    opts = {"model.attention": "linear", "model.attention_options": {"feature_map": "rebased"}}
    monkeypatch.setattr(loop, "_exempt_from_decay", lambda model: set())  # the grouping before the fix
    train(tiny_config(**opts, **{"train.stop_after_steps": 3}))
    monkeypatch.undo()
    capsys.readouterr()
    done = train(tiny_config(**opts))
    assert done.step == 6 and done.stopped == "done"
    assert "grouped by dimension, before they were exempt" in capsys.readouterr().err


def test_init_from_new_parameters_follow_train_seed(tiny_config):
    """An attention swap's new parameters (gated-linear's gate) come from train.seed, whatever random
    numbers the process drew before (they were drawn before the seed was set)."""
    from lintrans.models import load_model

    teacher = train(tiny_config("teacher", **{"train.max_steps": 2}))
    start = str(teacher.out_dir / "checkpoint")

    def gate(out, seed, noise):
        torch.manual_seed(noise)
        torch.rand(7)
        run = train(tiny_config(out, **{"train.max_steps": 1, "train.seed": seed,
                                        "model.attention": "gated-linear", "train.init_from": start}))
        return load_model(run.out_dir / "checkpoint").transformer.h[0].attn.gate.weight

    a, b, c = gate("a", 1, 0), gate("b", 1, 5), gate("c", 2, 0)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_warm_up_longer_than_the_run_is_warned(tiny_config, capsys):
    train(tiny_config(**{"optim.warmup_steps": 10, "train.max_steps": 4}))
    err = capsys.readouterr().err
    assert "optim.warmup_steps (10) >= train.max_steps (4)" in err and "never decays" in err
    train(tiny_config("other"))
    assert "warmup_steps" not in capsys.readouterr().err


def test_resume_with_another_batch_says_the_validation_windows_change(tiny_config, capsys):
    train(tiny_config(**{"train.stop_after_steps": 2}))
    capsys.readouterr()
    train(tiny_config(**{"train.stop_after_steps": 3, "train.tokens_per_update": 64}))  # 4 x 16: the same batch
    err = capsys.readouterr().err
    assert "tokens_per_update changed" in err and "other validation windows" not in err
    train(tiny_config(**{"train.batch_size": 8}))
    err = capsys.readouterr().err
    assert "train.batch_size changed from 4" in err and "on is measured on other validation windows" in err


def test_resume_keeps_this_devices_optimizer_implementation(tmp_path):
    """A checkpoint saved where AdamW ran fused (CUDA) keeps its hyper-parameters on resume, not its choice of
    kernels: the optimizer runs as it was built for this device."""
    from lintrans.models import GPT, GPTConfig
    from lintrans.train import checkpoint as ckpt

    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8))
    built = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elsewhere = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    elsewhere.step()
    for g in elsewhere.param_groups:
        g["fused"], g["foreach"] = True, False  # as a CUDA save writes them
    state = {"step": 1, "tokens": 0, "sampler": {}, "rng": ckpt.rng_state()}
    path = ckpt.save_checkpoint(tmp_path, model, elsewhere, state, {}, {})
    before = [(g["fused"], g["foreach"]) for g in built.param_groups]
    ckpt.load_optimizer(path, built)
    assert [(g["fused"], g["foreach"]) for g in built.param_groups] == before
    assert built.state_dict()["state"][0]["step"] == 1  # the state itself did load
