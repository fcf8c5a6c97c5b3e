"""The bench subcommands parse and run end to end on tiny settings (nothing is timed or asserted on time)."""
import json

import pytest
import torch

from lintrans.ops import chunk_tuning as tune
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


def test_tune_of_a_16_bit_dtype_on_the_cpu_tunes_what_is_looked_up(capsys, monkeypatch, tmp_path):
    """bf16 inputs run in float32 on a CPU, so auto_chunk_size looks up float32: tune tunes that."""
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    calls = []
    monkeypatch.setattr(tune, "measure_candidate", lambda c, *a, **k: calls.append(c) or float(c))
    assert main(["tune", "--T", "100", "--head-dim", "8", "--dtype", "bfloat16"]) == 0
    assert "inputs are computed in float32" in capsys.readouterr().err
    assert tune.auto_chunk_size(100, 8, 8, torch.bfloat16) == 32 and calls == [32, 64, 128]  # no second tuning
    assert [k.split("|")[1] for k in json.loads((tmp_path / "chunk_size.json").read_text())] == ["float32"]


def test_an_out_that_cannot_be_written_stops_before_any_work(tmp_path, capsys, monkeypatch):
    from lintrans.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "run_benchmark", lambda *a, **k: pytest.fail("measured before --out was checked"))
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main(["bench", "loss", "--T", "256", "--out", str(out)]) == 2
        assert "lintrans bench: --out " in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "afile")]) == 2
    assert "lintrans demo: --out " in capsys.readouterr().err


