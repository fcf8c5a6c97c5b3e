"""chunk_size="auto": measured once per shape class, then served from the on-disk cache."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lintrans.ops import chunk_tuning as tune
from lintrans.ops import linear_attention


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A fresh cache dir and a fake, instant timer that makes chunk 32 the fastest; counts calls."""
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    calls = []

    def fake(chunk, q, k, v, log_decay=None, repeats=3, form="chunked"):
        calls.append(chunk if log_decay is None else ("gated", chunk))
        return abs(chunk - 32) + 1.0

    monkeypatch.setattr(tune, "measure_candidate", fake)
    return calls


def _qkv(T, D=8, Dv=8):
    g = torch.Generator().manual_seed(T)
    return torch.randn(1, T, 2, D, generator=g), torch.randn(1, T, 2, D, generator=g), torch.randn(1, T, 2, Dv, generator=g)


def test_auto_measures_once_then_reads_the_cache(counted, tmp_path):
    q, k, v = _qkv(100)
    o_auto, _ = linear_attention(q, k, v, chunk_size="auto")
    assert counted == [32, 64, 128]  # every candidate up to the T bucket (128), once
    o_32, _ = linear_attention(q, k, v, chunk_size=32)
    torch.testing.assert_close(o_auto, o_32)
    entry = json.loads((tmp_path / "chunk_size.json").read_text())
    assert [e["chunk_size"] for e in entry.values()] == [32]

    linear_attention(q, k, v, chunk_size="auto")  # same process: memo
    tune._memo.clear()  # a new process: only the file is left
    linear_attention(*_qkv(120), chunk_size="auto")  # same T bucket
    assert len(counted) == 3


def test_new_shape_class_is_measured(counted):
    linear_attention(*_qkv(100), chunk_size="auto")
    linear_attention(*_qkv(300), chunk_size="auto")  # another T bucket
    linear_attention(*_qkv(100, Dv=6), chunk_size="auto")  # another head dim
    assert len(counted) == 3 + 4 + 3


def test_key_separates_dtype_dims_and_bucket():
    keys = {
        tune.cache_key("cpu", torch.float32, 64, 64, 1000),
        tune.cache_key("cpu", torch.float64, 64, 64, 1000),
        tune.cache_key("cpu", torch.float32, 32, 64, 1000),
        tune.cache_key("cpu", torch.float32, 64, 65, 1000),
        tune.cache_key("cpu", torch.float32, 64, 64, 3000),
    }
    assert len(keys) == 5
    assert tune.cache_key("cpu", torch.float32, 64, 64, 1000) == tune.cache_key("cpu", torch.float32, 64, 64, 1024)
    assert tune.t_bucket(1) == 64 and tune.t_bucket(10**6) == tune.MAX_BUCKET


def test_corrupt_cache_is_remeasured(counted, tmp_path):
    (tmp_path / "chunk_size.json").write_text("{not json")
    linear_attention(*_qkv(50), chunk_size="auto")
    assert len(counted) == 2  # 32, 64 <= bucket 64


@pytest.mark.parametrize("cached", [True, 48, 4096, -1])
def test_a_cached_entry_that_is_no_candidate_is_remeasured(counted, tmp_path, cached):
    key = tune.cache_key("cpu", torch.float32, 8, 8, 50, False)
    (tmp_path / "chunk_size.json").write_text(json.dumps({key: {"chunk_size": cached}}))
    linear_attention(*_qkv(50), chunk_size="auto")
    assert len(counted) == 2 and tune.auto_chunk_size(50, 8, 8) == 32


def test_first_measurement_inside_inference_mode(tmp_path, monkeypatch):
    """A model's first forward under torch.inference_mode can be what triggers the measurement."""
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    monkeypatch.setattr(tune, "CANDIDATES", (32, 64))
    with torch.inference_mode():
        o, _ = linear_attention(*_qkv(40), chunk_size="auto")
    assert o.shape == (1, 40, 2, 8) and json.loads((tmp_path / "chunk_size.json").read_text())


@pytest.mark.parametrize("bad,err", [("fast", TypeError), (0, ValueError), (-4, ValueError), (2.5, TypeError),
                                     (True, TypeError), (None, TypeError)])
def test_invalid_chunk_size_rejected(bad, err):
    with pytest.raises(err, match="chunk_size"):
        linear_attention(*_qkv(8), chunk_size=bad)


