#!/bin/bash
# Gated DeltaNet's decay init (README.md): ../ablation2/abl.py, gated-deltanet with the identity conv init,
# 4000 steps, lr 1e-3; two at a time at idle priority (SCHED_IDLE); appends to runs.jsonl and skips
# (variant, seed) pairs already there, so a stopped run resumes
cd "$(dirname "$0")"
run() {  # variant seed
  grep -q "\"variant\": \"$1\".*\"seed\": $2," runs.jsonl 2>/dev/null && return
  OMP_NUM_THREADS=1 chrt -i 0 ../../../../../.venv/bin/python ../ablation2/abl.py "$1" --seed "$2" \
    --mechanism gated-deltanet --options conv_init=identity --steps 4000 --lr 1e-3 >> runs.jsonl 2>> err.log
}
export -f run
for s in 0 1 2; do for v in base no-decay decay-A1; do echo "$v $s"; done; done | xargs -P 2 -L 1 bash -c 'run "$0" "$1"'
