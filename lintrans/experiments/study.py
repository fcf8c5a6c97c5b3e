"""What every study shares: runs keyed by their settings, a resumable store, parallel execution,
the per-mechanism learning-rate sweep, aggregation over seeds, the record and its plots.

A *run* is a dict of settings (JSON values only) that fully determines one training job. Its key is
a hash of that dict, and its result is stored as ``<out>/runs/<key>.json`` (written atomically), so
a study that is stopped and started again finds every finished run and redoes only the rest. A run
function ``fn(spec, env) -> dict`` is a module-level function (workers import it by name under the
spawn start method); ``env.advance(n)`` moves the progress bar, ``env.path(spec, suffix)`` names a
file beside a run's JSON (e.g. weights another run loads), ``env.device`` is where the run trains
(``--device``; not part of the run's key, like ``--jobs``).

Each study does the same two phases:

1. learning-rate sweep: every mechanism at every candidate rate, seed 0, at the study's sweep
   setting; the rate with the lowest held-out score wins (``lr_sweep``);
2. the seeds at each mechanism's chosen rate, at every setting the figures need; a seed-0 run with
   the sweep's settings is the sweep's own run (same key), so it is not trained twice.
"""
from __future__ import annotations

import contextlib

import copy
import dataclasses
import functools
import hashlib
import json
import math
import os
import queue
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable, Optional

import torch

from lintrans._io import atomic_write, atomic_write_text
from lintrans.checks import check_positive_int
from lintrans.config import check_fields, set_key

RUNS_DIR = "runs"


# --- runs and their store ----------------------------------------------------------------------


def run_key(spec: dict) -> str:
    """Stable key of a run: sha256 of its settings as canonical JSON (key order does not matter)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def finite(obj):
    """The same JSON value with NaN and infinities as None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


class RunStore:
    """One JSON file per finished run under ``folder/runs``; other files of a run sit beside it."""

    def __init__(self, folder):
        self.folder = Path(folder) / RUNS_DIR

    def path(self, spec: dict, suffix: str = ".json") -> Path:
        return self.folder / f"{run_key(spec)}{suffix}"

    def get(self, spec: dict) -> Optional[dict]:
        p = self.path(spec)
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())["result"]
        except (ValueError, KeyError, TypeError) as e:  # written atomically, so only by hand or a bad disk
            raise ValueError(f"run file {p} is damaged ({type(e).__name__}: {e}); delete it and the same "
                             "command trains that run again") from None

    def put(self, spec: dict, result: dict) -> None:
        text = json.dumps({"key": run_key(spec), "spec": spec, "result": finite(result)}, allow_nan=False)
        atomic_write_text(self.path(spec), text)


class RunEnv:
    """What a run function gets besides its spec: progress reporting, file names in the store and
    the device to train on."""

    def __init__(self, store: RunStore, report: Callable[[int], None], device: str = "cpu"):
        self.store, self._report, self.reported = store, report, 0
        self.device = torch.device(device)

    def advance(self, n: int = 1) -> None:
        self.reported += n
        self._report(n)

    def path(self, spec: dict, suffix: str) -> Path:
        return self.store.path(spec, suffix)


def _resolve(fn_name: str) -> Callable:
    import importlib

    module, _, name = fn_name.partition(":")
    return getattr(importlib.import_module(module), name)


def _execute(fn_name: str, spec: dict, folder: str, units: int, report: Callable[[int], None],
             device: str = "cpu") -> dict:
    store = RunStore(folder)
    env = RunEnv(store, report, device)
    from lintrans.bench.machine import machine_info

    result = _resolve(fn_name)(spec, env)
    # runs of one record may be trained in several sessions on different machines: each names its own
    result = {**result, "device": str(env.device), "machine": machine_info(str(env.device)),
              "finished": time.strftime("%Y-%m-%d %H:%M"), "load_average": list(os.getloadavg())}
    store.put(spec, result)
    if env.reported < units:  # top up so the bar ends exact whatever the run reported
        report(units - env.reported)
    return result


# worker-process globals: the progress queue, the study's pid and a throttle, set once per worker by _init_worker
_QUEUE = None
_PARENT = None
_PENDING = [0, 0.0]


