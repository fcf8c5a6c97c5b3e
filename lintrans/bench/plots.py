"""Log-log plots in the style of the post's figures: one line per algorithm against context length,
a cross where a curve stops (out of memory, time cap), labelled with the reason."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

MARKERS = {"time cap": "time cap", "memory cap": "memory cap", "oom": "OOM"}


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["series"], []).append(r)
    return out


def cap_mark(end: dict, key: str, last_T: int, last_value: float) -> tuple[int, float]:
    """Where the cross of a curve's end goes: at the T that was not measured (``end``), at the
    time its warm-up took or the sweep predicted for it, else level with the last measured point."""
    value = end.get(key)
    if value is None and key == "time_s":
        value = end.get("predicted_s")
    return end["T"], value if value is not None else last_value


def plot_sweep(rows: list[dict], path: Path, title: str, *, value: str = "time_s", ylabel: str = "seconds",
               second: Optional[tuple[str, str]] = ("peak_bytes", "peak memory (MiB)"), subtitle: str = "") -> Path:
    """Save a PNG with ``value`` against T (and ``second`` in a panel beside it) for every series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(value, ylabel)] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        scale = 1 / 2**20 if key.endswith("bytes") else 1.0
        for name, pts in _series(rows).items():
            ok = [p for p in pts if p["status"] == "ok" and p.get(key) is not None]
            if not ok:
                continue
            xs, ys = [p["T"] for p in ok], [p[key] * scale for p in ok]
            # a baseline (the no-mixing floor) is drawn dashed in black: a bound, not a competitor
            style = dict(ls="--", color="black", alpha=0.6) if "floor" in name else {}
            (line,) = ax.plot(xs, ys, marker="o", ms=3, label=name, **style)
            end = pts[-1]
            if end["status"] != "ok":
                x, y = cap_mark(end, key, xs[-1], ys[-1] / scale)
                # the cross stands at the context that was not measured, joined by a dotted line to the
                # last one that was: the curve ends there, the capped point is past it
                ax.plot([xs[-1], x], [ys[-1], y * scale], ls=":", color=line.get_color(), alpha=0.7)
                ax.plot([x], [y * scale], marker="x", ms=9, mew=2, color=line.get_color())
                ax.annotate(MARKERS.get(end["status"], "error"), (x, y * scale), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length T (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_title(title, fontsize=10)
    if subtitle:
        fig.text(0.5, 0.005, subtitle, ha="center", fontsize=7, color="gray")
    handles, labels = axes[0][0].get_legend_handles_labels()
    axes[0][-1].legend(handles, labels, fontsize=7, loc="best")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = Path(path)
    from lintrans._io import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))  # like the JSON beside it
    plt.close(fig)
    return path
