"""python -m lintrans.bench.reformer: the record reproduces itself (settings, command, machine), and a
bad --device stops before any work or folder."""
import json

import pytest

from lintrans.bench import reformer


def test_record_holds_settings_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(reformer, "lsh_error", lambda T=8, H=1, D=4, chunk_size=4, n_buckets=2, hashes=(1, 2),
                        seeds=(0,): [{"input": "random", "n_hashes": 1, "rel_error": 0.5}])
    monkeypatch.setattr("lintrans.bench.machine.machine_info", lambda device="cpu": {"cpu": "test"})
    reformer.main(["error", "--out", str(tmp_path / "r"), "--device", "cpu"])
    record = json.loads((tmp_path / "r" / "error.json").read_text())
    assert record["command"] == f"python -m lintrans.bench.reformer error --out {tmp_path / 'r'} --device cpu"
    assert record["settings"] == {"T": 8, "H": 1, "D": 4, "chunk_size": 4, "n_buckets": 2, "hashes": [1, 2],
                                  "seeds": [0]}
    assert record["machine"] == {"cpu": "test"} and record["rows"][0]["rel_error"] == 0.5


@pytest.mark.parametrize("device", ["bogus", "cuda:99"])
def test_bad_device_stops_before_the_work(tmp_path, monkeypatch, device):
    monkeypatch.setattr(reformer, "reversible_memory", lambda *a, **k: pytest.fail("ran the work"))
    with pytest.raises(SystemExit, match="--device"):
        reformer.main(["memory", "--out", str(tmp_path / "r"), "--device", device])
    assert not (tmp_path / "r").exists()
