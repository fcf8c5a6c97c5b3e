"""What a curve of step times against T may do, and what a comparison of two curves may conclude.

A step's time cannot fall as the context grows (it does more work) and cannot grow faster than
quadratically (nothing benchmarked here is worse than attention's T^2). A measured curve that does
either was disturbed: another process took the cores during some of its repeats. The sweep re-times
a point that rose too fast (``rose_too_fast``) before it lets that point predict the next one, and
a summary states a ratio only for curves with no such break left (``disturbances``, ``verdict``).
All of it reads rows (``Point.row()`` dicts), so it is tested with synthetic times.
"""
from __future__ import annotations

from typing import Optional

# slack on the two bounds: repeats on a quiet machine still scatter by some percent, and a step of a
# few milliseconds (one decoded token) is flat in T, so its minimum moves either way by that much
RISE_SLACK = 1.25
DROP_SLACK = 1.25


def max_growth(T0: int, T1: int) -> float:
    """The most a step's time may grow from context T0 to T1 (quadratic, with slack)."""
    return RISE_SLACK * (T1 / T0) ** 2


def rose_too_fast(T0: int, t0: Optional[float], T1: int, t1: Optional[float]) -> bool:
    return bool(t0 and t1 and t1 / t0 > max_growth(T0, T1))


def fell(t0: Optional[float], t1: Optional[float]) -> bool:
    """A longer context measured clearly faster than a shorter one: the shorter one was disturbed."""
    return bool(t0 and t1 and t1 * DROP_SLACK < t0)


def _ms(t: float) -> str:
    return f"{t * 1e3:.0f} ms" if t < 10 else f"{t:.1f} s"


def curve(rows: list[dict], series: str, key: str = "time_s") -> list[tuple[int, float]]:
    """(T, value) of the measured points of ``series``, T ascending."""
    return sorted((r["T"], r[key]) for r in rows if r["series"] == series and r["status"] == "ok" and r.get(key))


def disturbances(rows: list[dict], series: str) -> list[str]:
    """Each place where the measured curve of ``series`` breaks what a step's time can do."""
    out = []
    pts = curve(rows, series)
    for (T0, t0), (T1, t1) in zip(pts, pts[1:]):
        if fell(t0, t1):
            out.append(f"{series}: {_ms(t0)} at T = {T0} but {_ms(t1)} at T = {T1}, faster at the longer context")
        elif rose_too_fast(T0, t0, T1, t1):
            out.append(f"{series}: {_ms(t0)} at T = {T0} then {_ms(t1)} at T = {T1}, a rise past quadratic")
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
