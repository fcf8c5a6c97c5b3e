#!/bin/bash
# second round: the short convolution (README.md), two at a time, appended to runs.jsonl
cd "$(dirname "$0")"
run() { OMP_NUM_THREADS=1 ../../../../../.venv/bin/python abl.py "$@" >> runs.jsonl 2>> err.log; }
run base --options conv_size=0 & run additive --options conv_size=0 & wait
run base --options conv_size=2 & run base --heads 1 --options conv_size=0 & wait
