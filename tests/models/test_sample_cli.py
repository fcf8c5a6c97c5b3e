import pytest
import torch

from lintrans.cli import main
from lintrans.models import GPT, GPTConfig
from lintrans.models.hf import save_model


@pytest.fixture
def byte_checkpoint(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=257, attention="linear"))
    return save_model(model, tmp_path / "ckpt"), model


def test_sample_streams_the_greedy_continuation(byte_checkpoint, capsys):
    path, model = byte_checkpoint
    rc = main(["sample", "--checkpoint", str(path), "--prompt", "ab", "--max-new-tokens", "12",
               "--temperature", "0", "--tokenizer", "bytes"])
    assert rc == 0
    out = capsys.readouterr().out
    ids = model.generate(torch.tensor([list(b"ab")]), 12, temperature=0)[0].tolist()
    ids = ids[: ids.index(256, 2)] if 256 in ids[2:] else ids  # a sample ends at the end-of-text token
    expected = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    assert out == expected + "\n"


def test_sample_ends_at_the_end_of_text_unless_told_otherwise(tmp_path, capsys):
    """A model that always predicts end-of-text: the sample ends there (it printed GPT-2's
    '<|endoftext|>' again and again; bytes dropped it silently and went on); --ignore-eot goes on."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=257, attention="linear"))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied to the embedding: only eot keeps a row, whose logit ln_f's bias makes > 0
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[256].fill_(5.0)
    path = save_model(model, tmp_path / "eot")
    argv = ["sample", "--checkpoint", str(path), "--prompt", "ab", "--max-new-tokens", "5", "--temperature", "0",
            "--tokenizer", "bytes"]
    assert model.generate(torch.tensor([list(b"ab")]), 1, temperature=0)[0, -1] == 256
    assert main(argv) == 0
    assert capsys.readouterr().out == "ab\n"
    asked = []
    stream = GPT.generate_stream

    def recording(self, *a, **kw):
        asked.append(kw.get("eos_token_id"))
        return stream(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GPT, "generate_stream", recording)
        assert main([*argv, "--ignore-eot"]) == 0
        assert main(argv) == 0
    assert asked == [None, 256]
    assert capsys.readouterr().out == "ab\n" * 2  # bytes' eot has no text: going on past it prints nothing


def test_sample_is_seeded(byte_checkpoint, capsys):
    path, _ = byte_checkpoint
    args = ["sample", "--checkpoint", str(path), "--prompt", "x", "--max-new-tokens", "8", "--seed", "3",
            "--top-k", "50", "--top-p", "0.9"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_sample_bad_input(byte_checkpoint, tmp_path, capsys):
    path, _ = byte_checkpoint
    assert main(["sample", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(path), "--tokenizer", "gpt2", "--prompt", "hi"]) == 2
    assert "tokenizer 'gpt2' has 50257 tokens" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(path), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be an int >= 1" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(path), "--num-samples", "0"]) == 2
    assert "--num-samples must be an int >= 1, got 0" in capsys.readouterr().err


def test_sample_on_a_training_run_folder_names_its_checkpoint(tmp_path, capsys):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=257))
    save_model(model, tmp_path / "run" / "checkpoint")
    assert main(["sample", "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "neither config.json" in err and f"its checkpoint is {tmp_path / 'run' / 'checkpoint'}" in err
    (tmp_path / "empty").mkdir()
    assert main(["sample", "--checkpoint", str(tmp_path / "empty")]) == 2
    assert "its checkpoint is" not in capsys.readouterr().err


def test_sample_past_the_block_size_and_several_samples(byte_checkpoint, capsys):
    path, _ = byte_checkpoint  # block_size 64: 200 new tokens need the context cropped
    assert main(["sample", "--checkpoint", str(path), "--max-new-tokens", "200", "--prompt", "x",
                 "--num-samples", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n---\n") == 1  # two samples, one separator


def test_sample_uses_the_tokenizer_the_checkpoint_records(tmp_path, capsys):
    # a vocabulary as large as GPT-2's: without the record the guess would be gpt2
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=50304))
    save_model(model, tmp_path, extra_config={"tokenizer": "bytes"})
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    ids = model.generate(torch.tensor([list(b"hi")]), 3, temperature=0, vocab_limit=257)[0].tolist()
    assert capsys.readouterr().out == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") + "\n"


@pytest.mark.parametrize("how", ["config file", "hf folder", "no record"])
def test_sample_finds_the_byte_tokenizer_from_any_path_to_the_checkpoint(tmp_path, capsys, how):
    """--checkpoint DIR/config.json and --hf DIR read the record too; a model without one but too small
    for GPT-2's vocabulary (lintrans pads 257 bytes to 320) is a byte model, not an error."""
    # with a record, a vocabulary as large as GPT-2's: only the record can make it bytes
    vocab = 320 if how == "no record" else 50304
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=vocab))
    save_model(model, tmp_path, extra_config=None if how == "no record" else {"tokenizer": "bytes"})
    source = {"config file": ["--checkpoint", str(tmp_path / "config.json")],
              "hf folder": ["--hf", str(tmp_path)], "no record": ["--checkpoint", str(tmp_path)]}[how]
    assert main(["sample", *source, "--prompt", "hi", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    ids = model.generate(torch.tensor([list(b"hi")]), 3, temperature=0, vocab_limit=257)[0].tolist()
    assert capsys.readouterr().out == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") + "\n"


def test_sample_never_draws_a_padding_id(tmp_path, capsys):
    """GPT-2's 50257 tokens in a 50304-row table: an untrained model gives the 47 padding ids real
    probability, and a drawn one has no text (it crashed the GPT-2 decoder; bytes dropped it)."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=64, vocab_size=50304))
    with torch.no_grad():
        model.lm_head.weight[50257:] += 50.0  # make the padding ids the likeliest
    save_model(model, tmp_path, extra_config={"tokenizer": "gpt2"})
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "20",
                 "--seed", "0"]) == 0
    ids = model.generate(torch.tensor([[5]]), 20, seed=0, vocab_limit=50257)[0]
    assert int(ids.max()) < 50257
    with pytest.raises(ValueError, match="vocab_limit must be an int in"):
        model.generate(torch.tensor([[5]]), 2, vocab_limit=50305)


def test_sample_swaps_to_an_attention_with_other_options(tmp_path, capsys):
    """A DeltaNet checkpoint saved with conv_init: --attention linear leaves that option out (with a
    warning) instead of refusing it as unknown to linear attention."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=320, attention="deltanet",
                          attention_options={"conv_init": "identity"}))
    save_model(model, tmp_path, extra_config={"tokenizer": "bytes"})
    with pytest.warns(UserWarning, match=r"\['conv_init'\] of 'deltanet' are not options of 'linear'"):
        assert main(["sample", "--checkpoint", str(tmp_path), "--attention", "linear", "--prompt", "hi",
                     "--max-new-tokens", "3", "--temperature", "0"]) == 0