def test_bench_ops_writes_results(tmp_path, monkeypatch):
    from lintrans.bench import machine

    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    monkeypatch.setattr(tune, "measure_candidate", lambda c, *a, **k: float(c))
    probe = {"matmul_gflops_best": 123.0, "matmul_gflops_median": 99.5, "matmul_slowest_over_fastest": 1.7}
    monkeypatch.setattr(machine, "matmul_probe", lambda **k: probe)
    out = tmp_path / "res"
    # a cap no step reaches: on a loaded machine the profile's own cap could stop a curve
    assert main(["bench", "ops", "--max-T", "256", "--ops", "chunked", "softmax", "--time-cap", "3600",
                 "--out", str(out)]) == 0
    data = json.loads((out / "ops.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"softmax (SDPA)", "linear chunked", "linear chunked gated"}
    assert all(r["status"] == "ok" and r["time_s"] > 0 for r in data["rows"])
    # the tuned chunk (the fastest "measured" here: 32) is recorded where the FLOP count depends on it
    assert {r["series"]: r.get("chunk_size") for r in data["rows"]} == {
        "softmax (SDPA)": None, "linear chunked": 32, "linear chunked gated": 32}
    assert [(s["fast"], s["slow"]) for s in data["speedups"]] == [
        ("linear chunked", "softmax (SDPA)"), ("linear chunked gated", "linear chunked"),
        ("linear chunked gated", "softmax (SDPA)")]
    assert data["machine"]["torch"] and (out / "ops.png").stat().st_size > 0
    assert len(data["load_average"]) == 3 and data["date"].startswith("20")  # how shared the machine was, when
    assert probe.items() <= data["machine"].items()  # the matmul speed the run ended at, for comparing records


def test_matmul_probe_is_short_and_consistent(monkeypatch):
    """Best and median GFLOP/s and slowest/fastest of the matmul times, stopping at the first time past
    ``seconds`` once it has 3; the clock is scripted (each matmul "takes" the next duration), nothing timed."""
    import types

    from lintrans.bench import machine

    def probe(durations, seconds):
        clock, left = [0.0], [1.0, *durations]  # the warm-up's synchronize first

        def sync(device):
            clock[0] += left.pop(0)

        monkeypatch.setattr(machine, "synchronize", sync)
        monkeypatch.setattr(machine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        return machine.matmul_probe(seconds=seconds, n=64), len(durations) + 1 - len(left)

    gflop = 2 * 64**3 / 1e9
    # past the deadline (0.5) at the fourth matmul: 4 times, 0.25 s the median of the sorted four
    p, ran = probe([0.125, 0.25, 0.0625, 0.25, 0.125, 0.125], seconds=0.5)
    assert ran == 4 + 1 and p == {"matmul_gflops_best": float(f"{gflop / 0.0625:.3g}"),
                                  "matmul_gflops_median": float(f"{gflop / 0.25:.3g}"),
                                  "matmul_slowest_over_fastest": 4.0}
    # one matmul slower than the whole budget: still the 3 it needs for a median, no more
    p, ran = probe([2.0, 0.5, 1.0, 0.5], seconds=0.5)
    assert ran == 3 + 1 and p["matmul_gflops_median"] == float(f"{gflop / 1.0:.3g}")
    assert p["matmul_slowest_over_fastest"] == 4.0


def test_bench_loss_writes_both_series(tmp_path):
    out = tmp_path / "res"
    assert main(["bench", "loss", "--max-T", "256", "--repeats", "1", "--time-cap", "3600", "--out", str(out)]) == 0
    data = json.loads((out / "loss.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"logits + F.cross_entropy", "linear_cross_entropy"}
    assert all(r["status"] == "ok" for r in data["rows"])


def test_bench_ops_full_series_name_picks_only_that_series(tmp_path):
    out = tmp_path / "res"
    assert main(["bench", "ops", "--max-T", "256", "--repeats", "1", "--ops", "linear chunked", "--time-cap", "3600",
                 "--out", str(out)]) == 0
    data = json.loads((out / "ops.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"linear chunked"} and data["speedups"] == []
    assert all(r["status"] == "ok" for r in data["rows"])


def test_bench_train_with_gated_mechanisms(tmp_path, monkeypatch):
    monkeypatch.setenv("LINTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memo", {})
    monkeypatch.setattr(tune, "measure_candidate", lambda c, *a, **k: float(c))
    out = tmp_path / "res"
    # a cap no step reaches: on a loaded machine the profile's own cap could stop a curve
    assert main(["bench", "train", "--max-T", "256", "--repeats", "1", "--forms", "chunked", "--time-cap", "3600",
                 "--mechanisms", "gated-linear", "retention", "--out", str(out)]) == 0
    data = json.loads((out / "train.json").read_text())
    assert {"4L-128 gated-linear", "4L-128 retention"} <= {r["series"] for r in data["rows"] if r["status"] == "ok"}
    assert ("4L-128 gated-linear", "4L-128 softmax (SDPA)") in [(s["fast"], s["slow"]) for s in data["speedups"]]


def test_bench_ops_in_bfloat16_times_bfloat16_inputs(tmp_path, monkeypatch):
    """--dtype reaches the op: the series runs on bf16 q, k, v (seen by a wrapped op) and the title says so."""
    from lintrans.bench import ops

    seen = []
    real = ops.make_op_step

    def spy(fn, T, **kw):
        seen.append(kw["dtype"])
        return real(fn, T, **kw)

    monkeypatch.setattr(ops, "make_op_step", spy)
    out = tmp_path / "res"
    assert main(["bench", "ops", "--T", "256", "--repeats", "1", "--ops", "gated-delta", "--time-cap", "3600",
                 "--dtype", "bfloat16", "--out", str(out)]) == 0
    data = json.loads((out / "ops.json").read_text())
    assert seen and set(seen) == {torch.bfloat16} and "bfloat16" in data["title"]
    assert [r["status"] for r in data["rows"]] == ["ok"]


def test_bench_train_step_under_bf16_autocast_and_precision_errors():
    """precision bf16: the step runs its forward under autocast (a bf16 matmul inside) and still updates the
    float32 weights; fp16 needs CUDA (its GradScaler); unknown names are refused."""
    from lintrans.bench.sizes import model_size
    from lintrans.bench.train import make_train_step

    cfg = model_size("4L-128", "--sizes").gpt_config(64, "gated-deltanet", "chunked", 16)
    with pytest.raises(ValueError, match="fp16' needs a CUDA device"):
        make_train_step(cfg, 64, "cpu", "fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        make_train_step(cfg, 64, "cpu", "fp8")
    dtypes = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: dtypes.append(o.dtype) if isinstance(m, torch.nn.Linear) else None)
    try:
        step = make_train_step(cfg, 64, "cpu", "bf16")
        step()
    finally:
        hook.remove()
    assert torch.bfloat16 in dtypes


def test_bench_rejects_unknown_mechanism(capsys):
    assert main(["bench", "train", "--mechanisms", "linear"]) == 2
    assert "each --mechanisms must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["cost", "--form", "bogus"], "--form must be one of"),
    (["cost", "--T", "0"], "every --T must be an int >= 1, got 0"),
    (["cost", "--T", "-5"], "every --T must be an int >= 1, got -5"),
    (["cost", "--n-embd", "100", "--n-head", "3"], "--n-embd (100) must be divisible by --n-head (3)"),
    (["cost", "--T", "1024", "4096", "--step-time", "0.5"], "--step-time needs one time per --T (2), got 1"),
    (["cost", "--step-time", "0", "--T", "64"], "--step-time must be positive"),
    (["cost", "--feature-map", "nope"], "feature_map must be one of"),
    (["cost", "--size", "nope"], "--size must be one of"),
    (["cost", "--size", "4L-128", "--n-layer", "2"], "--size sets --n-layer, --n-head and --n-embd; give either it or "
                                                     "--n-layer"),
    (["tune", "--T", "-1"], "every --T must be an int >= 1, got -1"),
    (["tune", "--head-dim", "0"], "--head-dim must be an int >= 1, got 0"),
    (["tune", "--feature-map", "nope"], "--feature-map: feature_map must be one of"),
])
def test_bad_cost_and_tune_arguments_give_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["bench", "ops", "--ops", "nope"], "--ops: unknown op series ['nope']"),
    (["bench", "ops", "--ops", ""], "--ops: an empty name picks nothing"),
    (["bench", "ops", "--max-T", "0"], "--max-T must be an int >= 256 or None, got 0"),
    (["bench", "ops", "--max-T", "-256"], "--max-T must be an int >= 256"),
    (["bench", "ops", "--max-T", "100"], "--max-T must be an int >= 256"),
    (["bench", "ops", "--time-cap", "-1"], "--time-cap must be a number > 0"),
    (["bench", "ops", "--repeats", "0"], "--repeats must be an int >= 1"),
    (["bench", "train", "--sizes", "nope"], "--sizes must be one of"),
    (["bench", "generate", "--T", "256", "--max-T", "512"], "give --T or --max-T, not both"),
    (["bench", "generate", "--T", "0"], "every entry of --T must be an int >= 1, got 0"),
    (["bench", "train", "--T", "256", "--precision", "fp16"], "--precision 'fp16' needs a CUDA device"),
    (["demo", "--max-T", "100"], "lintrans demo: --max-T must be an int >= 256, got 100"),
    (["demo", "--generate-max-T", "0"], "--generate-max-T must be an int >= 256, got 0"),
    (["demo", "--ops-max-T", "128"], "--ops-max-T must be an int >= 256, got 128"),
    (["demo", "--time-cap", "-1"], "--time-cap must be a number > 0, got -1.0"),
])
def test_bad_bench_arguments_exit_before_measuring(argv, message, monkeypatch, capsys):
    from lintrans.bench import cli as bench_cli

    def measured(*a, **k):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(bench_cli, "run_benchmark", measured)
    assert main(argv) == 2  # as every command's bad input
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cost_reports_the_models_own_parameter_count(capsys):
    # GPT-2 124M stays 124M however long a --T is asked for; longer positions are reported apart
    assert main(["cost", "--size", "12L-768", "--T", "1024", "16384"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "would add 11,796,480" in out


def test_cost_flags_an_impossible_mfu(capsys):
    assert main(["cost", "--size", "12L-768", "--T", "1024", "--step-time", "0.001", "--peak-tflops", "1"]) == 0
    assert "above 100%" in capsys.readouterr().out


def test_size_names_short_and_long(capsys):
    from lintrans.bench.sizes import resolve_size

    assert resolve_size("12L-768") == resolve_size("12L-768 (GPT-2 124M)") == "12L-768"
    with pytest.raises(ValueError, match="--size must be one of"):
        resolve_size("12L-769")


def test_shipped_config_names_are_sizes(capsys):
    """`train --config gpt2-124m` and `cost --size gpt2-124m` name the same model."""
    from lintrans.bench.sizes import SIZES, resolve_size
    from lintrans.train.config import read_config_file  # tomllib, or tomli on Python 3.10

    model = read_config_file("gpt2-124m")["model"]
    assert SIZES[resolve_size("gpt2-124m")] == (model["n_layer"], model["n_head"], model["n_embd"])
    assert main(["cost", "--size", "gpt2-124m", "--T", "1024"]) == 0
    assert "124,439,808" in capsys.readouterr().out


def test_abbreviated_flags_are_rejected_and_version_is_printed(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--train.max_st", "3", "--print-config"])
    assert "unrecognized arguments: --train.max_st" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("lintrans ")


def test_a_misspelt_flag_names_the_closest_key(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--train.max_step", "5", "--print-config"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: lintrans train" in err
    assert "--train.max_step: did you mean --train.max_steps?" in err
    with pytest.raises(SystemExit):
        main(["train", "--zzzzzz", "--print-config"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err
    # a study's flag: the study's usage and flags, not the experiment command's
    with pytest.raises(SystemExit):
        main(["experiment", "recall", "--jbos", "2"])
    err = capsys.readouterr().err
    assert "usage: lintrans experiment recall" in err and "--jbos: did you mean --jobs?" in err


def test_demo_writes_its_record_to_a_folder_it_names(tmp_path, monkeypatch, capsys):
    from lintrans.bench import cli as bench_cli
    from lintrans.bench.report import speedup

    seen = []

    def fake_benchmark(which, prof, *, device="cpu", out=None, command=None):  # records where it was asked to write
        seen.append(out)
        rows = [{"series": s, "T": 256, "status": "ok", "time_s": t} for s, t in (("a", 1.0), ("b", 2.0))]
        return {"rows": rows, "speedups": [speedup(rows, "a", "b")], "lines": []}

    monkeypatch.setattr(bench_cli, "run_benchmark", fake_benchmark)
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    assert seen and all(str(o) == "runs/demo" for o in seen)  # never docs/results/demo unless asked
    assert f"record written to {tmp_path / 'runs' / 'demo'}/" in capsys.readouterr().out


def test_cost_mfu_of_softmax_counts_the_causal_half(capsys):
    from lintrans.bench.cost import ModelShape, training_flops

    assert main(["cost", "--size", "12L-128", "--vocab", "50257", "--T", "16384", "--step-time", "10",
                 "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    tf = training_flops(ModelShape(n_layer=12, n_head=2, n_embd=128, vocab_size=50257, block_size=1024), 16384)
    causal = (tf["total"] - tf["attention"] / 2) / 10 / 1e12
    assert "softmax T=16384: " in out and f"MFU {100 * causal:.1f}%" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is missing")
def test_device_cuda_without_cuda_is_one_clear_error(capsys, tmp_path):
    for argv in (["bench", "ops", "--device", "cuda"], ["bench", "ops", "--device", "cuda", "--ops", "chunked"]):
        assert main(argv) == 2
        assert "--device is 'cuda' but no CUDA device is available" in capsys.readouterr().err
    for argv in (["tune", "--device", "cuda"], ["train", "--device", "cuda", "--train.out_dir", str(tmp_path / "r")],
                 ["sample", "--device", "cuda", "--checkpoint", str(tmp_path)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "is 'cuda' but no CUDA device is available" in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, message", [
    (["bench", "ops", "--max-T", "x"], "lintrans bench: --max-T must be an int >= 256 or None, got 'x'"),
    (["bench", "ops", "--repeats", "1.5"], "lintrans bench: --repeats must be an int >= 1 or None, got '1.5'"),
    (["bench", "ops", "--profile", "huge"], "lintrans bench: --profile must be one of ['quick', 'full'], got 'huge'"),
    (["bench", "ops", "--dtype", "int8"],
     "lintrans bench: --dtype must be one of ['float32', 'bfloat16', 'float16'], got 'int8'"),
    (["bench", "train", "--precision", "fp8"], "lintrans bench: --precision must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'"),
])
def test_bench_flags_are_typed_by_its_options_dataclass(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == message + "\n"


def test_cost_op_share_of_the_probe_is_its_flops_over_time_over_the_probe(capsys):
    # the op at the bench's shape (H = 8, D = 64) at 16k; numbers passed in, nothing timed
    assert main(["cost", "--n-head", "8", "--n-embd", "512", "--T", "4096", "16384", "--op-time", "0.05", "0.25",
                 "--probe-gflops", "200"]) == 0
    out = capsys.readouterr().out
    # 3x the forward 4 N T F E + 2 N n c^2 (F + E) at F = 64, E = 65, c = 64
    for T, t in ((4096, 0.05), (16384, 0.25)):
        flops = 3 * (4 * 8 * T * 64 * 65 + 2 * 8 * (T // 64) * 64 * 64 * (64 + 65))
        assert f"T={T}: " in out and f"{100 * flops / t / 200e9:.1f}% of the probe" in out
    assert "200 GFLOP/s (passed in)" in out


def test_cost_op_share_counts_the_short_last_chunk(capsys):
    from lintrans.bench.cost import ModelShape, op_training_flops

    shape = ModelShape(n_layer=4, n_head=2, n_embd=64, attention="linear", form="chunked", chunk_size=64)
    # T = 100: one chunk of 64 and one of 36, whatever the number of layers
    assert op_training_flops(shape, 100) == 3 * (4 * 2 * 100 * 32 * 33 + 2 * 2 * (64**2 + 36**2) * (32 + 33))


@pytest.mark.parametrize("argv, message", [
    (["cost", "--T", "64", "128", "--op-time", "0.1"], "--op-time needs one time per --T (2), got 1"),
    (["cost", "--T", "64", "--op-time", "-1"], "--op-time must be positive"),
    (["cost", "--T", "64", "--op-time", "1", "--probe-gflops", "0"], "--probe-gflops must be positive"),
    (["cost", "--T", "64", "--measure-op", "--op-repeats", "0"], "--op-repeats must be an int >= 1"),
    # flags that feed another flag's report, given without it: refused, not silently unused
    (["cost", "--T", "64", "--probe-gflops", "5"], "--probe-gflops is used only with --op-time or --measure-op"),
    (["cost", "--T", "64", "--op-repeats", "3"], "--op-repeats is used only with --measure-op"),
    (["cost", "--T", "64", "--peak-tflops", "1"], "--peak-tflops is used only with --step-time or --linear-step-time"),
    (["cost", "--T", "64", "--feature-map", "bogus"], "lintrans cost: --feature-map: "),
])
def test_bad_op_share_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cost_measure_op_runs_and_reports_a_share(capsys):
    assert main(["cost", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--vocab", "50", "--T", "40",
                 "--measure-op", "--op-repeats", "1", "--probe-gflops", "1"]) == 0
    out = capsys.readouterr().out
    assert "(measured here, THP_MEM_ALLOC_ENABLE=" in out and "T=40: " in out and "% of the probe" in out


def test_bench_generate_at_chosen_contexts_with_one_decoder(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["bench", "generate", "--T", "96", "32", "--decoders", "linear", "--repeats", "1",
                 "--time-cap", "3600", "--out", str(out)]) == 0
    data = json.loads((out / "generate.json").read_text())
    assert [(r["series"], r["T"]) for r in data["rows"]] == [("linear state", 32), ("linear state", 96)]
    # the cost model's cache bytes for 4L-128 (2 heads of 64) at T = 96: KV 2 L K h T x 4, state L N F (h + 1) x 4
    kv, state = 2 * 4 * 2 * 64 * 96 * 4, 4 * 2 * 64 * 65 * 4
    assert all(r["cache_bytes"] == state for r in data["rows"])
    assert f"({kv / state:.3g}x)" in data["headline"] and "ms per token at T = 96" in data["headline"]
    # every timed repeat's process CPU time beside its wall time, the least as cpu_s
    assert all(len(r["cpu_times_s"]) == len(r["times_s"]) and r["cpu_s"] == min(r["cpu_times_s"]) for r in data["rows"])
    assert "process CPU time" in data["headline"]
    # the record names the command that made it and its settings
    assert data["command"].startswith("lintrans bench generate --T 96 32")
    assert data["settings"]["decoders"] == ["linear"]


def test_demo_states_the_chunked_ops_share_of_the_probe():
    from lintrans.bench.demo import op_share_line

    rows = [{"series": "linear chunked", "T": T, "status": "ok", "time_s": t, "chunk_size": 64}
            for T, t in ((4096, 0.05), (8192, 0.1))]
    line = op_share_line({"rows": rows, "machine": {"matmul_gflops_best": 150.0}})
    flops = 3 * (4 * 8 * 8192 * 64 * 65 + 2 * 8 * 128 * 64 * 64 * 129)  # c = 64, F = 64, E = 65
    assert line.startswith("chunked op at T = 8192: 100 ms")
    assert f"{flops / 0.1 / 1e9:.0f} GFLOP/s" in line and f"{100 * flops / 0.1 / 150e9:.0f}% of the matmul probe" in line
    assert op_share_line({"rows": rows, "machine": {}}) is None


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_decode_step_builds_and_runs_for_each_decoder(attention):
    """Each decoder's model takes only its own options (softmax has none: no form, no chunk size)."""
    from lintrans.bench.generate import make_decode_step

    step, extra = make_decode_step("4L-128", 16, attention, max_T=16)
    step()
    step()
    assert extra["context"] == 16 and extra["cache_bytes"] > 0


def test_a_failed_point_says_why_beside_the_table(monkeypatch, capsys):
    from lintrans.bench import cli as bench_cli
    from lintrans.bench.measure import Point

    def run_ops(Ts, caps, **kw):
        return [Point("linear chunked", T, status="error: ValueError: no such thing") for T in Ts]

    monkeypatch.setattr("lintrans.bench.ops.run_ops", run_ops)
    prof = bench_cli.profiles()["quick"]
    prof.ops_T = [256, 512]
    bench_cli.run_benchmark("ops", prof)
    captured = capsys.readouterr()
    assert "error" in captured.out  # the table's cells
    assert "error: ValueError: no such thing (linear chunked T=256, linear chunked T=512)" in captured.err


def test_the_ops_progress_bar_counts_only_the_selected_series(monkeypatch):
    from lintrans.bench import cli as bench_cli

    totals = []

    class Bar:
        def __init__(self, total, desc):
            totals.append(total)

        def close(self):
            pass

    monkeypatch.setattr(bench_cli, "Progress", Bar)
    monkeypatch.setattr("lintrans.bench.ops.run_ops", lambda Ts, caps, **kw: [])
    prof = bench_cli.profiles()["quick"]
    prof.ops_T, prof.ops_only = [256, 512, 1024], ["linear chunked", "softmax (SDPA)"]
    bench_cli.run_benchmark("ops", prof)
    assert totals == [2 * 3]


def test_generate_has_room_for_as_many_repeats_as_asked():
    """Each timed token takes a position: the model is built with room for every repeat and retime."""
    from lintrans.bench.generate import run_generate
    from lintrans.bench.measure import Caps

    caps = Caps(time_s=10.0, repeats=300, budget_s=1e9, retimes=1)
    (point,) = run_generate([8], caps, size="4L-128", decoders=("linear",))
    assert point.status == "ok" and len(point.times_s) == 300, point.status


@pytest.mark.parametrize("argv, message", [
    (["loss", "--dtype", "bfloat16"], "--dtype applies to bench ops, not loss"),
    (["loss", "--forward-only"], "--forward-only applies to bench ops, not loss"),
    (["generate", "--forms", "chunked"], "--forms applies to bench train, not generate"),
    (["ops", "--sizes", "4L-128"], "--sizes applies to bench train and generate, not ops"),
    (["generate", "--sizes", "4L-128", "12L-128"], "--sizes: generate measures one model size, got 2"),
])
def test_options_a_benchmark_does_not_read_are_refused(argv, message, capsys, monkeypatch):
    from lintrans.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "run_benchmark", lambda *a, **k: pytest.fail("ran"))
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_options_at_their_default_and_bench_all_take_every_option(monkeypatch):
    from lintrans.bench import cli as bench_cli

    ran = []
    monkeypatch.setattr(bench_cli, "run_benchmark", lambda which, *a, **k: ran.append(which))
    assert main(["bench", "loss", "--dtype", "float32", "--T", "256"]) == 0  # the default changes nothing
    assert main(["bench", "all", "--dtype", "bfloat16", "--forms", "chunked", "--T", "256"]) == 0
    assert ran == ["loss", *bench_cli.BENCHMARKS]


def test_bench_all_says_which_size_generate_measures(monkeypatch, capsys):
    """`bench all --sizes A B`: train measures both, generate one model; the run says which."""
    from lintrans.bench import cli as bench_cli

    seen = []
    monkeypatch.setattr(bench_cli, "run_benchmark", lambda which, prof, **k: seen.append((which, prof.sizes)))
    assert main(["bench", "all", "--sizes", "4L-128", "12L-128"]) == 0
    assert "generate the first (4L-128)" in capsys.readouterr().err
    assert ("generate", ("4L-128", "12L-128")) in seen


def test_generate_decodes_with_any_attention(monkeypatch, capsys):
    """--decoders takes any attention a GPT decodes with, or all; each gets a series of its own."""
    from lintrans.bench import cli as bench_cli
    from lintrans.bench.generate import decoder_series, run_generate
    from lintrans.bench.measure import Caps
    from lintrans.nn import available_attention

    names = decoder_series()
    assert set(names) == set(available_attention()) - {"none"} and len(set(names.values())) == len(names)
    seen = []
    monkeypatch.setattr(bench_cli, "run_benchmark", lambda which, prof, **k: seen.append(prof.decoders))
    assert main(["bench", "generate", "--decoders", "all"]) == 0
    assert set(seen[0]) == set(names)
    assert main(["bench", "generate", "--decoders", "bogus"]) == 2
    assert "each --decoders" in capsys.readouterr().err
    caps = Caps(time_s=10.0, repeats=2, budget_s=1e9, retimes=0)
    points = run_generate([8], caps, size="4L-128", decoders=("aft-conv", "sliding-window"))
    assert {p.series for p in points} == {"aft-conv cache", "sliding-window cache"}
    assert all(p.status == "ok" for p in points)
