"""Fine-tuning takes the tokenizer the initial weights were trained with: GPT-2's weights read GPT-2's
token ids, and feeding them another tokenizer's ids trains nonsense without any error."""
import json

import pytest
import torch

from lintrans.cli import main
from lintrans.models.hf import trained_tokenizer

transformers = pytest.importorskip("transformers")


def hf_gpt2(folder):
    """A tiny GPT-2 with GPT-2's vocabulary, saved as Hugging Face saves it."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16))
    model.save_pretrained(folder)
    return folder


def test_trained_tokenizer_reads_what_a_folder_says(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"model": {"vocab_size": 320}, "tokenizer": "bytes"}))
    assert trained_tokenizer(ours) == "bytes" and trained_tokenizer(ours / "config.json") == "bytes"
    old = tmp_path / "ckpt.old"  # a save stopped between its renames: the old folder is the checkpoint
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"model": {}, "tokenizer": "gpt2"}))
    assert trained_tokenizer(tmp_path / "ckpt") == "gpt2"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    assert trained_tokenizer(hf) == "gpt2"
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 65}))  # nanoGPT's characters
    assert trained_tokenizer(hf) is None
    (hf / "config.json").write_text("[not a config")
    assert trained_tokenizer(hf) is None
    assert trained_tokenizer(tmp_path / "missing") is None and trained_tokenizer(None) is None


def test_trained_tokenizer_reads_a_nanogpt_checkpoints_vocabulary(tmp_path):
    """nanoGPT's rule: GPT-2's encoding unless the data folder has a character meta.pkl, so a
    checkpoint of 50257 tokens or more (50304 padded) is GPT-2's; a character one is unknown."""
    def ckpt(path, vocab):
        torch.save({"model": {}, "model_args": {"vocab_size": vocab, "n_layer": 1}}, path)
        return path

    assert trained_tokenizer(ckpt(tmp_path / "ckpt.pt", 50304)) == "gpt2"
    assert trained_tokenizer(tmp_path) == "gpt2"  # a folder holding ckpt.pt, as load_model reads it
    assert trained_tokenizer(ckpt(tmp_path / "chars.pt", 65)) is None
    (tmp_path / "damaged.pt").write_bytes(b"not a checkpoint")
    assert trained_tokenizer(tmp_path / "damaged.pt") is None


def _train_args(init_from, out):
    return ["train", "--train.init_from", str(init_from), "--train.max_steps", "1", "--train.batch_size", "2",
            "--train.eval_batches", "1", "--train.progress", "false", "--train.out_dir", str(out)]


def test_cli_fine_tuning_gpt2_weights_takes_gpt2s_tokenizer(tmp_path, capsys):
    """Without --config the shipped tiny config's data settings apply, whose tokenizer is bytes: the
    run now takes the weights' own (it trained GPT-2's weights on byte ids, silently)."""
    folder = hf_gpt2(tmp_path / "hf")
    assert main(_train_args(folder, tmp_path / "run")) == 0
    assert "data.tokenizer gpt2, the initial weights' own" in capsys.readouterr().err
    saved = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert saved["tokenizer"] == "gpt2"


def test_another_tokenizer_than_the_weights_is_refused(tmp_path, capsys):
    folder = hf_gpt2(tmp_path / "hf")
    assert main([*_train_args(folder, tmp_path / "run"), "--data.tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert "was trained with the gpt2 tokenizer, data.tokenizer is 'bytes': set data.tokenizer=gpt2" in err
