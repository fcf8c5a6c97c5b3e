"""`lintrans train --help` lists every config key with its help, type and the default of the bare
command (the shipped tiny config, then TrainConfig's and GPTConfig's defaults)."""
import pytest

from lintrans.cli import main
from lintrans.config import flatten, keys
from lintrans.train.config import TrainConfig, load_config, read_config_file


def test_every_training_key_is_listed_with_help_type_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag: argparse would break words at hyphens
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    tiny = flatten(TrainConfig, read_config_file("tiny"))
    for key, (_, meta) in keys(TrainConfig).items():
        assert meta.get("help"), f"{key} has no help text"
        assert f"--{key} " in out, key
        words = " ".join(meta["help"].split())
        assert words in out, key
        shown = tiny.get(key, meta["default"])
        if shown not in (None, {}, []) and key != "model.vocab_size":  # that one: its own line below
            default = shown if isinstance(shown, str) else str(shown).lower()
            assert f"default {default}]" in out or f"default {shown}]" in out, key
    # what a bare `lintrans train` uses, not the dataclasses' GPT-2 124M defaults
    assert "--model.n_layer INT transformer blocks [an int >= 1; default 4]" in out
    assert "--train.max_steps INT optimizer steps of the whole run [an int >= 1; default 1500]" in out
    bare = load_config("tiny")
    assert bare.model["n_layer"] == 4 and bare.train.max_steps == 1500 and bare.optim.lr == 2e-3
    assert ("--model.vocab_size INT" in out and
            "default the tokenizer's, rounded up to a multiple of 64 (bytes: 320, gpt2: 50304)]" in out)


def test_a_file_named_like_the_shipped_config_does_not_shadow_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("junk")
    assert main(["train", "--print-config"]) == 0  # the bare command: the package's tiny config
    assert "n_layer: 4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