def test_sample_on_a_missing_device_is_one_line(byte_checkpoint, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path, _ = byte_checkpoint
    assert main(["sample", "--checkpoint", str(path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device is 'cuda' but no CUDA device is available" in err and "Traceback" not in err


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:50]), "model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10" * 300), "model.safetensors"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:20]), "config.json is not valid JSON"),
    (lambda d: (d / "config.json").write_text("[]"), "config.json must hold a JSON object, got list"),
    (lambda d: (d / "config.json").write_text('{"model": {"n_layer": "x"}}'), "config.json"),
])
def test_sample_on_a_damaged_checkpoint_is_one_line_and_touches_nothing(tmp_path, capsys, damage, message):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=300))
    save_model(model, tmp_path)
    damage(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_sample_falls_back_to_checkpoint_old_and_warns_on_swapped_attention(tmp_path, capsys):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=300))
    save_model(model, tmp_path / "checkpoint.old")  # a save stopped between its two renames
    args = ["sample", "--checkpoint", str(tmp_path / "checkpoint"), "--prompt", "hi", "--max-new-tokens", "2",
            "--tokenizer", "bytes"]
    assert main(args) == 0
    with pytest.warns(UserWarning, match="trained with 'softmax' attention and is loaded with 'linear'"):
        assert main([*args, "--attention", "linear"]) == 0


def test_sample_from_checkpoint_old_reads_its_tokenizer_too(tmp_path, capsys):
    """The weights come from checkpoint.old, so must the tokenizer its config.json records (with a
    vocabulary as large as GPT-2's, a guess would be gpt2)."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=50304))
    save_model(model, tmp_path / "checkpoint.old", extra_config={"tokenizer": "bytes"})
    assert main(["sample", "--checkpoint", str(tmp_path / "checkpoint"), "--prompt", "hi", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    ids = model.generate(torch.tensor([list(b"hi")]), 3, temperature=0, vocab_limit=257)[0].tolist()
    assert capsys.readouterr().out == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") + "\n"


def test_cli_warnings_are_one_line_while_a_command_runs(tmp_path, monkeypatch):
    import warnings

    from lintrans import cli

    seen = []
    sample = cli._load("sample")

    def run(args):
        seen.append(warnings.formatwarning(UserWarning("careful"), UserWarning, "x.py", 3, "src"))

    monkeypatch.setattr(sample, "run", run)
    before = warnings.formatwarning
    assert main(["sample", "--checkpoint", str(tmp_path)]) == 0
    assert seen == ["lintrans: UserWarning: careful\n"]  # no file, line number or source line
    assert warnings.formatwarning is before  # restored after the command


def test_prompt_from_a_file_or_standard_input(byte_checkpoint, tmp_path, capsys, monkeypatch):
    """--prompt-file PATH (or - for stdin): the same continuation as --prompt with its text; a missing
    file or an empty one is a one-line error."""
    import io

    path, _ = byte_checkpoint
    base = ["sample", "--checkpoint", str(path), "--max-new-tokens", "6", "--temperature", "0", "--tokenizer", "bytes"]
    assert main([*base, "--prompt", "héllo\nthere"]) == 0
    want = capsys.readouterr().out
    f = tmp_path / "p.txt"
    f.write_text("héllo\nthere", encoding="utf-8")
    assert main([*base, "--prompt-file", str(f)]) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr("sys.stdin", io.StringIO("héllo\nthere"))
    assert main([*base, "--prompt-file", "-"]) == 0
    assert capsys.readouterr().out == want
    assert main([*base, "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "--prompt-file" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert main([*base, "--prompt-file", str(tmp_path / "empty.txt")]) == 2
    assert "--prompt-file must not be empty" in capsys.readouterr().err
