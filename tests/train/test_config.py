import pytest

from lintrans.cli import main
from lintrans.train.config import TrainConfig, load_config, write_resolved

TOML = """
[model]
n_layer = 2
attention = "linear"
attention_options = { feature_map = "elu" }

[train]
max_steps = 50
tokens_per_update = 4096
"""

YAML = """
model: {n_layer: 2, attention: linear, attention_options: {feature_map: elu}}
train: {max_steps: 50, tokens_per_update: 4096}
"""


def test_toml_and_yaml_give_the_same_config(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    (tmp_path / "c.yaml").write_text(YAML)
    a, b = load_config(tmp_path / "c.toml"), load_config(tmp_path / "c.yaml")
    assert a == b
    assert a.model == {"n_layer": 2, "attention": "linear", "attention_options": {"feature_map": "elu"}}
    assert a.train.max_steps == 50 and a.train.tokens_per_update == 4096


def test_overrides_are_typed(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    cfg = load_config(tmp_path / "c.toml", [
        "train.max_steps=7", "optim.lr=1e-3", "train.compile=true", "train.micro_batch_size=none",
        "model.attention_options.chunk_size=32", "data.source=123",
    ])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-3 and cfg.train.compile is True
    assert cfg.model["attention_options"] == {"feature_map": "elu", "chunk_size": 32}
    assert cfg.data.source == "123"  # strings stay strings


@pytest.mark.parametrize("override, error, match", [
    ("train.max_stepz=5", ValueError, "unknown config key 'train.max_stepz'.*max_steps"),
    ("trian.max_steps=5", ValueError, "sections are"),
    ("train.max_steps=five", TypeError, "train.max_steps' must be an int >= 1, got 'five'"),
    ("train.compile=maybe", TypeError, "must be a bool"),
    ("model.n_layer=0", ValueError, "'model.n_layer' must be an int >= 1"),
    ("model.n_headz=2", ValueError, "unknown config key 'model.n_headz'"),
    ("model.mlp=relu", ValueError, "'model.mlp' must be one of"),
    ("optim.schedule=step", ValueError, "'optim.schedule' must be one of"),
    ("train.precision=fp8", ValueError, "'train.precision' must be one of"),
    ("data.tokenizer=gpt4", ValueError, "'data.tokenizer' must be one of"),
    ("train.max_steps", ValueError, "section.key=value"),
    ("train.parallel=zero3", ValueError, r"'train.parallel' must be one of \['ddp', 'fsdp'\]"),
    ("train.context_parallel=0", ValueError, "'train.context_parallel' must be an int >= 1, got 0"),
    ("model.n_layer.x=1", ValueError, "not a table"),
    # values AdamW, numpy's seeding or the .bin reader would reject only after the data is read
    ("optim.beta1=2", ValueError, "'optim.beta1' must be"),
    ("optim.beta2=-0.1", ValueError, "'optim.beta2' must be"),
    ("optim.eps=0", ValueError, "'optim.eps' must be"),
    ("train.seed=-1", ValueError, "'train.seed' must be"),
    ("data.bin_dtype=int8", ValueError, "'data.bin_dtype' must be one of"),
    ("optim.decay_steps=50", ValueError, "'optim.decay_steps' .* must be > optim.warmup_steps"),
])
def test_bad_overrides(override, error, match):
    with pytest.raises(error, match=match):
        load_config(None, [override])


def test_fsdp_refuses_reversible_layers_and_init_from_defers_the_model_checks():
    with pytest.raises(ValueError, match="cannot shard model.reversible"):
        load_config(None, ["train.parallel=fsdp", "model.reversible=true"])
    # with init_from the model is the initial weights' (checked once they are read), not cfg.model's softmax
    cfg = load_config(None, ["train.context_parallel=2", "train.init_from=gpt2"])
    assert cfg.train.context_parallel == 2


def test_fp16_refused_on_a_cpu_before_any_data():
    with pytest.raises(ValueError, match="'train.precision' 'fp16' needs a CUDA device"):
        load_config(None, ["train.precision=fp16", "train.device=cpu"])
    # a constant schedule has no decay, so decay_steps does not matter there
    assert load_config(None, ["optim.schedule=constant", "optim.decay_steps=50"]).optim.decay_steps == 50


def test_bad_file_values(tmp_path):
    (tmp_path / "a.toml").write_text('[train]\nmax_steps = "10"\n')
    with pytest.raises(TypeError, match="must be an int >= 1, got '10'"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "b.yaml").write_text("train: {max_steps: true}\n")
    with pytest.raises(TypeError, match="must be an int >= 1, got True"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("training: {max_steps: 3}\n")
    with pytest.raises(ValueError, match=r"unknown config sections \['training'\]"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.toml").write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(tmp_path / "d.toml")
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.toml")


def test_resolved_config_reads_back(tmp_path):
    cfg = load_config(None, ["model.n_layer=3", "optim.lr=0.01"])
    gpt = cfg.gpt_config(vocab_size=320)
    write_resolved(cfg, gpt, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.model == gpt.to_dict() and again.optim == cfg.optim and again.train == cfg.train
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_cli_reports_config_errors(capsys, tmp_path):
    assert main(["train", "--set", "train.max_stepz=1"]) == 2
    assert "unknown config key 'train.max_stepz'" in capsys.readouterr().err
    assert main(["train", "--model.n_layer", "x"]) == 2
    assert "model.n_layer" in capsys.readouterr().err
    assert main(["train", "--train.max_steps", "9", "--set", "model.n_layer=2", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 9" in out and "n_layer: 2" in out
    # --device is train.device: both at once is a contradiction, whichever order
    for argv in (["--device", "cpu", "--train.device", "cuda"], ["--train.device", "cuda", "--device", "cpu"]):
        assert main(["train", *argv, "--print-config"]) == 2
        assert "give --device or --train.device, not both" in capsys.readouterr().err
    assert main(["train", "--device", "cpu", "--print-config"]) == 0
    assert "device: cpu" in capsys.readouterr().out


def test_bare_train_uses_the_shipped_tiny_config_and_configs_load_by_name(capsys):
    from lintrans.train.config import shipped_configs

    assert {"tiny", "gpt2-124m"} <= set(shipped_configs())
    assert main(["train", "--print-config"]) == 0
    captured = capsys.readouterr()
    assert "using the shipped 'tiny' config" in captured.err and "n_embd: 128" in captured.out
    assert main(["train", "--config", "gpt2-124m", "--print-config"]) == 0
    assert "n_embd: 768" in capsys.readouterr().out
    assert main(["train", "--config", "nope", "--print-config"]) == 2
    assert "shipped configs, usable by name: ['gpt2-124m', 'tiny']" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("optim.lr=inf", "'optim.lr' must be a finite number, got inf"),
    ("optim.weight_decay=nan", "'optim.weight_decay' must be a finite number, got nan"),
    ("data.val_fraction=nan", "'data.val_fraction' must be a finite number"),
    ("model.attention=flash", "attention must be one of"),
    ("model.attention_options={\"feature_map\": \"nope\"}", "feature_map"),
])
def test_print_config_fails_like_a_run(override, message, capsys):
    assert main(["train", "--set", override, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_flag_for_a_key_inside_a_table_is_its_set(capsys):
    argv = ["train", "--model.attention", "linear", "--model.attention_options.form", "state_loop",
            "--model.attention_options.feature_map=relu", "--print-config"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "form: state_loop" in out and "feature_map: relu" in out
    assert main(["train", "--model.attention", "linear", "--model.attention_options.nope", "1", "--print-config"]) == 2
    assert "unknown attention_options ['nope']" in capsys.readouterr().err
    for argv in (["--model.attention_options.form"], ["--model.attention_options.form", "--train.max_steps", "3"]):
        with pytest.raises(SystemExit):  # no value (the next flag is not one): argparse's error, naming the flag
            main(["train", *argv])
        assert "unrecognized arguments: --model.attention_options.form" in capsys.readouterr().err
    # the whole table and a key inside it apply in the order given
    for first, then, want in (("relu", "elu", "elu"), ("elu", "relu", "relu")):
        assert main(["train", "--model.attention", "linear", "--model.attention_options", f'{{"feature_map": "{first}"}}',
                     "--model.attention_options.feature_map", then, "--print-config"]) == 0
        assert f"feature_map: {want}" in capsys.readouterr().out


def test_print_config_takes_options_that_build_tensors(capsys):
    # the config check builds a layer on the meta device; global_tokens used to become a meta tensor
    # there and fail on .item() although the run itself builds
    argv = ["train", "--model.attention", "sliding-window", "--set", "model.attention_options.global_tokens=[0, 3]"]
    assert main([*argv, "--print-config"]) == 0
    assert "global_tokens" in capsys.readouterr().out
    assert main([*argv[:-1], "model.attention_options.global_tokens=[-1]", "--print-config"]) == 2
    assert "attention_options of 'sliding-window': global_tokens positions must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("attention, block, message", [
    ("softmax", 64, "attention 'softmax' cannot do .*model.attention in .*'gated-linear', 'linear', 'none', 'retention'"),
    ("sliding-window", 64, "attention 'sliding-window' cannot do"),
    ("linear", 63, r"train.context_parallel = 2 must divide model.block_size \(63\)"),
])
def test_context_parallel_refuses_what_it_cannot_split(attention, block, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, ["train.context_parallel=2", f"model.attention={attention}", f"model.block_size={block}"])
    assert load_config(None, ["train.context_parallel=2", "model.attention=retention"]).train.context_parallel == 2


def test_print_config_with_init_from_names_the_model_keys_it_will_not_use(capsys):
    """With train.init_from the model is the weights'; a printed config with model.n_layer must not
    look as if it applied (the run says so only when it starts)."""
    from lintrans.cli import main

    assert main(["train", "--train.init_from", "some/weights", "--model.n_layer", "3", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert "['model.n_layer'] will not be used" in err
    assert main(["train", "--train.init_from", "some/weights", "--model.attention", "linear", "--print-config"]) == 0
    assert "will not be used" not in capsys.readouterr().err
