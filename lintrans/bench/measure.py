"""Timing and peak memory of one step, and a sweep over context lengths that stops at a cap.

Peak memory on CPU is the rise of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) during one step. For that to count only what the step allocates, glibc
hands every allocation above 128 KiB straight to mmap during that step, so freed tensors leave the
resident set at once instead of lingering in the heap; timed steps run with fixed ordinary settings
(blocks up to 32 MiB reused from the heap). On CUDA it is the allocator's
``max_memory_allocated``. Where neither is available memory is reported as None.
"""
from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from .machine import synchronize
from .trend import rose_too_far

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_libc = None


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's malloc thresholds; False where that is not possible (not glibc)."""
    global _libc
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        return (_libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
                and _libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1)
    except (OSError, AttributeError):
        return False


def timing_malloc() -> None:
    """The allocator as a long-running job sees it: blocks up to 32 MiB reused from the heap, not
    returned to the OS after every step (glibc's dynamic threshold, made fixed so that every point
    of a sweep runs under the same rules)."""
    _mallopt(32 * 2**20, 1 << 30)


def memory_malloc() -> bool:
    """Every block over 128 KiB its own mapping, unmapped when freed: peak RSS is then exact."""
    return _mallopt(128 * 1024, 128 * 1024)


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def peak_memory(fn: Callable[[], object], device: str = "cpu") -> Optional[int]:
    """Bytes allocated above the starting point at the peak of one call of ``fn``."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    if not memory_malloc():
        return None
    try:
        _libc.malloc_trim(0)  # hand free heap pages back, or the step could reuse them unseen
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := current RSS
        start = _proc_status("VmRSS")
        fn()
        return max(0, _proc_status("VmHWM") - start)
    except OSError:
        return None
    finally:
        timing_malloc()


def time_step(fn: Callable[[], object], *, device: str = "cpu", cpu: Optional[list] = None,
              faults: Optional[list] = None) -> float:
    """Seconds of one call of ``fn`` (already warmed up), the device's queue drained on both sides.
    ``cpu``: a list to append the process CPU seconds of the call to (with one thread, the work
    itself, whatever else runs on the machine); ``faults``: one to append its minor page faults to
    (Unix)."""
    if faults is not None:
        import resource

        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    synchronize(device)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    synchronize(device)
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    if faults is not None:
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return t


class StepTimeout(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise StepTimeout in this (main) thread after ``seconds``; a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def handler(signum, frame):
        raise StepTimeout()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def is_oom(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in msg or "can't allocate memory" in msg


@dataclass
class Caps:
    """Where a curve stops: a step longer than ``time_s`` or a predicted peak above ``memory_bytes``."""

    time_s: float = 10.0
    memory_bytes: Optional[int] = None
    repeats: int = 5
    budget_s: float = 5.0
    # timed repeats at least (never more than `repeats`) where two or more series are timed side by
    # side: one round of A B C leaves each series one sample, and one slow moment decides the ratio
    min_repeats: int = 1
    # rounds of repeats taken again where a point rose further than a step can (trend.rose_too_far)
    retimes: int = 1


@dataclass
class Point:
    series: str
    T: int
    status: str = "ok"  # ok | time cap | memory cap | oom | error: ...
    time_s: Optional[float] = None
    times_s: list = field(default_factory=list)
    cpu_times_s: list = field(default_factory=list)  # process CPU seconds of each timed repeat
    peak_bytes: Optional[int] = None
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        cpu = {"cpu_s": min(self.cpu_times_s), "cpu_times_s": self.cpu_times_s} if self.cpu_times_s else {}
        return {"series": self.series, "T": self.T, "status": self.status, "time_s": self.time_s,
                "times_s": self.times_s, "peak_bytes": self.peak_bytes, **cpu, **self.extra}


def _growth(prev: list[Point], attr: str) -> float:
    """Ratio to expect from the next doubling of T: the smaller of the last two observed, at least 2
    (linear) and at most 8. The smaller, so that one disturbed point does not end a curve."""
    vals = [getattr(p, attr) for p in prev if getattr(p, attr)]
    ratios = [b / a for a, b in zip(vals[-3:], vals[-2:]) if a > 0]
    if ratios:
        return max(2.0, min(8.0, min(ratios)))
    return 2.0


def _predicts(ok: list[Point]) -> bool:
    """Whether the last measured points may predict the next one: not when the last still rose
    further than a step can (after its re-timing); then the next point is measured, not guessed
    (its warm-up is cut at the cap either way)."""
    return len(ok) < 2 or not rose_too_far([(p.T, p.time_s) for p in ok], len(ok) - 1)


@dataclass
class Series:
    """One curve of a sweep: ``make_step(T)`` returns the step, or (step, facts to record beside it).
    ``within``: another series' name; this one is measured only at the T where that one was."""

    name: str
    make_step: Callable[[int], object]
    measure_memory: bool = True
    within: Optional[str] = None


