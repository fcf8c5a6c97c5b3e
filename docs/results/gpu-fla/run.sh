#!/bin/bash
# backend="fla" and fla's delta-rule kernels against ours, on a lent NVIDIA GPU (its image's torch with
# CUDA; fla 0.6.0 carried as wheels in .whl/), in one call of under 8 minutes: most of it is Triton's
# autotuning of fla's kernels at each new key (docs/results/gpu-h200/README.md).
# Usage: bash docs/results/gpu-fla/run.sh OUT_DIR
set -o pipefail
out=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/machine.txt"
python3 -c "import torch, fla, triton, transformers as tf; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', tf.__version__)" | tee -a "$out/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/machine.txt"
pytest() { python3 -m pytest -v -p no:cacheprovider -o addopts="" -rs --tb=short --durations=6 "$@"; }
# 1. linear_attention(backend="fla") against backend="torch": 48 cases, forward then backward
timeout 300 bash -c "$(declare -f pytest); pytest -o faulthandler_timeout=280 tests/ops/test_fla_backend.py -k cuda" \
  2>&1 | tee "$out/pytest-fla-backend.log" | grep -E "passed|failed|skipped|Error|rc " | tail -8
echo "[$SECONDS s] step 1 done"
# 2. fla's chunk_delta_rule (fwd + bwd) and chunk_gated_delta_rule (fwd; its bwd refused here) against ours
timeout 170 bash -c "$(declare -f pytest); pytest -o faulthandler_timeout=160 tests/ops/test_delta_cuda.py -k fla" \
  2>&1 | tee "$out/pytest-fla-delta.log" | grep -E "passed|failed|skipped|Error" | tail -8
echo "[$SECONDS s] step 2 done"
# 3. with what time is left: backend="fla" against ours, fwd + bwd, B=1 H=8 D=64 float32 (TF32 off for ours)
left=$((470 - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout $left python3 -m lintrans bench ops --device cuda --T 256 4096 16384 65536 --time-cap 120 \
    --out /tmp/bench/ops-fla --ops "linear chunked" "chunk_simple_gla (backend='fla')" 2>&1 | tee "$out/bench-fla.log" \
    | grep -E "^(==|headline|warning)"
  tar -czf "$out/bench-ops-fla.tar.gz" -C /tmp/bench ops-fla
fi
echo "[$SECONDS s] all done"
