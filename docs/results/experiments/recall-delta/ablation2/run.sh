#!/bin/bash
# the ablations of README.md, two at a time (one thread each), appended to runs.jsonl
cd "$(dirname "$0")"
run() { OMP_NUM_THREADS=1 ../../../../../.venv/bin/python abl.py "$@" >> runs.jsonl 2>> err.log; }
run base & run additive & wait
run no-gate & run beta-0.1 & wait
run beta-1 & run additive --heads 1 & wait
run base --heads 1 & run additive --mechanism gated-deltanet & wait
