"""Makes this folder's record: the native kernels built for AVX2 only (-march=x86-64-v3, an emulated
Zen 3) against the default build (-march=native, AVX-512 here), and the AVX2 build as it was before
-fno-trapping-math (elu map and gradient, AFT's step, the window's exps scalar).

    python docs/results/native-avx2/run.py            # ~10 min on a quiet 2-core machine

Steps, each a plain Python process with default settings (the variables named are the only ones set):
1. the three builds (``python -m lintrans.ops.native`` with LINTRANS_NATIVE_MARCH; the third by the
   same command without -fno-trapping-math);
2. libm calls per forward + backward of each op and build (scalar_calls.py under libm_calls.so);
3. tools/ab_kernels.py --builds, default build against AVX2 build, with torch's MKL on its default
   path and with MKL_ENABLE_INSTRUCTIONS=AVX2; and the AVX2 build before/after the fix (MKL AVX2);
   the last two again with --threads 1 (process CPU time: the work, however busy the machine);
4. the chunked op's share of the matmul probe with one thread, by process CPU time (share_1thread.py):
   default, emulated (LINTRANS_NATIVE_MARCH=x86-64-v3 MKL_ENABLE_INSTRUCTIONS=AVX2) and emulated with
   the build before the fix;
5. ``lintrans cost ... --measure-op`` (THP_MEM_ALLOC_ENABLE=0, as the issue's figure: 2 threads, wall
   time), default and emulated, alternating, --repeats times;
then results.json (everything, with the machine, its vector features and load) and results.png.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

PY = sys.executable
REUSE = False  # --reuse: a step whose output is here already is read, not run again
EMULATED = {"LINTRANS_NATIVE_MARCH": "x86-64-v3", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items()
         if k not in ("LINTRANS_NATIVE_MARCH", "MKL_ENABLE_INSTRUCTIONS", "THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS")}
    e["PYTHONPATH"] = str(ROOT)
    e.update(extra)
    return e


def run(cmd, log: Path, **extra) -> str:
    print("$", " ".join(f"{k}={v}" for k, v in extra.items()), " ".join(map(str, cmd)), flush=True)
    res = subprocess.run(list(map(str, cmd)), env=env(**extra), capture_output=True, text=True, cwd=ROOT)
    log.write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"failed ({res.returncode}): see {log}")
    return res.stdout


def builds(out: Path) -> dict:
    """{name: path} of the three builds, copied into out."""
    paths = {}
    for name, march in (("native", "native"), ("x86-64-v3", "x86-64-v3")):
        p = run([PY, "-m", "lintrans.ops.native"], out / f"build-{name}.log", LINTRANS_NATIVE_MARCH=march).strip()
        paths[name] = Path(shutil.copy(p, out / f"{name}.so"))
    from lintrans.ops import native

    os.environ["LINTRANS_NATIVE_MARCH"] = "x86-64-v3"
    flags = [f for f in native.flags() if f != "-fno-trapping-math"]
    del os.environ["LINTRANS_NATIVE_MARCH"]
    lib = native._torch_lib()
    so = out / "x86-64-v3-trapping-math.so"
    cmd = [native.compiler(), *flags, *map(str, native.SOURCES), "-o", str(so), f"-L{lib}", "-ltorch_cpu", "-lc10",
           "-lmvec", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    paths["x86-64-v3-trapping-math"] = so
    return paths


def ab(paths, a: str, b: str, name: str, rounds: int, threads=None, **extra) -> list:
    jsonl = HERE / f"ab-{name}.jsonl"
    if not (REUSE and jsonl.exists()):
        jsonl.unlink(missing_ok=True)
        run([PY, ROOT / "tools/ab_kernels.py", "--builds", paths[a], paths[b], "--T", "4096", "16384", "--ops", "chunked",
             "gated", "aft", "sliding-window", "--rounds", rounds, "--out", jsonl,
             *(["--threads", threads] if threads else [])], HERE / f"ab-{name}.log", **extra)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for r in rows:
        r["builds"] = {"old": a, "new": b}
    return rows


LINE = re.compile(r"T=(\d+): ([\d.]+)GFLOP in ([\d.]+) ms = ([\d.]+)GFLOP/s, ([\d.]+)% of the probe")
PROBE = re.compile(r"matmul probe \(1024-square float32\): (\d+) GFLOP/s")


def cost(repeats: int) -> list:
    cmd = [PY, "-m", "lintrans", "cost", "--n-layer", "1", "--n-head", "8", "--n-embd", "512", "--T", "4096", "16384",
           "--measure-op"]
    rows = []
    for i in range(repeats):
        for name, extra in (("default", {}), ("emulated-avx2", EMULATED)):
            load, log = os.getloadavg(), HERE / f"cost-{name}-{i + 1}.log"
            if REUSE and log.exists() and LINE.search(log.read_text()):
                out, load = log.read_text(), None
            else:
                out = run(cmd, log, THP_MEM_ALLOC_ENABLE="0", **extra)
            probe = int(PROBE.search(out).group(1))
            for m in LINE.finditer(out):
                rows.append({"variant": name, "repeat": i + 1, "T": int(m.group(1)), "op_ms": float(m.group(3)),
                             "gflops": float(m.group(4)), "share_of_probe_pct": float(m.group(5)),
                             "probe_gflops": probe, "load_average_before": load})
    return rows


def shares_1thread(paths, repeats: int) -> dict:
    out = {}
    for name, extra, lib in (("default", {}, None), ("emulated-avx2", EMULATED, None),
                             ("emulated-avx2 before the fix", EMULATED, paths["x86-64-v3-trapping-math"])):
        log = HERE / f"share-1thread-{name.replace(' ', '-')}.log"
        text = log.read_text() if REUSE and log.exists() else run(
            [PY, HERE / "share_1thread.py", "--repeats", repeats, *(["--library", lib] if lib else [])], log, **extra)
        out[name] = json.loads(text.strip().splitlines()[-1])
    return out


def summary(ab_rows: dict, cost_rows: list) -> dict:
    s = {"ab_median_ms": {}, "ab_cpu_min_ms": {}, "probe_share_pct": {}}
    for name, rows in ab_rows.items():
        for r in rows:
            for variant, res in r["results"].items():
                build = r["builds"]["old" if variant.endswith(" old") else "new"]
                s["ab_median_ms"][f"{name} | {r['op']} T={r['T']} | {build}"] = res["median_ms"]
                s["ab_cpu_min_ms"][f"{name} | {r['op']} T={r['T']} | {build}"] = res["cpu_min_ms"]
    for variant in ("default", "emulated-avx2"):
        for T in sorted({r["T"] for r in cost_rows}):
            xs = [r["share_of_probe_pct"] for r in cost_rows if r["variant"] == variant and r["T"] == T]
            ms = [r["op_ms"] for r in cost_rows if r["variant"] == variant and r["T"] == T]
            s["probe_share_pct"][f"{variant} T={T}"] = {"median": statistics.median(xs), "all": xs,
                                                        "op_ms_median": statistics.median(ms)}
    return s


def plot(ab_rows: dict, shares: dict, cost_rows: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a3, a2) = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [2.2, 1.2, 1]})
    ops = ["chunked", "gated", "aft", "sliding-window"]
    # one thread, process CPU time (fastest of the rounds): the work itself, whatever else runs
    series = [("native build (AVX-512), MKL AVX2", "mkl-avx2-1thread", "old"),
              ("AVX2 build, MKL AVX2", "mkl-avx2-1thread", "new"),
              ("AVX2 build before the fix, MKL AVX2", "avx2-fix-1thread", "old")]
    w = 0.26
    for j, (label, name, which) in enumerate(series):
        ys = []
        for op in ops:
            r = next(r for r in ab_rows[name] if r["op"] == op and r["T"] == 16384)
            ys.append(next(v["cpu_min_ms"] for k, v in r["results"].items() if k.endswith(" " + which)))
        a1.bar([i + (j - 1) * w for i in range(len(ops))], ys, w, label=label)
    a1.set_xticks(range(len(ops)), ops)
    a1.set_ylabel("forward + backward, CPU ms, fastest (T=16384, B=1, H=8, D=64)")
    a1.legend(fontsize=8)
    a1.set_title("A/B of the builds in one process, 1 thread")
    Ts = sorted({r["T"] for r in cost_rows})
    names = list(shares)
    for j, name in enumerate(names):
        ys = [shares[name][f"T={T}"]["share_pct"] for T in Ts]
        a3.bar([i + (j - 1) * 0.27 for i in range(len(Ts))], ys, 0.27, label=name)
    a3.axhline(45, color="r", ls="--", lw=1, label="target 45%")
    a3.set_xticks(range(len(Ts)), [f"T={T}" for T in Ts])
    a3.set_ylabel("chunked op, % of the matmul probe")
    a3.legend(fontsize=8, loc="lower center")
    a3.set_title("1 thread, process CPU time (load-proof)")
    for j, (variant, label) in enumerate((("default", "native build, MKL default"),
                                          ("emulated-avx2", "AVX2 build, MKL AVX2"))):
        meds = [statistics.median(r["share_of_probe_pct"] for r in cost_rows if r["variant"] == variant and r["T"] == T)
                for T in Ts]
        a2.bar([i + (j - 0.5) * 0.35 for i in range(len(Ts))], meds, 0.35, label=label)
        for r in cost_rows:
            if r["variant"] == variant:
                a2.plot(Ts.index(r["T"]) + (j - 0.5) * 0.35, r["share_of_probe_pct"], "k.", ms=4)
    a2.axhline(45, color="r", ls="--", lw=1, label="target 45%")
    a2.set_xticks(range(len(Ts)), [f"T={T}" for T in Ts])
    a2.set_ylabel("chunked op, % of the matmul probe (median, dots: runs)")
    a2.legend(fontsize=8, loc="lower center")
    a2.set_title("lintrans cost --measure-op (2 threads, wall)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="A/B rounds per op and T")
    p.add_argument("--repeats", type=int, default=3, help="runs of lintrans cost per variant")
    p.add_argument("--share-repeats", type=int, default=7, help="timed calls in share_1thread.py")
    p.add_argument("--reuse", action="store_true", help="read the steps whose outputs are here already "
                   "(a run cut short goes on where it stopped)")
    args = p.parse_args()
    global REUSE
    REUSE = args.reuse
    from lintrans._platform import cpu_vector_features
    from lintrans.bench.machine import machine_info

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = builds(tmp)
        counter = tmp / "libm_calls.so"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-mavx512f", "-o", str(counter), str(HERE / "libm_calls.c"),
                        "-ldl"], check=True)
        if not (REUSE and (HERE / "scalar_calls.json").exists()):
            run([PY, HERE / "scalar_calls.py", *paths.values(), "--out", HERE / "scalar_calls.json"],
                HERE / "scalar_calls.log", LD_PRELOAD=str(counter))
        ab_rows = {"mkl-default": ab(paths, "native", "x86-64-v3", "mkl-default", args.rounds),
                   "mkl-avx2": ab(paths, "native", "x86-64-v3", "mkl-avx2", args.rounds, MKL_ENABLE_INSTRUCTIONS="AVX2"),
                   "avx2-fix": ab(paths, "x86-64-v3-trapping-math", "x86-64-v3", "avx2-fix", args.rounds,
                                  MKL_ENABLE_INSTRUCTIONS="AVX2"),
                   # one thread: its process CPU time is the work itself however busy the machine is
                   "mkl-avx2-1thread": ab(paths, "native", "x86-64-v3", "mkl-avx2-1thread", args.rounds, threads=1,
                                          MKL_ENABLE_INSTRUCTIONS="AVX2"),
                   "avx2-fix-1thread": ab(paths, "x86-64-v3-trapping-math", "x86-64-v3", "avx2-fix-1thread",
                                          args.rounds, threads=1, MKL_ENABLE_INSTRUCTIONS="AVX2")}
        shares = shares_1thread(paths, args.share_repeats)
    cost_rows = cost(args.repeats)
    machine = machine_info()
    busy = max(load_start[0], os.getloadavg()[0]) > 1.0
    record = {
        "what": "native kernels (lintrans/ops/native) built for AVX2 only vs the default -march=native build; "
                "the AVX2 build before -fno-trapping-math; the chunked op's share of the matmul probe",
        "command": "python docs/results/native-avx2/run.py " + " ".join(sys.argv[1:]),
        "started": started,
        "reused": "steps whose outputs were here already were read, not run again (--reuse): their logs' "
                  "times are earlier than started" if REUSE else None, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine, "cpu_vector_features": cpu_vector_features(),
        "emulation": "AVX2-only CPU emulated: kernels built with -march=x86-64-v3 (AVX2, FMA, no AVX-512), torch's "
                     "MKL forced to its AVX2 path by MKL_ENABLE_INSTRUCTIONS=AVX2; the CPU itself has AVX-512",
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "busy": busy,
        "note": ("the machine was shared with other jobs during the run (load average above 1 on 2 cores): "
                 "medians of several repeats; absolute times vary by tens of percent from run to run")
        if busy else "machine quiet (load average at most 1)",
        "summary": summary(ab_rows, cost_rows),
        "probe_share_1thread_cpu": shares,
        "scalar_calls": json.loads((HERE / "scalar_calls.json").read_text())["rows"],
        "ab": ab_rows, "cost": cost_rows,
    }
    (HERE / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(ab_rows, shares, cost_rows, HERE / "results.png",
         f"{machine['cpu']} ({cpu_vector_features()}), {machine['torch_threads']} threads, torch {machine['torch']}"
         + (", machine shared with other jobs (busy)" if busy else ""))
    print(json.dumps(record["summary"], indent=1))


if __name__ == "__main__":
    main()
