"""What a disturbed sweep does and what its summary may conclude, on synthetic times: nothing is timed."""
import pytest

from lintrans.bench import measure
from lintrans.bench.measure import Caps, Series, sweep_side_by_side
from lintrans.bench.trend import disturbances, verdict, verdict_lines


@pytest.fixture
def fake_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": None)
    return now


def rows_of(series: dict) -> list[dict]:
    return [{"series": name, "T": T, "status": "ok", "time_s": t} for name, pts in series.items() for T, t in pts]


def busy_at(now, T_busy, cost, busy_calls, factor=3):
    """A step costing ``cost(T)``, but ``factor`` times that for its first ``busy_calls`` calls at
    ``T_busy`` (warm-up included): another process had the cores for a moment."""
    def make(T):
        calls = [0]

        def step():
            calls[0] += 1
            now[0] += cost(T) * (factor if T == T_busy and calls[0] <= busy_calls else 1)
        return step
    return make


def test_one_disturbed_point_is_retimed_and_does_not_end_its_curve(fake_clock):
    # the walkthrough's curve: linear 0.85 s at T = 256, then 5.1 s at 512 (warm-up and both first
    # repeats 3x slow); read as it came, 5.1 s x 6 predicts past the 8 s cap and the curve stops
    lin = Series("lin", busy_at(fake_clock, 512, lambda T: 0.85 * T / 256, busy_calls=3))
    soft = Series("soft", busy_at(fake_clock, 0, lambda T: 0.5 * (T / 256) ** 2, busy_calls=0))
    caps = Caps(time_s=8.0, repeats=2, budget_s=1.0, min_repeats=2)
    pts = {(p.series, p.T): p for p in sweep_side_by_side([soft, lin], [256, 512, 1024, 2048], caps)}
    assert pts[("lin", 512)].time_s == pytest.approx(1.7)  # the fastest repeat of the second round
    assert pts[("lin", 512)].extra["retimed"] == 1
    assert pts[("lin", 1024)].status == "ok" and pts[("lin", 2048)].status == "ok"
    assert "retimed" not in pts[("soft", 512)].extra  # its own rise was a step's (quadratic)
    assert pts[("soft", 2048)].status == "time cap"  # 8 s by its trend: a cap on evidence, not noise
    assert pts[("soft", 2048)].extra["predicted_s"] == pytest.approx(32.0)


def test_without_retiming_the_point_keeps_its_noise(fake_clock):
    """The test above can fail: with no second round the disturbed time stays."""
    lin = Series("lin", busy_at(fake_clock, 512, lambda T: 0.85 * T / 256, busy_calls=3))
    caps = Caps(time_s=8.0, repeats=2, budget_s=1.0, min_repeats=2, retimes=0)
    pts = {(p.series, p.T): p for p in sweep_side_by_side([lin], [256, 512, 1024], caps)}
    assert pts[("lin", 512)].time_s == pytest.approx(5.1) and "retimed" not in pts[("lin", 512)].extra


def test_a_rise_that_stays_after_retiming_is_measured_next_not_predicted(fake_clock):
    # disturbed through both rounds: the point keeps its rise, but the next T is measured, not cut
    lin = Series("lin", busy_at(fake_clock, 512, lambda T: 0.85 * T / 256, busy_calls=99))
    pts = {(p.series, p.T): p for p in sweep_side_by_side([lin], [256, 512, 1024], Caps(time_s=8.0, repeats=2,
                                                                                       budget_s=1.0))}
    assert pts[("lin", 512)].time_s == pytest.approx(5.1) and pts[("lin", 512)].extra["retimed"] == 1
    assert pts[("lin", 1024)].status == "ok" and pts[("lin", 1024)].time_s == pytest.approx(3.4)


def test_a_warm_up_past_the_cap_against_the_trend_is_run_again(fake_clock):
    # the warm-up at 512 alone ran 6x slow (10.2 s > the 8 s cap) where the trend says 1.7 s
    lin = Series("lin", busy_at(fake_clock, 512, lambda T: 0.85 * T / 256, busy_calls=1, factor=6))
    pts = {(p.series, p.T): p for p in sweep_side_by_side([lin], [256, 512, 1024], Caps(time_s=8.0, repeats=2,
                                                                                       budget_s=1.0))}
    assert pts[("lin", 512)].status == "ok" and pts[("lin", 512)].extra["warmups"] == 2
    assert pts[("lin", 512)].time_s == pytest.approx(1.7) and pts[("lin", 1024)].status == "ok"
    # where the trend itself reaches the cap, one warm-up past it ends the curve
    soft = Series("soft", busy_at(fake_clock, 0, lambda T: 3.0 * (T / 256) ** 2, busy_calls=0))
    pts = {(p.series, p.T): p for p in sweep_side_by_side([soft], [256, 512], Caps(time_s=8.0, repeats=1))}
    assert pts[("soft", 512)].status == "time cap" and "warmups" not in pts[("soft", 512)].extra


def test_the_summary_states_a_clean_comparison():
    rows = rows_of({"lin": [(256, 0.8), (512, 1.6), (1024, 3.3), (2048, 6.5)],
                    "soft": [(256, 0.5), (512, 1.7), (1024, 6.0), (2048, 23.0)]})
    v = verdict(rows, "lin", "soft")
    assert v["concluded"] and v["faster_from_T"] == 512 and v["speedup_at_longest"] == pytest.approx(23 / 6.5)
    lines = verdict_lines(v, "training step", "trains")
    assert lines[0] == "training step: lin trains faster than soft from T = 512 on."
    assert "3.54x" in lines[1]


