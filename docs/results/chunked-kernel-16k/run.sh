#!/bin/bash
# The issue-17 targets after the second profiling pass (rows asked for 32 ahead, no 65-wide product
# outputs, in-chunk products split to skip the causal mask's zero quarter). Plain process:
# THP_MEM_ALLOC_ENABLE=0, no allocator settings (the bench CLI keeps its mallopt setting). Run from
# the repository root; OLD_SO is a build of the kernels before this pass (b4fe3e4), made with
# `python -m lintrans.ops.native` there. Each step is skipped when its record exists (resumable).
R=docs/results/issue17-split
export THP_MEM_ALLOC_ENABLE=0 PYTHONPATH=.
PY=${PY:-.venv/bin/python}
NEW_SO=$($PY -c "from lintrans.ops import native; print(native.build())")
step() { [ -s "$R/$1" ] || { shift; "$@"; }; }
step ab-kernels.log bash -c "CKPT_OLD=4 CKPT_NEW=4 $PY docs/results/issue17-vectorized/ab_kernels.py $OLD_SO $NEW_SO --T 4096 16384 65536 --rounds 8 > $R/ab-kernels.log.tmp 2>&1 && mv $R/ab-kernels.log.tmp $R/ab-kernels.log"
step cost-measure-op.log bash -c "$PY -m lintrans cost --n-layer 1 --n-head 8 --n-embd 512 --T 4096 16384 65536 --measure-op > $R/cost-measure-op.log.tmp 2>&1 && mv $R/cost-measure-op.log.tmp $R/cost-measure-op.log"
step ops/ops.json $PY -m lintrans bench ops --T 4096 16384 --ops softmax "linear chunked" aft sliding --repeats 3 --out $R/ops
step ops-64k/ops.json $PY -m lintrans bench ops --T 16384 65536 --ops "linear chunked" --repeats 3 --out $R/ops-64k
# three runs of the 48-layer step (one JSON line each), spread through the session
runs() { [ -s "$1" ] && wc -l < "$1" || echo 0; }
[ "$(runs $R/step-48L-128.jsonl)" -ge 1 ] || $PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 4 --out $R/step-48L-128.jsonl
step cost-measure-op-second.log bash -c "$PY -m lintrans cost --n-layer 1 --n-head 8 --n-embd 512 --T 4096 16384 65536 --measure-op > $R/cost-measure-op-second.log.tmp 2>&1 && mv $R/cost-measure-op-second.log.tmp $R/cost-measure-op-second.log"
[ "$(runs $R/step-48L-128.jsonl)" -ge 2 ] || $PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 4 --out $R/step-48L-128.jsonl
step ops-second-run/ops.json $PY -m lintrans bench ops --T 4096 16384 --ops softmax "linear chunked" aft sliding --repeats 3 --out $R/ops-second-run
[ "$(runs $R/step-48L-128.jsonl)" -ge 3 ] || $PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 4 --out $R/step-48L-128.jsonl
# added after the first pass through: the op at the 48L-128 layer's 2 heads, the step's profile, one
# layer alone, and 64k with every repeat taken (bench --repeats now overrides the time budget)
step ab-heads-2.log bash -c "CKPT_OLD=4 CKPT_NEW=4 $PY docs/results/issue17-vectorized/ab_kernels.py $OLD_SO $NEW_SO --T 16384 --H 2 --rounds 10 > $R/ab-heads-2.log 2>&1"
step profile-48L-128.log bash -c "$PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --profile --top 22 2>&1 | grep -v 'it/s\|USDT' > $R/profile-48L-128.log"
step layer-48L-128.jsonl $PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --layer --rounds 6 --out $R/layer-48L-128.jsonl
step ops-64k-repeats/ops.json $PY -m lintrans bench ops --T 16384 65536 --ops "linear chunked" --repeats 4 --out $R/ops-64k-repeats
step cost-measure-op-third.log bash -c "$PY -m lintrans cost --n-layer 1 --n-head 8 --n-embd 512 --T 4096 16384 65536 --measure-op > $R/cost-measure-op-third.log 2>&1"
step cost-measure-op-fourth.log bash -c "$PY -m lintrans cost --n-layer 1 --n-head 8 --n-embd 512 --T 4096 16384 65536 --measure-op > $R/cost-measure-op-fourth.log 2>&1"
# the 48L-128 step with the kernels' huge-page advice off and on (two repeats each, 00:45-00:50)
step step-48L-128-hugepages-off.jsonl env LINTRANS_HUGEPAGES=0 $PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 2 --out $R/step-48L-128-hugepages-off.jsonl
step step-48L-128-hugepages-on.jsonl $PY docs/results/train-step-17/ab_train.py --size 48L-128 --T 16384 --rounds 2 --out $R/step-48L-128-hugepages-on.jsonl
# page faults of one steady step of each model alone, split by where they happen (perf)
if [ ! -s $R/step-faults.log ]; then
  for s in chunked floor; do
    perf record -q -k CLOCK_MONOTONIC -e page-faults -g -o /tmp/step-faults-$s.data $PY $R/step_faults.py $s > /tmp/step-faults-$s.out 2>&1
    grep STEP /tmp/step-faults-$s.out | tee -a $R/step-faults.log.tmp
    w=$(grep STEP /tmp/step-faults-$s.out | head -1 | awk '{print $3","$4}')
    perf report -i /tmp/step-faults-$s.data --time $w --no-children --sort dso,symbol -g none 2>/dev/null | grep -E "^\s+[0-9]" | head -10 | cut -c1-160 >> $R/step-faults.log.tmp
  done
  mv $R/step-faults.log.tmp $R/step-faults.log
fi
