#!/bin/bash
# One call on a lent NVIDIA GPU: the delta rule's backend="fla" through our API (op and GPTs), the delta
# GPTs' training step with either backend, and the cost of the context study's gpu profile. fla 0.6.0 and
# TileLang carried as in docs/results/gpu-tilelang/run.sh (the same .whl/site.tar.xz). Usage: bash run.sh OUT_DIR
set -o pipefail
out=${1:?out dir}; here=docs/results/gpu-delta-backend
mkdir -p /tmp/site && { tar -xJf .whl/site.tar.xz -C /tmp/site 2>/dev/null \
  || python3 -c "import tarfile; tarfile.open('.whl/site.tar.xz').extractall('/tmp/site')"; } || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/docs/results/gpu-fla PYTHONUNBUFFERED=1
echo "[$SECONDS s] unpacked"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "^Model name|^CPU\(s\)"; grep -o -m1 avx512f /proc/cpuinfo
  python3 -c "
import torch, triton, fla, tilelang
from fla.backends import TileLangBackend
print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'tilelang', tilelang.__version__)
print('fla can use TileLang:', TileLangBackend.can_use())"
} 2>&1 | tee "$out/machine.txt"
# 1. delta_rule(backend="fla") against backend="torch" (one Triton configuration per kernel: correctness only)
timeout 150 python3 -m pytest -v -p no:cacheprovider -o addopts= -rfs --tb=short -p one_config \
  tests/ops/test_delta_cuda.py -k fla_backend_matches 2>&1 | tee "$out/pytest-fla-backend.log" \
  | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | cut -c1-200
echo "[$SECONDS s] op tests done"
# 2. the GPTs: loss, gradients, decode after an fla prefill
timeout 100 python3 -c "import one_config, runpy, sys; sys.argv = ['gdn_fla.py', 'check']; runpy.run_path('$here/gdn_fla.py', run_name='__main__')" \
  2>&1 | tee "$out/gdn-fla-check.log" | tail -8
echo "[$SECONDS s] GPT check done"
# 3. what the context study's gpu profile would cost on this GPU, with our delta rule and with fla's
timeout 120 python3 -m lintrans experiment context --setting gpu --estimate --device cuda --out /tmp/ctx \
  --mechanisms softmax@rope linear:elu@none gated-linear@none gated-deltanet@none "gated-deltanet:backend=fla@none" \
  2>&1 | tee "$out/context-gpu-estimate.log" | tail -20
echo "[$SECONDS s] estimate done"
# 4. training-step speed, fla fully autotuned
left=$((480 - SECONDS)); [ $left -gt 40 ] && timeout $left python3 $here/gdn_fla.py speed 2>&1 | tee "$out/gdn-fla-speed.log"
echo "[$SECONDS s] all done"
