"""Page faults of one steady GPT training step (48L-128, T = 16384), one model per process: two
warm-up steps, then two timed steps, each printed with its CLOCK_MONOTONIC start and end so that
`perf report --time START,END` can split the faults of that step by where they happen.

    THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=. perf record -k CLOCK_MONOTONIC -e page-faults -g -o OUT.data \
        python docs/results/issue17-split/step_faults.py chunked|floor
"""
import sys, time, resource, torch
sys.path.insert(0, "docs/results/train-step-17")
from ab_train import build
from lintrans.bench.sizes import resolve_size
series = sys.argv[1]
s = build(resolve_size("48L-128"), 16384, series, 64, False)
s(); s()
for i in range(2):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = time.monotonic(); s(); b = time.monotonic()
    print("STEP %s %.6f %.6f %.2f s faults %d" % (series, a, b, b - a, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0), flush=True)