def run_threads(jobs: int) -> int:
    """Torch threads each run gets: the process's own with one job (it trains in this process),
    else the cores shared out among the worker processes."""
    return torch.get_num_threads() if jobs == 1 else max(1, cpu_cores() // jobs)


def _init_worker(progress_queue, threads: int, parent: int) -> None:
    global _QUEUE, _PARENT
    _QUEUE, _PARENT = progress_queue, parent
    torch.set_num_threads(threads)
    # the study's pid from the study itself: read here, a study killed while this worker started would
    # already be gone (the parent then init's)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose study process died (SIGKILL: no shutdown reached it) exits instead of training
    its queued runs unseen, beside the runs a rerun of the same command would train again."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _queue_report(n: int) -> None:
    _PENDING[0] += n
    now = time.monotonic()
    if now - _PENDING[1] > 0.5:  # a message every half second, not every step
        _QUEUE.put(_PENDING[0])
        _PENDING[0], _PENDING[1] = 0, now


def _worker(fn_name: str, spec: dict, folder: str, units: int, device: str) -> dict:
    if _PARENT is not None and os.getppid() != _PARENT:  # the study died since the watchdog last looked
        os._exit(1)
    try:
        return _execute(fn_name, spec, folder, units, _queue_report, device)
    finally:
        if _PENDING[0]:
            _QUEUE.put(_PENDING[0])
            _PENDING[0] = 0


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class StudyIncomplete(Exception):
    """Raised by a ``Runner`` whose ``max_runs`` is spent while runs remain: what it trained is in the
    store, and the same study started again goes on from there."""

    def __init__(self, trained: int, left: int):
        super().__init__(f"stopped after {trained} run{'s' * (trained != 1)} (the --max-runs limit) with at "
                         f"least {left} more to train")
        self.trained, self.left = trained, left


class Runner:
    """Runs the specs of one study that are not yet in its store, in-process (jobs=1) or in ``jobs``
    spawned worker processes with ``max(1, cores // jobs)`` torch threads each, behind one tqdm bar
    counting ``units(spec)`` (training steps) per run; every run trains on ``device``. With ``max_runs``
    it trains at most that many runs, in the order asked for, then raises ``StudyIncomplete``: a study
    too long for one sitting (or one lease of a GPU) is done in pieces without losing a started run."""

    def __init__(self, fn_name: str, out, *, jobs: int = 1, progress: bool = True,
                 units: Callable[[dict], int] = lambda spec: spec.get("steps", 1), desc: str = "",
                 device: str = "cpu", max_runs: Optional[int] = None):
        check_positive_int("jobs", jobs)
        check_positive_int("max_runs", max_runs, allow_none=True)
        self.fn_name, self.store, self.jobs, self.device = fn_name, RunStore(out), jobs, str(device)
        self.max_runs = max_runs
        self.progress, self.units, self.desc = progress, units, desc
        self.trained = 0  # runs trained (not found in the store) by this runner
        self.used: set = set()  # keys of every run asked for, trained or found

    def counts(self) -> dict:
        """How many distinct runs were trained now and how many came from the store."""
        return {"runs_trained": self.trained, "runs_reused": len(self.used) - self.trained}

    def run(self, specs: list[dict]) -> list[dict]:
        """Results in the order of ``specs``; finished runs come from the store."""
        self.used.update(run_key(spec) for spec in specs)
        todo = {}
        for spec in specs:
            if self.store.get(spec) is None:
                todo.setdefault(run_key(spec), spec)
        todo = list(todo.values())
        allowed = len(todo) if self.max_runs is None else max(0, self.max_runs - self.trained)
        if todo[:allowed]:
            self._run(todo[:allowed])
        if len(todo) > allowed:
            raise StudyIncomplete(self.trained, len(todo) - allowed)
        return [self.store.get(spec) for spec in specs]

    def _run(self, specs: list[dict]) -> None:
        from tqdm import tqdm

        total = sum(self.units(s) for s in specs)
        desc = f"{self.desc} ({len(specs)} run{'s' * (len(specs) > 1)})"
        with tqdm(total=total, desc=desc, file=sys.stderr, disable=not self.progress, dynamic_ncols=True,
                  unit="step") as bar:
            if self.jobs == 1:
                for spec in specs:
                    _execute(self.fn_name, spec, str(self.store.folder.parent), self.units(spec), bar.update,
                             self.device)
                    self.trained += 1
            else:
                self._run_parallel(specs, bar)

    def _run_parallel(self, specs: list[dict], bar) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        progress_queue = ctx.Queue()
        threads = run_threads(self.jobs)
        folder = str(self.store.folder.parent)
        with ProcessPoolExecutor(self.jobs, mp_context=ctx, initializer=_init_worker,
                                 initargs=(progress_queue, threads, os.getpid())) as pool:
            try:
                futures = {pool.submit(_worker, self.fn_name, s, folder, self.units(s), self.device) for s in specs}
                while futures:
                    done, futures = wait(futures, timeout=0.25, return_when=FIRST_COMPLETED)
                    self._drain(progress_queue, bar)
                    for f in done:
                        f.result()  # a failed run stops the study with its error
                        self.trained += 1
                self._drain(progress_queue, bar)
            except BaseException:
                workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown forgets them
                pool.shutdown(wait=False, cancel_futures=True)
                if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                    # runs in flight are lost either way; stopping them now lets the process exit now
                    for proc in workers:
                        proc.terminate()
                raise

    @staticmethod
    def _drain(progress_queue, bar) -> None:
        while True:
            try:
                bar.update(progress_queue.get_nowait())
            except queue.Empty:
                return


# --- the learning-rate sweep and aggregation ----------------------------------------------------


def lr_sweep(runner: Runner, specs: dict, score: Callable[[dict], Optional[float]], *, maximize: bool = False,
             tiebreak: Optional[Callable[[dict], Optional[float]]] = None) -> dict:
    """Run ``specs`` ({mechanism: [spec per learning rate]}) and pick, per mechanism, the rate whose
    run has the lowest ``score(result)`` (the highest with ``maximize``; held-out; None or NaN =
    diverged, never chosen), equal scores decided by the lowest ``tiebreak(result)``.

    Returns {"chosen": {mechanism: lr}, "table": {mechanism: [{"lr", "score"(, "tiebreak")}, ...]},
    "maximize": bool}.
    """
    flat = [s for group in specs.values() for s in group]
    results = iter(runner.run(flat))
    chosen, table = {}, {}
    for mech, group in specs.items():
        rows = []
        for spec in group:
            result = next(results)
            rows.append(sweep_row(spec["lr"], score(result), None if tiebreak is None else tiebreak(result)))
        table[mech] = rows
        chosen[mech] = best_lr(rows, maximize)
        if chosen[mech] is None:
            raise RuntimeError(f"every learning rate of the sweep diverged for {mech!r}: {[r['lr'] for r in rows]}")
    return {"chosen": chosen, "table": table, "maximize": maximize}


def _finite_or_none(value):
    return value if value is not None and math.isfinite(value) else None


def sweep_row(lr: float, value: Optional[float], tiebreak: Optional[float] = None) -> dict:
    """One rate's line of a sweep's table: its score, None where the run diverged (None or NaN)."""
    row = {"lr": lr, "score": _finite_or_none(value)}
    if tiebreak is not None:
        row["tiebreak"] = _finite_or_none(tiebreak)
    return row


def best_lr(rows: list, maximize: bool = False) -> Optional[float]:
    """The rate of the lowest score among ``rows`` (``sweep_row``s; the highest with ``maximize``), equal
    scores decided by the lowest tiebreak, then the first; None if every one diverged."""
    ok = [r for r in rows if r["score"] is not None]
    if not ok:
        return None
    sign = -1 if maximize else 1
    inf = float("inf")
    return min(ok, key=lambda r: (sign * r["score"], inf if r.get("tiebreak") is None else r["tiebreak"]))["lr"]


EACH_POINT = "each"  # sweep_point value: sweep the rate at every point, not at one


def sweep_and_seeds(runner: Runner, mechanisms: list, *, lrs: list, seeds: int, spec_for: Callable,
                    score: Callable, points: list = (None,), sweep_point=None, name: str = "attention",
                    fields: Callable = lambda point: {}, maximize: bool = False,
                    tiebreak: Optional[Callable] = None) -> tuple:
    """The two phases of a study. ``spec_for(mechanism, point, lr, seed)`` is a run's spec.

    1. ``lr_sweep`` of every mechanism over ``lrs``, seed 0, at ``sweep_point`` (or, with
       ``sweep_point=EACH_POINT``, at every point of ``points``: a rate per mechanism and point);
    2. every mechanism at every point of ``points`` with seeds 0..seeds-1 at its chosen rate.
    Returns (sweep, runs): sweep is one ``lr_sweep`` result, or with EACH_POINT a list of them, one
    per point, each with ``fields(point)``; each run is {name: mechanism, **fields(point), seed, lr,
    key, **result}.
    """
    each = isinstance(sweep_point, str) and sweep_point == EACH_POINT
    at = list(points) if each else [sweep_point]
    # every sweep run in one batch, so that --jobs N runs them in parallel; lr_sweep then reads the store
    runner.run([spec_for(m, p, lr, 0) for p in at for m in mechanisms for lr in lrs])
    sweeps = [lr_sweep(runner, {m: [spec_for(m, p, lr, 0) for lr in lrs] for m in mechanisms}, score,
                       maximize=maximize, tiebreak=tiebreak) for p in at]
    chosen = [sw["chosen"] for sw in sweeps]
    grid = [(m, i, p, seed) for m in mechanisms for i, p in enumerate(points) for seed in range(seeds)]
    specs = [spec_for(m, p, chosen[i if each else 0][m], seed) for m, i, p, seed in grid]
    runs = [{name: m, **fields(p), "seed": seed, "lr": spec["lr"], "key": run_key(spec), **result}
            for (m, _, p, seed), spec, result in zip(grid, specs, runner.run(specs))]
    if each:
        return [{**fields(p), **sw} for p, sw in zip(at, sweeps)], runs
    return sweeps[0], runs


def spread(values) -> dict:
    """Mean, min and max over seeds (None values, i.e. diverged runs, are counted but left out)."""
    ok = [v for v in values if v is not None and math.isfinite(v)]
    if not ok:
        return {"mean": None, "min": None, "max": None, "n": 0, "n_failed": len(values)}
    return {"mean": sum(ok) / len(ok), "min": min(ok), "max": max(ok), "n": len(ok), "n_failed": len(values) - len(ok)}


def spread_curves(curves: list[list]) -> dict:
    """Pointwise spread of curves over seeds: {"mean": [...], "min": [...], "max": [...]}, as long as the
    longest; a curve that ends early (its run diverged) or is None counts only where it has points."""
    curves = [c for c in curves if c is not None]
    n = max((len(c) for c in curves), default=0)
    cols = [spread([c[i] for c in curves if i < len(c)]) for i in range(n)]
    return {k: [c[k] for c in cols] for k in ("mean", "min", "max")}


def write_record(out, name: str, record: dict) -> Path:
    from lintrans.bench.machine import machine_info

    record = {"study": name, **record, "machine": machine_info(record.get("settings", {}).get("device", "cpu"))}
    path = Path(out) / f"{name}.json"
    atomic_write_text(path, json.dumps(finite(record), indent=1, allow_nan=False))
    return path


# --- training ---------------------------------------------------------------------------------


def lr_factor(step: int, steps: int, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` of the steps, then cosine down to ``floor`` of the peak."""
    warm = max(1, int(steps * warmup))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(model: torch.nn.Module, *, lr: float, steps: int, loss_at: Callable[[int], torch.Tensor],
          evaluate: Optional[Callable[[], dict]] = None, eval_every: int = 0, env: Optional[RunEnv] = None,
          params=None, weight_decay: float = 0.0) -> dict:
    """AdamW with warm-up and cosine decay, gradient clipping at 1.

    ``loss_at(step)`` builds that step's batch and returns its loss. ``evaluate()`` (in eval mode,
    without gradients) runs before the first step, every ``eval_every`` steps and after the last.
    Seconds count training only (evaluations excluded). A non-finite loss stops the run
    (``diverged``). Returns the loss and cumulative seconds of every step and the evaluations.
    """
    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    losses, seconds, evals = [], [], []
    elapsed, diverged = 0.0, False

    def run_eval(step: int) -> None:
        if evaluate is None:
            return
        model.eval()
        with torch.no_grad():
            evals.append({"step": step, "seconds": elapsed, **evaluate()})
        model.train()

    model.train()
    run_eval(0)
    for step in range(steps):
        t0 = time.perf_counter()
        loss = loss_at(step)
        if not torch.isfinite(loss):
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        elapsed += time.perf_counter() - t0
        losses.append(loss.item())
        seconds.append(elapsed)
        if env is not None:
            env.advance()
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            run_eval(step + 1)
    if not diverged:
        run_eval(steps)
    return {"train_loss": losses, "seconds": seconds, "evals": evals, "diverged": diverged,
            "train_seconds": elapsed, "threads": torch.get_num_threads()}


def loss_spikes(losses: list, window: int = 20, threshold: float = 0.5) -> list[dict]:
    """Steps whose training loss exceeds the mean of the ``window`` steps before by more than
    ``threshold`` (nats): [{"step", "size"}]."""
    spikes = []
    for i in range(window, len(losses)):
        rise = losses[i] - sum(losses[i - window:i]) / window
        if rise > threshold:
            spikes.append({"step": i, "size": rise})
    return spikes


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- plots ------------------------------------------------------------------------------------


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def band(ax, x, curves: list[list], label: str = None, color=None, marker=None, **kw):
    """Mean line with a min-max band over seeds; returns the line's colour."""
    s = spread_curves(curves)
    n = len(s["mean"])
    xs = list(x)[:n]
    pts = [(a, m, lo, hi) for a, m, lo, hi in zip(xs, s["mean"], s["min"], s["max"]) if m is not None]
    if not pts:
        return color
    a, m, lo, hi = zip(*pts)
    if label is not None and len(curves) > 1:  # the seeds the mean is of: a failed seed is left out of it
        have = sum(1 for c in curves if c is not None and any(v is not None for v in c))
        label = f"{label} (n={have})" if have == len(curves) else f"{label} (n={have} of {len(curves)})"
    (line,) = ax.plot(a, m, label=label, color=color, marker=marker, ms=3, **kw)
    if len(curves) > 1:
        ax.fill_between(a, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    return line.get_color()


def plot_sweep(sweep, path, title: str, score_label: str, panel_title: Callable = None) -> Path:
    """Held-out score against learning rate per mechanism, the chosen rate circled. ``sweep`` is one
    ``lr_sweep`` result, or a list of them (``sweep_point=EACH_POINT``), drawn as panels titled
    ``panel_title(sweep)``."""
    plt = pyplot()
    sweeps = sweep if isinstance(sweep, list) else [sweep]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 if len(sweeps) == 1 else 4.2 * len(sweeps), 4),
                             squeeze=False)
    for ax, sw in zip(axes[0], sweeps):
        for mech, rows in sw["table"].items():
            ok = [r for r in rows if r["score"] is not None]
            (line,) = ax.plot([r["lr"] for r in ok], [r["score"] for r in ok], marker="o", ms=4, label=mech)
            best = [r for r in ok if r["lr"] == sw["chosen"][mech]]
            ax.plot([best[0]["lr"]], [best[0]["score"]], "o", ms=11, mfc="none", color=line.get_color())
            for r in rows:
                if r["score"] is None:  # diverged: marked at the top edge
                    ax.annotate("x", (r["lr"], 1), xycoords=("data", "axes fraction"), color=line.get_color(),
                                ha="center", va="top")
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate (seed 0)")
        ax.set_ylabel(score_label)
        if panel_title is not None:
            ax.set_title(panel_title(sw), fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    which = "highest" if sweeps[0].get("maximize") else "lowest"
    fig.suptitle(f"learning-rate sweep, {title}\ncircled = chosen ({which}), x = diverged", fontsize=8)
    fig.tight_layout()
    return save(fig, path)


QUICK_BANNER = "--quick: a machinery check with tiny settings, not a result"
_banner: list = []  # the banner save() puts on every figure while machinery_check(True) is active


@contextlib.contextmanager
def machinery_check(active: bool):
    """While active, every figure saved carries QUICK_BANNER above its title: a --quick record's
    scores sit near chance by design, and its plots must not pass for the study's."""
    _banner.append(QUICK_BANNER if active else None)
    try:
        yield
    finally:
        _banner.pop()


def save(fig, path) -> Path:
    if _banner and _banner[-1]:
        title = fig._suptitle.get_text() if fig._suptitle is not None else ""
        fig.suptitle(_banner[-1] + ("\n" + title if title else ""), fontsize=9, color="firebrick")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))  # a kill leaves the old plot whole
    pyplot().close(fig)
    return Path(path)


# --- settings ---------------------------------------------------------------------------------


check_int = check_positive_int  # the studies' positive-int check is lintrans.checks' one


def check_ints(name: str, values) -> None:
    if not isinstance(values, list) or not values:
        raise ValueError(f"{name} must be a non-empty list of ints, got {values!r}")
    for v in values:
        check_positive_int(f"every entry of {name}", v)
    if len(set(values)) != len(values) or values != sorted(values):
        raise ValueError(f"{name} must be distinct and increasing, got {values}")


def check_lrs(lrs, name: str = "lrs") -> None:
    if not isinstance(lrs, list) or not lrs or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1 for x in lrs):
        raise ValueError(f"{name} must be a non-empty list of learning rates in (0, 1), got {lrs!r}")
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"{name} must be distinct, got {lrs}")


def setting_label(name: str) -> str:
    return f"setting {name!r}"


def _type_of(value):
    return list[_type_of(value[0])] if isinstance(value, list) and value else type(value)


POSITIVE = {"low": 1}  # a setting's limits, as field metadata (lintrans.config): an int >= 1

# --help text of the settings several studies share (a study's own text for one takes precedence)
COMMON_HELP = {
    "seeds": "seeds per point; seed 0 also sweeps the learning rates",
    "n_layer": "layers of every model",
    "n_head": "attention heads per layer",
    "n_embd": "model width",
    "steps": "optimizer steps per run",
    "batch_size": "sequences per step",
    "eval_every": "steps between held-out evaluations",
    "eval_batch": "held-out sequences scored",
}


def help_texts(default: dict, own: dict) -> dict:
    """Each setting of a study's ``default`` -> its --help text: ``own`` where the study has one, else
    COMMON_HELP's. A setting with neither, or ``own`` text for no setting, is a KeyError (a stale text)."""
    missing = [k for k in default if k not in own and k not in COMMON_HELP]
    stale = [k for k in own if k not in default]
    if missing or stale:
        raise KeyError(f"settings without help text: {missing}; help text for no setting: {stale}")
    return {k: own.get(k, COMMON_HELP.get(k)) for k in default}


def settings_class(name: str, default: dict, limits: Optional[dict] = None, help: Optional[dict] = None) -> type:
    """A study's settings as a dataclass (names, types and defaults from its ``DEFAULT``, limits from
    its ``LIMITS``: setting name -> field metadata such as ``POSITIVE``, and ``type`` where the default
    cannot say it, e.g. ``list[int]`` for an empty list; ``help``: setting name -> its --help text), so
    the command line, --set and files check them with ``lintrans.config`` like every other config."""
    limits, help = limits or {}, help or {}
    fields = []
    for k, v in default.items():
        meta = dict(limits.get(k, {}), **({"help": help[k]} if k in help else {}))
        typ = meta.pop("type", None) or _type_of(v)  # an empty default list says nothing of its entries
        fields.append((k, typ, dataclasses.field(default_factory=functools.partial(copy.deepcopy, v), metadata=meta)))
    return dataclasses.make_dataclass(f"{name.title()}Settings", fields)


def check_settings(s: dict, default: dict, limits: dict) -> None:
    """Every setting of ``s`` against its type (from ``default``) and ``limits``, as when it was set
    (other keys of ``s``, such as ``quick``, are the run's, not the study's)."""
    check_fields(settings_class("study", default, limits)(**{k: s[k] for k in default if k in s}), label=setting_label)


def resolve_settings(default: dict, changes: dict) -> dict:
    """``default`` with ``changes`` applied; unknown names and values of the wrong type are errors."""
    settings = settings_class("study", default)()
    for name, value in changes.items():
        set_key(settings, name, value, label=setting_label)
    return dataclasses.asdict(settings)


def layers(n: int) -> str:
    """'1 layer', '2 layers': for the setting lines of the plots."""
    return f"{n} layer{'' if n == 1 else 's'}"


def style(ax, xlabel: str, ylabel: str, title: str = None) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def panels(titles: list, *, sharey: bool = False, size=(3.3, 2.7)):
    """A grid of small panels, one per title (at most 4 a row): (fig, [axes])."""
    plt = pyplot()
    cols = min(4, len(titles))
    rows = -(-len(titles) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), sharex=True, sharey=sharey,
                             squeeze=False)
    for ax in axes.flat[len(titles):]:
        ax.axis("off")
    used = list(axes.flat[:len(titles)])
    for ax, t in zip(used, titles):
        ax.set_title(t, fontsize=9)
    return fig, used


def finish_panels(fig, axes, xlabel: str, ylabel: str, title: str) -> None:
    import textwrap

    for ax in axes:
        style(ax, xlabel, ylabel)
    # each line wrapped to the figure's width: a one-panel figure would otherwise crop a long title
    chars = max(40, int(fig.get_figwidth() * 72 / (9 * 0.55)))
    fig.suptitle("\n".join(textwrap.fill(line, chars) for line in title.split("\n")), fontsize=9)
