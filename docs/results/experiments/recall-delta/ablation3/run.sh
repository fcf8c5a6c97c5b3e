#!/bin/bash
# Gated DeltaNet's decay init (README.md): ../ablation2/abl.py, gated-deltanet with the identity conv init,
# 4000 steps, lr 1e-3; two streams at idle priority (SCHED_IDLE) beside the context study; appends to runs.jsonl
cd "$(dirname "$0")"
run() { OMP_NUM_THREADS=1 chrt -i 0 ../../../../../.venv/bin/python ../ablation2/abl.py "$@" --mechanism gated-deltanet \
        --options conv_init=identity --steps 4000 --lr 1e-3 >> runs.jsonl 2>> err.log; }
stream() { for s in $1; do for v in base no-decay decay-A1; do run $v --seed $s; done; done; }
stream "0 2" &
stream "1" &
wait
