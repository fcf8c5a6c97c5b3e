"""The sweep's bookkeeping (caps, errors, results, plots) with fake steps: nothing is timed."""
import json

import pytest

from lintrans.bench import measure
from lintrans.bench.measure import Caps, sweep
from lintrans.bench.report import markdown_table, speedup, table, write_results


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
    assert "1.0 MiB" in table(rows, "peak_bytes") and "1.0 MiB" in markdown_table(rows, "peak_bytes")
    assert "3.00 GiB" in table([{**rows[0], "peak_bytes": 3 * 2**30}], "peak_bytes")
    paths = write_results(tmp_path, "x", rows, {"machine": {"cpu": "test"}, "headline": "h"})
    assert json.loads(paths["json"].read_text())["rows"][0]["series"] == "soft"
    assert "warning" not in paths["md"].read_text()
    paths = write_results(tmp_path, "x", rows, {"machine": {"cpu": "test"}, "headline": "h", "noise_warning": "warning: busy"})
    assert paths["md"].read_text().rstrip().endswith("warning: busy")
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
    from lintrans.bench.sizes import model_size
    from lintrans.bench.train import FLOOR, train_series

    series = train_series(("chunked",))
    assert [s[0] for s in series] == ["softmax (SDPA)", "linear chunked", FLOOR]
    assert model_size("4L-128").gpt_config(64, "none", None).attention == "none"
    assert train_series(("chunked",), floor=False)[-1][0] == "linear chunked"


def test_side_by_side_alternates_repeats_and_bounds_the_floor(fake_clock, monkeypatch):
    from lintrans.bench.measure import Series, sweep_side_by_side

    calls, sized = [], []
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": sized.append(fn.__name__) or 2 ** 20)

    def maker(name, cost):
        def make(T):
            def step():
                calls.append((name, T))
                fake_clock[0] += cost(T)
            step.__name__ = name
            return step
        return make

    series = [Series("soft", maker("soft", lambda T: 1e-6 * T * T)),  # 0.26 s at 512, 1.05 s at 1024
              Series("lin", maker("lin", lambda T: 1e-4 * T)),
              Series("floor", maker("floor", lambda T: 5e-5 * T), measure_memory=False, within="soft")]
    pts = sweep_side_by_side(series, [256, 512, 1024, 2048], Caps(time_s=1.5, repeats=3, budget_s=10.0))
    status = {(p.series, p.T): p.status for p in pts}
    assert status[("soft", 1024)] == "ok" and status[("soft", 2048)] == "time cap"
    assert ("floor", 2048) not in status and status[("floor", 1024)] == "ok"  # only where softmax was
    assert status[("lin", 2048)] == "ok"
    # at one T: every warm-up, then the timed repeats in turn, then peak memory (not the floor's)
    at_256 = [c[0] for c in calls if c[1] == 256]
    assert at_256 == ["soft", "lin", "floor"] + ["soft", "lin", "floor"] * 3
    assert sized[:2] == ["soft", "lin"] and "floor" not in sized
    assert [p.series for p in pts] == ["soft"] * 4 + ["lin"] * 4 + ["floor"] * 3  # grouped by series


def test_min_repeats_gives_every_side_by_side_series_two_rounds(fake_clock, monkeypatch):
    from lintrans.bench.measure import Series, sweep_side_by_side

    calls = []
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": None)

    def make(name, cost):
        return lambda T: (lambda: calls.append((name, T)) or fake_clock.__setitem__(0, fake_clock[0] + cost))

    # the budget buys one repeat of a 2 s step; min_repeats asks for two wherever two series share a T
    caps = Caps(time_s=100.0, repeats=5, budget_s=3.0, min_repeats=2)
    sweep_side_by_side([Series("a", make("a", 2.0)), Series("b", make("b", 2.0), within="a")], [256], caps)
    assert [c[0] for c in calls] == ["a", "b"] + ["a", "b"] * 2  # warm-ups, then two alternating rounds
    calls.clear()
    sweep_side_by_side([Series("a", make("a", 2.0))], [256], caps)
    assert calls == [("a", 256)] * 2  # a series timed alone keeps the budget's one repeat
    calls.clear()
    sweep_side_by_side([Series("a", make("a", 2.0)), Series("b", make("b", 2.0))], [256],
                       Caps(time_s=100.0, repeats=1, budget_s=3.0, min_repeats=2))
    assert [c[0] for c in calls] == ["a", "b", "a", "b"]  # `repeats` stays the upper bound


def test_series_timed_side_by_side_get_equal_repeats(fake_clock, monkeypatch):
    """A 0.6 s step beside a 0.1 s one: the budget of 1 s buys the slow one a single repeat, and the fast
    one gets no more (the fastest of 3 against the fastest of 1 would tilt the ratio)."""
    from lintrans.bench.measure import Series, sweep_side_by_side

    calls = []
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": None)

    def make(name, cost):
        return lambda T: (lambda: calls.append(name) or fake_clock.__setitem__(0, fake_clock[0] + cost))

    pts = sweep_side_by_side([Series("slow", make("slow", 0.6)), Series("fast", make("fast", 0.1))], [256],
                             Caps(time_s=10.0, repeats=3, budget_s=1.0))
    assert calls.count("slow") == calls.count("fast") == 2  # warm-up and one repeat each
    assert [len(p.times_s) for p in pts] == [1, 1]


def test_one_at_a_time_when_the_steps_do_not_fit_together(fake_clock, monkeypatch):
    from lintrans.bench.measure import Series, sweep_side_by_side

    calls = []
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": None)

    def make(name):
        return lambda T: (lambda: calls.append(name) or fake_clock.__setitem__(0, fake_clock[0] + 0.1))

    sweep_side_by_side([Series("a", make("a")), Series("b", make("b"))], [256], Caps(repeats=2, budget_s=10.0),
                       together=False)
    assert calls == ["a", "a", "a", "b", "b", "b"]  # warm-up and 2 repeats of a, then of b