def test_no_headline_from_one_outlier_or_a_zigzag():
    # the walkthrough's train curve: one point 6x above linear's trend
    rows = rows_of({"lin": [(256, 0.85), (512, 5.199), (1024, 3.4)],
                    "soft": [(256, 0.5), (512, 2.0), (1024, 8.0)]})
    v = verdict(rows, "lin", "soft")
    assert not v["concluded"]
    line = " ".join(verdict_lines(v, "training step", "trains"))
    assert "too busy" in line and "850 ms at T = 256 then 5199 ms at T = 512, a rise out of line" in line
    assert "faster than soft" not in line and "speed-up" not in line
    # the walkthrough's decode times: 35, 24, 35, 12, 8, 36 ms as T doubles
    zigzag = rows_of({"linear state": list(zip([256, 512, 1024, 2048, 4096, 8192],
                                               [0.035, 0.024, 0.035, 0.012, 0.008, 0.036])),
                      "softmax KV cache": [(T, 0.030 + T * 1e-7) for T in (256, 512, 1024, 2048, 4096, 8192)]})
    assert [d.split(":")[1].split(",")[0].strip() for d in disturbances(zigzag, "linear state")] == [
        "35 ms at T = 1024 but 12 ms at T = 2048", "8 ms at T = 4096 then 36 ms at T = 8192"]
    assert not verdict(zigzag, "linear state", "softmax KV cache")["concluded"]


def test_what_quiet_machines_measured_is_not_called_noise():
    """Curves from records in docs/results taken on a quiet machine: a cache cliff (5x in one
    doubling), a shorter step at 512 than at 256 (another chunk size; a GPU's launch overheads),
    a flat decode curve's scatter."""
    Ts = [256, 512, 1024, 2048, 4096, 8192]
    quiet = rows_of({
        "softmax (SDPA)": zip(Ts, [5.59e-3, 18.7e-3, 60.75e-3, 214.94e-3, 593.89e-3, 3.003]),
        "linear attention": zip(Ts, [7.42e-3, 37.29e-3, 84.51e-3, 291.8e-3, 1.619, 7.776]),
        "linear chunked": zip(Ts, [6.24e-3, 4.89e-3, 10.25e-3, 26.56e-3, 42.8e-3, 68.67e-3]),
        "gpu linear chunked": zip(Ts, [41.52e-3, 30.13e-3, 36.44e-3, 53.46e-3, 92.59e-3, 168.6e-3]),
        "linear state": zip(Ts, [6.6e-3, 5.83e-3, 5.16e-3, 5.55e-3, 5.18e-3, 5.45e-3]),
    })
    for series in ("softmax (SDPA)", "linear attention", "linear chunked", "gpu linear chunked", "linear state"):
        assert disturbances(quiet, series) == [], series
    assert verdict(quiet, "linear chunked", "softmax (SDPA)")["concluded"]


def test_the_cap_mark_stands_at_the_context_that_was_not_measured():
    from lintrans.bench.plots import cap_mark

    assert cap_mark({"T": 1024, "status": "time cap", "time_s": None, "predicted_s": 20.8}, "time_s", 512, 5.2) \
        == (1024, 20.8)
    assert cap_mark({"T": 1024, "status": "time cap", "time_s": 13.0}, "time_s", 512, 5.2) == (1024, 13.0)
    assert cap_mark({"T": 1024, "status": "oom", "time_s": None}, "peak_bytes", 512, 100.0) == (1024, 100.0)


def result_of(rows, fast, slow, lines=(), noise=None):
    return {"rows": rows, "speedups": [verdict(rows, fast, slow)], "lines": [None, *lines], "noise_warning": noise}


def test_the_demo_summary_concludes_only_on_curves_that_hold_and_says_when_the_machine_was_busy():
    from lintrans.bench.demo import summary_lines

    Ts = [256, 512, 1024, 2048]
    ops = result_of(rows_of({"linear chunked": zip(Ts, [0.01, 0.02, 0.04, 0.08]),
                             "softmax (SDPA)": zip(Ts, [0.01, 0.03, 0.11, 0.44])}), "linear chunked", "softmax (SDPA)")
    train = result_of(rows_of({"L linear chunked": [(256, 0.85), (512, 5.199), (1024, 3.4)],
                               "L softmax (SDPA)": [(256, 0.8), (512, 2.0), (1024, 6.0)]}),
                      "L linear chunked", "L softmax (SDPA)", lines=["at T = 1024 a GPT with no token mixing ..."])
    gen = result_of(rows_of({"linear state": zip(Ts, [0.035, 0.024, 0.035, 0.012]),
                             "softmax KV cache": zip(Ts, [0.03, 0.03, 0.031, 0.032])}),
                    "linear state", "softmax KV cache", noise="warning: the matmul probe ...")
    text = "\n".join(summary_lines(ops, train, gen, "L"))
    assert "attention op (fwd + bwd, H=8, D=64): linear chunked runs faster than softmax (SDPA) from T = 256 on." in text
    assert "(T = 2048): 5.50x" in text
    assert "GPT L training step (vocab 50257, batch 1): no conclusion" in text and "no token mixing" not in text
    assert "time per generated token: no conclusion" in text and "ms at T = 256, " not in text
    last = text.splitlines()[-1]  # the verdict on the machine comes last, after every figure
    assert last.startswith("the machine was busy during this demo (no conclusion for the GPT L training step")
    assert "1 of the matmul probes" in last
    quiet = "\n".join(summary_lines(ops, result_of(rows_of({"a": zip(Ts, [1, 2, 4, 8]), "b": zip(Ts, [1, 3, 9, 30])}),
                                                   "a", "b"), None, "L"))
    assert "busy" not in quiet and "no conclusion" not in quiet
