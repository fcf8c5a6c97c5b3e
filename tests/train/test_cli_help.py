"""`lintrans train --help` lists every config key with its help, type and default."""
import pytest

from lintrans.cli import main
from lintrans.config import keys
from lintrans.train.config import TrainConfig


def test_every_training_key_is_listed_with_help_type_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag: argparse would break words at hyphens
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for key, (_, meta) in keys(TrainConfig).items():
        assert meta.get("help"), f"{key} has no help text"
        assert f"--{key} " in out, key
        words = " ".join(meta["help"].split())
        assert words in out, key
        if meta["default"] not in (None, {}, []):
            default = meta["default"] if isinstance(meta["default"], str) else str(meta["default"]).lower()
            assert f"default {default}]" in out or f"default {meta['default']}]" in out, key
    assert "--model.n_layer INT transformer blocks [an int >= 1; default 12]" in out
    assert "--train.max_steps INT optimizer steps of the whole run [an int >= 1; default 1000]" in out
