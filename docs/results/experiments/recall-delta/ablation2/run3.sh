#!/bin/bash
# third round, all without the short convolution (README.md), two at a time, appended to runs.jsonl
cd "$(dirname "$0")"
run() { OMP_NUM_THREADS=1 ../../../../../.venv/bin/python abl.py "$@" --options conv_size=0 >> runs.jsonl 2>> err.log; }
run no-qk-silu & run beta-0.1 & wait
run base --seed 1 & run base --lr 4e-3 & wait
run base --steps 6000 & run additive --heads 1 & wait
run no-qk-silu --heads 1 & run beta-0.1 --heads 1 & wait
