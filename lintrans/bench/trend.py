"""What a curve of step times against T may do, and what a comparison of two curves may conclude.

A step's time does not fall much as the context grows (it does more work; a different chunk size
or a GPU's launch overheads can take off a little at short contexts) and grows by at most about
4x per doubling (attention's T^2), more only where the working set leaves a cache, and then by a
step the curve's other doublings come near. A point that breaks this was disturbed: another
process took the cores during its repeats. The sweep times such a point again (``rose_too_far``)
and does not let it predict the next one; a summary states a ratio only for curves with no break
left (``disturbances``, ``verdict``). Everything here reads (T, seconds) pairs or rows
(``Point.row()`` dicts), so it is tested with synthetic times.
"""
from __future__ import annotations

import math
from statistics import median
from typing import Optional

QUADRATIC = 4.0  # growth per doubling of T of a quadratic step
# a rise per doubling past quadratic that is this many times the curve's other doublings (their
# median) is a disturbance, not a cache cliff; this and DROP are set so that the quiet records in
# docs/results pass and the busy ones do not (tests/bench/test_trend.py holds such curves)
RISE_FACTOR = 2.5
# with no other doubling to compare with, a rise past quadratic by this much
RISE_ALONE = 1.25 * QUADRATIC
# a longer context measured this many times faster than a shorter one
DROP = 1.5


def per_doubling(T0: int, t0: float, T1: int, t1: float) -> float:
    """The growth of the time per doubling of T from (T0, t0) to (T1, t1)."""
    return (t1 / t0) ** (1 / math.log2(T1 / T0))


def rose_too_far(pts: list[tuple[int, float]], i: int) -> bool:
    """Whether point ``i`` (> 0) of the curve ``pts`` ((T, seconds), T ascending) rose from point
    ``i - 1`` by more than a step can: past quadratic, and past ``RISE_FACTOR`` times the curve's
    other doublings (or past ``RISE_ALONE`` where there are none)."""
    growth = [per_doubling(T0, t0, T1, t1) for (T0, t0), (T1, t1) in zip(pts, pts[1:])]
    g = growth[i - 1]
    if g <= QUADRATIC:
        return False
    others = growth[:i - 1] + growth[i:]
    return g > (RISE_FACTOR * median(others) if others else RISE_ALONE)


def fell(t0: Optional[float], t1: Optional[float]) -> bool:
    """A longer context measured clearly faster than a shorter one: the shorter one was disturbed."""
    return bool(t0 and t1 and t1 * DROP < t0)


def _ms(t: float) -> str:
    return f"{t * 1e3:.0f} ms" if t < 10 else f"{t:.1f} s"


def curve(rows: list[dict], series: str, key: str = "time_s") -> list[tuple[int, float]]:
    """(T, value) of the measured points of ``series``, T ascending."""
    return sorted((r["T"], r[key]) for r in rows if r["series"] == series and r["status"] == "ok" and r.get(key))


def disturbances(rows: list[dict], series: str) -> list[str]:
    """Each place where the measured curve of ``series`` breaks what a step's time can do."""
    out = []
    pts = curve(rows, series)
    for i in range(1, len(pts)):
        (T0, t0), (T1, t1) = pts[i - 1], pts[i]
        if fell(t0, t1):
            out.append(f"{series}: {_ms(t0)} at T = {T0} but {_ms(t1)} at T = {T1}, faster at the longer context")
        elif rose_too_far(pts, i):
            out.append(f"{series}: {_ms(t0)} at T = {T0} then {_ms(t1)} at T = {T1}, a rise out of line with "
                       "its other doublings")
    return out


def verdict(rows: list[dict], fast: str, slow: str) -> dict:
    """The comparison of ``fast`` against ``slow`` (``report.speedup``'s fields) and whether it can
    be stated: ``concluded`` is False, with the ``disturbances`` that say why, where either curve
    breaks the trend; then no ratio of theirs is evidence."""
    from .report import speedup

    s = speedup(rows, fast, slow)
    broken = disturbances(rows, fast) + disturbances(rows, slow)
    return {**s, "concluded": s["longest_common_T"] is not None and not broken, "disturbances": broken}


def verdict_lines(v: dict, what: str, verb: str) -> list[str]:
    """The summary lines of one ``verdict``: the result, or why there is none."""
    fast, slow = v["fast"], v["slow"]
    if v["longest_common_T"] is None:
        return [f"{what}: {fast} and {slow} share no measured context"]
    if not v["concluded"]:
        return [f"{what}: no conclusion, the machine was too busy for one "
                f"({'; '.join(v['disturbances'][:3])})"]
    lines = []
    if v["faster_from_T"] is not None:
        lines.append(f"{what}: {fast} {verb} faster than {slow} from T = {v['faster_from_T']} on.")
    else:
        lines.append(f"{what}: {fast} was not faster than {slow} at the longest context both reached.")
    lines.append(f"  speed-up at the longest context measured for both (T = {v['longest_common_T']}): "
                 f"{v['speedup_at_longest']:.2f}x")
    if v["slow_stopped"]:
        T, why = v["slow_stopped"]
        lines.append(f"  {slow} stopped at T = {T} ({why}); {fast} reached T = {v['fast_longest_T']}.")
    return lines
