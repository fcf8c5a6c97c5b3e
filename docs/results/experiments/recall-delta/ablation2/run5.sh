#!/bin/bash
# fifth round (README.md): the convolution's initialisation, one at a time beside a study, appended to runs.jsonl
cd "$(dirname "$0")"
run() { OMP_NUM_THREADS=1 ../../../../../.venv/bin/python abl.py "$@" >> runs.jsonl 2>> err.log; }
for s in 0 1 2; do run conv-dirac --seed $s; done
for s in 1 2; do run base --seed $s; done
