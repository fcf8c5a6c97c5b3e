#!/bin/bash
# The third call (a fresh H100, 15 minutes of device time): the decayed backend="fla" cases and fla's
# chunk_delta_rule backward that the first two calls lost to autotuning. Step 1 keeps one Triton
# configuration per kernel (one_config.py: a correctness check, no timing); step 2 reruns, with full
# autotuning, whatever step 1 failed, and then as many decayed cases as time allows, to show that the
# configuration does not change the results. Usage: bash run3.sh OUT_DIR
set -o pipefail
out=${1:?out dir}; here=docs/results/gpu-fla
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/$here || exit 1
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
} | tee "$out/machine3.txt"
py="python3 -m pytest -v -p no:cacheprovider -o addopts= -rfs --tb=short --durations=10"
sel="tests/ops/test_delta_cuda.py tests/ops/test_fla_backend.py"
timeout 330 $py -p one_config $sel -k "test_fla_ and cuda" 2>&1 | tee "$out/pytest-one-config.log" \
  | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | cut -c1-170
echo "[$SECONDS s] step 1 done"
t=tests/ops/test_fla_backend.py
failed=$(grep -E "^FAILED " "$out/pytest-one-config.log" | awk '{print $2}' | sort -u | tr '\n' ' ')
grep -q PASSED "$out/pytest-one-config.log" || failed="tests/ops/test_delta_cuda.py::test_fla_delta_rule_kernels_match_ours_on_cuda $t::test_fla_forward_without_gradients_matches_ours_on_cuda"  # the plugin broke: all again
left=$((450 - SECONDS))
if [ -n "$failed" ] && [ "$left" -gt 30 ]; then
  timeout $left $py $failed 2>&1 | tee "$out/pytest-failed-full-autotune.log" | grep -E "PASSED|FAILED|SKIPPED|passed|failed" | cut -c1-170
fi
left=$((450 - SECONDS))
[ "$left" -gt 40 ] && timeout $left $py "$t::test_fla_forward_without_gradients_matches_ours_on_cuda[100-fixed]" \
  "$t::test_fla_kernels_match_ours_on_cuda[100-gate-True-elu]" 2>&1 | tee "$out/pytest-full-autotune.log" \
  | grep -E "PASSED|FAILED|SKIPPED|passed|failed" | cut -c1-170
echo "[$SECONDS s] all done"
