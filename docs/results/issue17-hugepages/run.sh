#!/bin/bash
# The issue-17 targets again after the huge-page advice (plain process: THP_MEM_ALLOC_ENABLE=0, no
# allocator settings; the bench CLI keeps its mallopt setting). Run from the repository root.
R=docs/results/issue17-hugepages
export THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=.
PY=.venv/bin/python
$PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 4 --out $R/step-48L-128.jsonl 2>&1 | tail -4
$PY -m lintrans bench ops --T 4096 16384 --ops softmax "linear chunked" aft sliding --repeats 3 --out $R/ops 2>&1 | grep -v "it/s" | tail -25
$PY -m lintrans bench ops --T 16384 65536 --ops "linear chunked" --repeats 3 --out $R/ops-64k 2>&1 | grep -v "it/s" | tail -8
$PY docs/results/train-step-17/ab_train.py --size 12L-768 --T 16384 --rounds 2 --out $R/step-gpt2-124m.jsonl 2>&1 | tail -4
