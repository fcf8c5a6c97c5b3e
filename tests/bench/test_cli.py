"""The bench subcommands parse and run end to end on tiny settings (nothing is timed or asserted on time)."""
import json

from lintrans.bench import tune
from lintrans.cli import main


def test_cost_prints_every_section(capsys):
    assert main(["cost", "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--vocab", "100", "--T", "64",
                 "--step-time", "0.5", "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    for what in ("parameters:", "training FLOPs", "KV cache", "arithmetic intensity", "overtake", "MFU"):
        assert what in out


def test_tune_writes_then_reads_the_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    calls = []
    monkeypatch.setattr(tune, "measure_candidate", lambda c, *a, **k: calls.append(c) or float(c))
    assert main(["tune", "--T", "100", "--head-dim", "8"]) == 0
    assert main(["tune", "--T", "100", "--head-dim", "8"]) == 0
    assert calls == [32, 64, 128]
    assert "(cached)" in capsys.readouterr().out
    assert list(json.loads((tmp_path / "chunk_size.json").read_text()).values())[0]["chunk_size"] == 32


def test_bench_ops_writes_results(tmp_path, monkeypatch):
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    monkeypatch.setattr(tune, "measure_candidate", lambda c, *a, **k: float(c))
    out = tmp_path / "res"
    assert main(["bench", "ops", "--max-T", "256", "--ops", "chunked", "softmax", "--out", str(out)]) == 0
    data = json.loads((out / "ops.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"softmax (SDPA)", "linear chunked", "linear chunked gated"}
    assert [(s["fast"], s["slow"]) for s in data["speedups"]] == [
        ("linear chunked", "softmax (SDPA)"), ("linear chunked gated", "linear chunked"),
        ("linear chunked gated", "softmax (SDPA)")]
    assert data["machine"]["torch"] and (out / "ops.png").stat().st_size > 0
    m = data["machine"]  # the matmul speed the run ended at, for comparing records across days
    assert m["matmul_gflops_best"] >= m["matmul_gflops_median"] > 0 and m["matmul_slowest_over_fastest"] >= 1


def test_matmul_probe_is_short_and_consistent():
    from lintrans.bench.machine import matmul_probe

    p = matmul_probe(seconds=0.05, n=64)
    assert p["matmul_gflops_best"] >= p["matmul_gflops_median"] > 0 and p["matmul_slowest_over_fastest"] >= 1


def test_bench_loss_writes_both_series(tmp_path):
    out = tmp_path / "res"
    assert main(["bench", "loss", "--max-T", "256", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads((out / "loss.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"logits + F.cross_entropy", "linear_cross_entropy"}
    assert all(r["status"] == "ok" for r in data["rows"])


def test_bench_ops_full_series_name_picks_only_that_series(tmp_path):
    out = tmp_path / "res"
    assert main(["bench", "ops", "--max-T", "256", "--repeats", "1", "--ops", "linear chunked", "--out", str(out)]) == 0
    data = json.loads((out / "ops.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"linear chunked"} and data["speedups"] == []


def test_bench_train_with_gated_mechanisms(tmp_path, monkeypatch):
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    monkeypatch.setattr(tune, "measure_candidate", lambda c, *a, **k: float(c))
    out = tmp_path / "res"
    assert main(["bench", "train", "--max-T", "256", "--repeats", "1", "--forms", "chunked",
                 "--mechanisms", "gated-linear", "retention", "--out", str(out)]) == 0
    data = json.loads((out / "train.json").read_text())
    assert {"4L-128 gated-linear", "4L-128 retention"} <= {r["series"] for r in data["rows"] if r["status"] == "ok"}
    assert ("4L-128 gated-linear", "4L-128 softmax (SDPA)") in [(s["fast"], s["slow"]) for s in data["speedups"]]


def test_bench_rejects_unknown_mechanism():
    import pytest

    with pytest.raises(SystemExit, match="--mechanisms must be among"):
        main(["bench", "train", "--mechanisms", "linear"])
