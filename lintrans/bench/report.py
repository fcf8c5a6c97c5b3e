"""Benchmark results as a terminal table, JSON + CSV + Markdown on disk, and the headline numbers."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

from lintrans._io import atomic_write_text


def _fmt(row: Optional[dict], key: str) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return {"time cap": "time cap", "memory cap": "mem cap", "oom": "OOM"}.get(row["status"], "error")
    v = row.get(key)
    if v is None:
        return "-"
    if key.endswith("bytes"):
        return f"{v / 2**20:.1f} MiB" if v < 2**30 else f"{v / 2**30:.2f} GiB"
    return f"{v * 1e3:.1f}" if v < 10 else f"{v:.1f}s"


def table(rows: list[dict], key: str = "time_s") -> str:
    """Series down, T across; times in ms (seconds marked 's'), bytes in MiB or GiB."""
    series = list(dict.fromkeys(r["series"] for r in rows))
    Ts = sorted({r["T"] for r in rows})
    cell = {(r["series"], r["T"]): r for r in rows}
    width = max([len(s) for s in series] + [6])
    head = f"{'':<{width}}" + "".join(f"{T:>10}" for T in Ts)
    lines = [head] + [f"{s:<{width}}" + "".join(f"{_fmt(cell.get((s, T)), key):>10}" for T in Ts) for s in series]
    return "\n".join(lines)


def markdown_table(rows: list[dict], key: str = "time_s") -> str:
    series = list(dict.fromkeys(r["series"] for r in rows))
    Ts = sorted({r["T"] for r in rows})
    cell = {(r["series"], r["T"]): r for r in rows}
    out = ["| | " + " | ".join(str(T) for T in Ts) + " |", "|---" * (len(Ts) + 1) + "|"]
    out += ["| " + s + " | " + " | ".join(_fmt(cell.get((s, T)), key) for T in Ts) + " |" for s in series]
    return "\n".join(out)


def speedup(rows: list[dict], fast: str, slow: str) -> dict:
    """Where ``fast`` beats ``slow``: the context from which it is never slower, and the ratio at
    the longest context both reached (and how far ``fast`` got beyond)."""
    t = {(r["series"], r["T"]): r["time_s"] for r in rows if r["status"] == "ok"}
    both = sorted(T for (s, T) in t if s == fast and (slow, T) in t)
    ratios = {T: t[(slow, T)] / t[(fast, T)] for T in both}
    from_T = None
    for T in reversed(both):
        if ratios[T] < 1:
            break
        from_T = T
    fast_Ts = [T for (s, T) in t if s == fast]
    slow_end = next((r for r in rows if r["series"] == slow and r["status"] != "ok"), None)
    # rows timed one series after another (models too large to hold together) say so: their ratio
    # is not a side-by-side one
    interleaved = all(r.get("interleaved", True) for r in rows if r["series"] in (fast, slow))
    return {
        "interleaved": interleaved,
        "fast": fast, "slow": slow, "ratios": ratios, "faster_from_T": from_T,
        "longest_common_T": both[-1] if both else None, "speedup_at_longest": ratios[both[-1]] if both else None,
        "fast_longest_T": max(fast_Ts) if fast_Ts else None,
        "slow_stopped": (slow_end["T"], slow_end["status"]) if slow_end else None,
    }


def headline(s: dict, what: str = "trains") -> str:
    """One line for a ``speedup`` (or ``trend.verdict``: then none where its curves were disturbed)."""
    if s["longest_common_T"] is None:
        return f"{s['fast']} vs {s['slow']}: no context where both were measured"
    if s.get("concluded") is False:
        return (f"{s['fast']} vs {s['slow']}: no conclusion, the machine was too busy "
                f"({'; '.join(s['disturbances'][:2])})")
    parts = []
    if s["faster_from_T"] is not None:
        parts.append(f"{s['fast']} {what} faster than {s['slow']} from T = {s['faster_from_T']} on")
    else:
        parts.append(f"{s['fast']} is slower than {s['slow']} at the longest common context")
    parts.append(f"{s['speedup_at_longest']:.2f}x at T = {s['longest_common_T']} (longest measured for both)")
    if s.get("interleaved") is False:
        parts.append("timed one after another, not side by side (the models do not fit in memory together)")
    if s["slow_stopped"]:
        T, why = s["slow_stopped"]
        parts.append(f"{s['slow']} stopped at T = {T} ({why}); {s['fast']} reached T = {s['fast_longest_T']}")
    return "; ".join(parts)


def floor_line(rows: list[dict], slow: str, fast: str, floor: str) -> Optional[str]:
    """At the longest context all three reached: the most any attention could gain over ``slow``
    (slow / floor, Amdahl's bound) and how much of it ``fast`` gets."""
    t = {(r["series"], r["T"]): r["time_s"] for r in rows if r["status"] == "ok"}
    Ts = [T for (s, T) in t if s == floor and (slow, T) in t and (fast, T) in t]
    if not Ts:
        return None
    T = max(Ts)
    bound, got = t[(slow, T)] / t[(floor, T)], t[(slow, T)] / t[(fast, T)]
    if bound < 1 or got > bound:  # the floor does strictly less work than both: only noise puts it behind
        return (f"at T = {T} the GPT with no token mixing measured {t[(floor, T)]:.3g} s, slower than "
                f"{'softmax' if bound < 1 else fast} ({t[(slow if bound < 1 else fast, T)]:.3g} s) although it "
                "does less work: the machine was disturbed, so no bound is stated")
    return (f"at T = {T} a GPT with no token mixing takes {t[(floor, T)]:.3g} s, so no attention could train more "
            f"than {bound:.2f}x faster than {slow}; {fast} reaches {got:.2f}x")


NOISY_SPREAD = 2.0  # the matmul probe's slowest/fastest ratio past which a record is called disturbed


def noise_warning(probe: dict) -> Optional[str]:
    """A console warning when the matmul probe taken with a record says the machine was disturbed."""
    spread = probe.get("matmul_slowest_over_fastest")
    if spread is None or spread <= NOISY_SPREAD:
        return None
    return (f"warning: the matmul probe's slowest run took {spread:.1f}x its fastest (quiet: <= {NOISY_SPREAD}x): "
            "the machine was busy during this benchmark and its times and ratios may be off; rerun when it is idle")


def write_results(out: Path, name: str, rows: list[dict], meta: dict) -> dict[str, Path]:
    """docs/results/<name>/{<name>.json, .csv, .md}: rows with the machine and the settings."""
    out = Path(out)
    paths = {"json": out / f"{name}.json", "csv": out / f"{name}.csv", "md": out / f"{name}.md"}
    atomic_write_text(paths["json"], json.dumps({**meta, "rows": rows}, indent=1, default=str))
    keys = ["series", "T", "status", "time_s", "peak_bytes"] + sorted(
        {k for r in rows for k in r} - {"series", "T", "status", "time_s", "peak_bytes", "times_s", "cpu_times_s"})
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(paths["csv"], buf.getvalue())
    md = [f"# {name}", "", *([f"command: `{meta['command']}`", ""] if meta.get("command") else []),
          "machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()), "",
          "time per step (ms; s where marked):", "", markdown_table(rows, "time_s")]
    if any(r.get("peak_bytes") for r in rows):
        md += ["", "peak memory:", "", markdown_table(rows, "peak_bytes")]
    if any(r.get("cache_bytes") for r in rows):
        md += ["", "cache kept for decoding:", "", markdown_table(rows, "cache_bytes")]
    if meta.get("headline"):
        md += ["", "headline: " + meta["headline"]]
    if meta.get("noise_warning"):
        md += ["", meta["noise_warning"]]
    atomic_write_text(paths["md"], "\n".join(md) + "\n")
    return paths
