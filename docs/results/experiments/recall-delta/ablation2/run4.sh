#!/bin/bash
# fourth round (README.md), two at a time, appended to runs.jsonl
cd "$(dirname "$0")"
run() { OMP_NUM_THREADS=1 ../../../../../.venv/bin/python abl.py "$@" >> runs.jsonl 2>> err.log; }
run base --seed 2 --options conv_size=0 & run base --seed 3 --options conv_size=0 & wait
run beta-init-0.1 --options conv_size=0 & run beta-init-0.1 --seed 1 --options conv_size=0 & wait
run additive --seed 1 --options conv_size=0 & run beta-0.1 & wait
run beta-init-0.1 --seed 2 --options conv_size=0 & run beta-init-0.1 --mechanism gated-deltanet --options conv_size=0 & wait