def test_real_measurement_picks_a_candidate():
    best, timings = tune.tune_chunk_size(64, 4, 4, candidates=(16, 32), repeats=1)
    assert best in (16, 32) and set(timings) == {16, 32} and all(t > 0 for t in timings.values())


def test_gated_calls_tune_their_own_entry(counted, tmp_path):
    q, k, v = _qkv(100)
    ld = -torch.rand(1, 100, 2)
    linear_attention(q, k, v, chunk_size="auto")
    o_auto, _ = linear_attention(q, k, v, chunk_size="auto", log_decay=ld)
    assert counted == [32, 64, 128, ("gated", 32), ("gated", 64), ("gated", 128)]
    torch.testing.assert_close(o_auto, linear_attention(q, k, v, chunk_size=32, log_decay=ld)[0])
    keys = list(json.loads((tmp_path / "chunk_size.json").read_text()))
    assert len(keys) == 2 and sum(k.endswith("|gated") for k in keys) == 1


def test_real_gated_measurement_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    best, timings = tune.tune_chunk_size(64, 4, 4, repeats=1, gated=True)
    assert best in timings and set(timings) == {32, 64}


def test_cache_dir_honours_lintrans_then_xdg(monkeypatch, tmp_path):
    from lintrans._platform import cache_dir

    monkeypatch.delenv("LINTRANS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune.cache_file() == tmp_path / "xdg" / "lintrans" / "chunk_size.json"
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def test_the_op_layer_does_not_import_the_benchmarks():
    import subprocess
    import sys

    code = "import sys, lintrans.ops, lintrans.ops.chunk_tuning; print(any(m.startswith('lintrans.bench') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_cpu_entry_names_the_vector_features():
    """One model name ("AMD EPYC") covers CPUs with and without AVX-512, whose best chunks differ."""
    from lintrans._platform import cpu_vector_features

    key = tune.cache_key("cpu", torch.float32, 64, 64, 4096)
    assert f"[{cpu_vector_features().replace(' ', ',')}]" in key


def test_the_key_names_the_path_form_and_torch_that_the_chunk_was_measured_on(monkeypatch, counted):
    """A chunk measured on the fused kernel was reused by calls the kernel cannot run (the based map, other
    forms), and across torch versions."""
    calls = counted
    seen = []
    monkeypatch.setattr(tune, "measure_candidate",
                        lambda c, q, k, v, ld=None, repeats=3, form="chunked":
                        seen.append((form, os.environ.get("LINTRANS_NATIVE")))
                        or abs(c - 32) + 1.0)
    keys = {tune.cache_key("cpu", torch.float32, 8, 8, 64, kernel=True),
            tune.cache_key("cpu", torch.float32, 8, 8, 64, kernel=False),
            tune.cache_key("cpu", torch.float32, 8, 8, 64, form="attention_blocked", kernel=False)}
    assert len(keys) == 3 and all(f"torch{torch.__version__}" in k for k in keys)
    tune.auto_chunk_size(64, 8, 8, kernel=False)
    assert seen and all(native == "0" for _, native in seen)  # timed on the PyTorch blocks
    seen.clear()
    tune.auto_chunk_size(64, 8, 8, form="attention_blocked", kernel=False)
    assert seen and all(form == "attention_blocked" for form, _ in seen)
    assert calls == []


def test_tune_remeasures_a_damaged_entry_and_an_unwritable_cache_only_warns(monkeypatch, tmp_path, counted, capsys):
    from lintrans.cli import main

    key = tune.cache_key("cpu", torch.float32, 8, 8, 100)
    (tmp_path / "chunk_size.json").write_text(json.dumps({key: {"chunk_size": 64}}))  # no seconds
    assert main(["tune", "--T", "100", "--head-dim", "8"]) == 0
    assert "(cached)" not in capsys.readouterr().out
    monkeypatch.setattr(tune, "_memo", {})
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        assert tune.auto_chunk_size(100, 8, 8) == 32


def test_processes_storing_at_once_keep_every_entry(tmp_path):
    code = ("import sys; from lintrans.ops import chunk_tuning as t\n"
            "for i in range(15): t.save_entry(f'{sys.argv[1]}{i}', {'chunk_size': 32, 'seconds': {}})")
    env = {**os.environ, "LINTRANS_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, name], env=env) for name in "ab"]
    assert [p.wait() for p in procs] == [0, 0]
    assert len(json.loads((tmp_path / "chunk_size.json").read_text())) == 30