def test_run_train_bounds_the_floor_by_softmax(monkeypatch):
    import lintrans.bench.train as train

    seen = {}
    monkeypatch.setattr(train, "sweep_side_by_side", lambda series, Ts, caps, **kw: seen.update(series=series, **kw) or [])
    from lintrans.bench.measure import Caps

    train.run_train([256, 512], Caps(memory_bytes=2 ** 40), sizes=("4L-128",), forms=("chunked",))
    by_name = {s.name: s for s in seen["series"]}
    floor = by_name[f"4L-128 {train.FLOOR}"]
    assert floor.within == "4L-128 softmax (SDPA)" and floor.measure_memory is False
    assert by_name["4L-128 linear chunked"].within is None and by_name["4L-128 linear chunked"].measure_memory
    assert seen["together"] is True
    from lintrans.bench.sizes import model_size

    assert train._fits_together(model_size("12L-768"), 8, 16384, Caps(memory_bytes=12 * 2 ** 30)) is False  # 8 GPT-2s


def test_train_rows_and_headline_say_when_series_were_timed_in_turn(monkeypatch):
    """Models too large to hold together are timed one series after another: their rows and the
    headline's ratio say so."""
    import lintrans.bench.train as train
    from lintrans.bench.measure import Caps, Point
    from lintrans.bench.report import headline, speedup

    def fake_sweep(series, Ts, caps, **kw):
        return [Point(s.name, T, time_s=(2.0 if "softmax" in s.name else 1.0)) for s in series for T in Ts]

    monkeypatch.setattr(train, "sweep_side_by_side", fake_sweep)
    for fits in (True, False):
        monkeypatch.setattr(train, "_fits_together", lambda *a, fits=fits: fits)
        rows = [p.row() for p in train.run_train([256], Caps(), sizes=("4L-128",), forms=("chunked",))]
        assert {r["interleaved"] for r in rows} == {fits}
        line = headline(speedup(rows, "4L-128 linear chunked", "4L-128 softmax (SDPA)"))
        assert ("one after another" in line) is (not fits) and "2.00x" in line


@pytest.mark.parametrize("floor_s, fast_s", [(2.5, 1.0), (0.5, 0.4)])  # floor behind softmax; fast ahead of floor
def test_floor_line_does_not_contradict_itself_on_a_disturbed_run(floor_s, fast_s):
    from lintrans.bench.report import floor_line

    rows = [{"series": s, "T": 1024, "status": "ok", "time_s": t} for s, t in
            (("soft", 1.0), ("lin", fast_s), ("none", floor_s))]
    line = floor_line(rows, "soft", "lin", "none")
    assert "machine was disturbed" in line and "no attention could" not in line


def test_noise_warning_only_past_the_threshold():
    from lintrans.bench.report import noise_warning

    assert noise_warning({"matmul_slowest_over_fastest": 1.6}) is None
    assert "3.9x its fastest" in noise_warning({"matmul_slowest_over_fastest": 3.9})


def test_repeats_asked_for_by_number_are_all_taken(fake_clock, monkeypatch):
    """`bench --repeats 3` times a step three times even where it is slower than the profile's
    budget, which alone would time it once (a 64k op once, its second call after the warm-up)."""
    from lintrans.bench.cli import BenchOptions, build_profile
    from lintrans.bench.measure import Series, sweep_side_by_side

    calls = []
    monkeypatch.setattr(measure, "peak_memory", lambda fn, device="cpu": None)
    caps = build_profile(BenchOptions(profile="quick", repeats=3)).caps
    cost = caps.time_s / 2  # under the time cap, far over the quick profile's budget of a second
    step = lambda T: (lambda: calls.append(T) or fake_clock.__setitem__(0, fake_clock[0] + cost))  # noqa: E731
    sweep_side_by_side([Series("a", step)], [256], caps)
    assert len(calls) == 1 + 3  # the warm-up, then every repeat asked for
    calls.clear()
    default = build_profile(BenchOptions(profile="quick")).caps
    expensive = default.budget_s * 2  # a step the default budget times once
    step = lambda T: (lambda: calls.append(T) or fake_clock.__setitem__(0, fake_clock[0] + expensive))  # noqa: E731
    sweep_side_by_side([Series("a", step)], [256], Caps(time_s=expensive * 2, repeats=default.repeats,
                                                        budget_s=default.budget_s))
    assert len(calls) == 2  # without --repeats the budget rules


def test_a_model_size_says_its_config_chunk_and_cost_shape():
    from lintrans.bench.sizes import DEFAULT_CHUNK, VOCAB, model_size

    size = model_size("gpt2-124m")  # an alias
    assert (size.name, size.n_layer, size.n_head, size.n_embd, size.head_dim) == ("12L-768", 12, 12, 768, 64)
    config = size.gpt_config(128, "linear", "chunked", 32)
    assert (config.block_size, config.vocab_size, config.dropout) == (128, VOCAB, 0.0)
    assert config.attention_options == {"form": "chunked", "chunk_size": 32}
    assert size.gpt_config(128).attention_options == {}
    shape = size.shape(128, "linear", "chunked", 32)
    assert (shape.n_layer, shape.chunk_size, shape.F, shape.vocab_size) == (12, 32, 64, VOCAB)
    # only the chunked form is tuned
    assert size.chunk_size(128, "linear", "attention") == DEFAULT_CHUNK
    assert size.chunk_size(128, "linear", "chunked", tuned=False) == DEFAULT_CHUNK
