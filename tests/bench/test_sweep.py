"""The sweep's bookkeeping (caps, errors, results, plots) with fake steps: nothing is timed."""
import json

import pytest

from lintrans.bench import measure
from lintrans.bench.measure import Caps, sweep
from lintrans.bench.report import speedup, table, write_results


@pytest.fixture
def fake_clock(monkeypatch):
    """perf_counter advances by the cost each fake step declares, so 'time' is deterministic."""
    now = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    return now


def quadratic(now, scale=1e-6):
    def make(T):
        def step():
            now[0] += scale * T * T
        return step
    return make


def test_time_cap_stops_the_curve_before_running_it(fake_clock):
    ran = []

    def make(T):
        ran.append(T)
        return quadratic(fake_clock)(T)

    pts = sweep("q", [256, 512, 1024, 2048, 4096], make, Caps(time_s=2.0), measure_memory=False)
    assert [p.status for p in pts] == ["ok", "ok", "ok", "time cap"]  # 1024^2 * 1e-6 = 1.05 s; next ~4 s
    assert ran == [256, 512, 1024]
    assert pts[0].time_s == pytest.approx(256 * 256 * 1e-6)


def test_errors_and_ooms_end_the_curve(fake_clock):
    def make(T):
        def step():
            if T >= 512:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return step

    pts = sweep("m", [256, 512, 1024], make, Caps(), measure_memory=False)
    assert [p.status for p in pts] == ["ok", "oom"]

    def bad(T):
        raise ValueError("nope")

    assert sweep("b", [256], bad, Caps(), measure_memory=False)[0].status.startswith("error: ValueError")


def test_memory_cap_from_predicted_peak(fake_clock, monkeypatch):
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": 1000 * 2 ** 20)
    pts = sweep("p", [256, 512], quadratic(fake_clock), Caps(memory_bytes=1500 * 2 ** 20))
    assert [p.status for p in pts] == ["ok", "memory cap"]


def test_speedup_headline_and_files(tmp_path):
    rows = [
        {"series": "soft", "T": T, "status": "ok", "time_s": t, "peak_bytes": 2 ** 20}
        for T, t in [(256, 1.0), (512, 2.0), (1024, 8.0)]
    ] + [{"series": "soft", "T": 2048, "status": "time cap", "time_s": None, "peak_bytes": None}] + [
        {"series": "lin", "T": T, "status": "ok", "time_s": t, "peak_bytes": 2 ** 20}
        for T, t in [(256, 2.0), (512, 1.5), (1024, 2.0), (2048, 4.0)]
    ]
    s = speedup(rows, "lin", "soft")
    assert s["faster_from_T"] == 512 and s["longest_common_T"] == 1024 and s["speedup_at_longest"] == 4.0
    assert s["slow_stopped"] == (2048, "time cap") and s["fast_longest_T"] == 2048
    assert "time cap" in table(rows)
    paths = write_results(tmp_path, "x", rows, {"machine": {"cpu": "test"}, "headline": "h"})
    assert json.loads(paths["json"].read_text())["rows"][0]["series"] == "soft"
    from lintrans.bench.plots import plot_sweep

    assert plot_sweep(rows, tmp_path / "x.png", "t").stat().st_size > 0


def test_floor_line_bounds_what_any_attention_can_gain():
    from lintrans.bench.report import floor_line

    ok = lambda s, T, t: {"series": s, "T": T, "status": "ok", "time_s": t}  # noqa: E731
    rows = [ok("soft", 256, 1.0), ok("lin", 256, 0.9), ok("none", 256, 0.8),
            ok("soft", 512, 6.0), ok("lin", 512, 2.0), ok("none", 512, 1.5),
            ok("lin", 1024, 4.0), ok("none", 1024, 3.0)]  # softmax stopped: 512 is the last common T
    line = floor_line(rows, "soft", "lin", "none")
    assert "at T = 512" in line and "4.00x faster than soft" in line and "lin reaches 3.00x" in line
    assert floor_line(rows, "soft", "lin", "absent") is None


def test_train_series_ends_with_the_no_mixing_floor():
    from lintrans.bench.train import FLOOR, gpt_config, train_series

    series = train_series(("chunked",))
    assert [s[0] for s in series] == ["softmax (SDPA)", "linear chunked", FLOOR]
    assert gpt_config("4L-128", 64, "none", None).attention == "none"
    assert train_series(("chunked",), floor=False)[-1][0] == "linear chunked"


def test_floor_is_timed_only_where_softmax_was_and_without_memory(monkeypatch):
    import lintrans.bench.train as train
    from lintrans.bench.measure import Caps, Point

    calls = {}

    def fake_sweep(series, Ts, make_step, caps, *, measure_memory=True, **kw):
        calls[series] = (list(Ts), measure_memory)
        if "softmax" in series:  # softmax stops at 1024: measured to 512
            return [Point(series, 256), Point(series, 512), Point(series, 1024, status="time cap")]
        return [Point(series, T) for T in Ts]

    monkeypatch.setattr(train, "sweep", fake_sweep)
    Ts = [256, 512, 1024, 2048]
    train.run_train(Ts, Caps(), sizes=("4L-128",), forms=("chunked",))
    assert calls["4L-128 softmax (SDPA)"] == (Ts, True)
    assert calls["4L-128 linear chunked"] == (Ts, True)
    assert calls[f"4L-128 {train.FLOOR}"] == ([256, 512], False)
    assert train._floor_Ts(Ts, [], "absent") == Ts  # softmax not run: the floor everywhere
    assert train._floor_Ts(Ts, [Point("s", 256, status="oom")], "s") == []