def sweep_side_by_side(series: list[Series], Ts: Iterable[int], caps: Caps, *, device: str = "cpu",
                       together: bool = True, on_point: Optional[Callable[[Point], None]] = None) -> list[Point]:
    """Every series at one T, then the next T; each curve ends at its first point past a cap.

    With ``together`` all steps of a T are built and warmed up first and their timed repeats then
    taken in turn (A B C A B C ...): a shared machine's speed drifts within seconds (docs/benchmarks.md), and
    alternating exposes every series to the same drift, so ratios hold where absolute times do not.
    Without it (when the steps would not fit in memory at once) each series is measured in turn.
    Returns the points grouped by series, T ascending.
    """
    timing_malloc()
    done: dict[str, list[Point]] = {s.name: [] for s in series}
    for T in Ts:
        group, live = [], []  # this T's points; (series, point, step, warm-up seconds) ready to time
        for s in series:
            prev = done[s.name]
            if prev and prev[-1].status != "ok":
                continue
            if s.within is not None and not any(p.T == T and p.status == "ok" for p in done.get(s.within, [])):
                continue
            point = Point(s.name, T)
            group.append(point)
            ok = [p for p in prev if p.status == "ok"]
            prev.append(point)
            if ok and _predicts(ok) and ok[-1].time_s * _growth(ok, "time_s") > caps.time_s:
                point.status = "time cap"
                point.extra["predicted_s"] = ok[-1].time_s * _growth(ok, "time_s")
            elif ok and caps.memory_bytes and ok[-1].peak_bytes and ok[-1].peak_bytes * _growth(ok, "peak_bytes") > caps.memory_bytes:
                point.status = "memory cap"
            else:
                expected = ok[-1].time_s * _growth(ok, "time_s") if ok and _predicts(ok) else None
                step, first = _prepare(point, s.make_step, caps, device, expected)
                if step is not None:
                    live.append((s, point, step, first))
                    del step  # the list holds it; gone once timed
                    if not together:
                        _time_and_size(live, caps, device, done)
        _time_and_size(live, caps, device, done)
        for point in group:
            if on_point is not None:
                on_point(point)
    return [p for s in series for p in done[s.name]]


def sweep(series: str, Ts: Iterable[int], make_step: Callable[[int], Callable[[], object]], caps: Caps, *,
          device: str = "cpu", measure_memory: bool = True, on_point: Optional[Callable[[Point], None]] = None
          ) -> list[Point]:
    """One series alone: time ``make_step(T)()`` for growing T (see ``sweep_side_by_side``)."""
    return sweep_side_by_side([Series(series, make_step, measure_memory)], Ts, caps, device=device, on_point=on_point)


def _prepare(point: Point, make_step, caps: Caps, device: str, expected: Optional[float] = None):
    """Build and warm up one step; returns (step, seconds of the warm-up) or (None, None) with the
    point's status set when it failed or ran past the cap. A warm-up past the cap where the curve's
    trend (``expected`` seconds) says well under it is run once more before the curve ends there."""
    try:
        step = make_step(point.T)
        if isinstance(step, tuple):  # (step, facts measured while setting it up, e.g. a prefill)
            step, extra = step
            point.peak_bytes = extra.pop("peak_bytes", None)
            point.extra.update(extra)
        for attempt in range(2):
            t0 = time.perf_counter()
            with _alarm(3 * caps.time_s):  # a Python-level loop form can take minutes: cut it short
                step()  # warm-up; also the first estimate of the cost
                synchronize(device)
            first = time.perf_counter() - t0
            if first <= caps.time_s or expected is None or expected > caps.time_s / 2 or attempt:
                break
            point.extra["warmups"] = 2
        if first > caps.time_s:
            point.status, point.time_s, point.times_s = "time cap", first, [first]
            return None, None
        return step, first
    except StepTimeout:
        point.status = "time cap"
    except Exception as e:  # a failed point ends its curve; the benchmark goes on
        _failed(point, e)
    return None, None


def _failed(point: Point, e: BaseException) -> None:
    point.status = "oom" if is_oom(e) else f"error: {type(e).__name__}: {e}"[:200]


def _rose_too_far(done: Optional[dict], s: Series, point: Point) -> bool:
    """Whether ``point`` rose further than a step can from the measured points of ``s`` before it."""
    pts = [(p.T, p.time_s) for p in (done or {}).get(s.name, []) if p.status == "ok" and p.T < point.T]
    return bool(pts) and rose_too_far(pts + [(point.T, point.time_s)], len(pts))


def _time_and_size(live: list, caps: Caps, device: str, done: Optional[dict] = None) -> None:
    """Timed repeats of the warmed-up steps, taken in turn, then each one's peak memory. A point
    that rose further than a step can from its series' earlier ones (``done``) was disturbed: the
    whole group is timed once more, in turn, and each point keeps its fastest repeat of both."""
    least = caps.min_repeats if len(live) > 1 else 1
    # one count for the whole group, from its slowest warm-up: the fastest of 3 against the fastest of 1
    # would tilt a ratio towards the series with more chances of a quiet moment
    slowest = max((first for *_, first in live), default=0.0)
    count = max(1, min(caps.repeats, max(least, int(caps.budget_s / max(slowest, 1e-9)))))
    reps = {id(p): count for _, p, _, _ in live}
    for attempt in range(1 + caps.retimes):
        for r in range(max(reps.values(), default=0)):
            for _, point, step, _ in live:
                if r >= reps[id(point)] or point.status != "ok":
                    continue
                try:
                    point.times_s.append(time_step(step, device=device, cpu=point.cpu_times_s))
                except Exception as e:
                    _failed(point, e)
        # interference from other tenants only ever adds time, so the fastest repeat is the
        # estimate, as timeit advises
        suspects = []
        for s, point, _, _ in live:
            if point.status == "ok":
                point.time_s = min(point.times_s)
                if _rose_too_far(done, s, point):
                    suspects.append(point)
        if not suspects or attempt == caps.retimes:
            break
        for point in suspects:
            point.extra["retimed"] = point.extra.get("retimed", 0) + 1
    for s, point, step, _ in live:
        if point.status != "ok":
            continue
        if s.measure_memory:
            try:
                point.peak_bytes = peak_memory(step, device)
            except Exception as e:
                _failed(point, e)
    live.clear()
