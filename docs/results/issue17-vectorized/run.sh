#!/bin/bash
# The issue-17 targets after the vectorized elu gradient, non-temporal output stores and the kept
# stretch chunks (plain process: THP_MEM_ALLOC_ENABLE=0, no allocator settings; the bench CLI keeps
# its mallopt setting). Run from the repository root; OLD_SO is a build of the kernels before the
# change (91adc25), made with `python -m lintrans.ops.native` there.
R=docs/results/issue17-vectorized
export THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=.
PY=${PY:-.venv/bin/python}
NEW_SO=$($PY -c "from lintrans.ops import native; print(native.build())")
CKPT_OLD=16 CKPT_NEW=4 $PY $R/ab_kernels.py $OLD_SO $NEW_SO --T 4096 16384 65536 --rounds 8 2>&1 | tee $R/ab-kernels.log
$PY -m lintrans bench ops --T 4096 16384 --ops softmax "linear chunked" aft sliding --repeats 3 --out $R/ops 2>&1 | grep -v "it/s" | tail -25
$PY -m lintrans bench ops --T 16384 65536 --ops "linear chunked" --repeats 3 --out $R/ops-64k 2>&1 | grep -v "it/s" | tail -8
$PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 4 --out $R/step-48L-128.jsonl 2>&1 | tail -4
# the share of the probe, plain process, twice (the probe itself moves with the machine's load)
$PY -m lintrans cost --n-layer 1 --n-head 8 --n-embd 512 --T 4096 16384 65536 --measure-op 2>&1 | tee $R/cost-measure-op.log | tail -4
# a second bench ops run a few minutes later: ops-second-run
