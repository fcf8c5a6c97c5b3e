#!/bin/bash
# The second call (a fresh machine, about 6 minutes of device time left): the decayed backend="fla" cases
# that the first call's 300 s did not reach (fla autotunes again on a fresh machine), then fla's
# chunk_delta_rule in bf16 (it refused float32 in the first call). Usage: bash run2.sh OUT_DIR
set -o pipefail
out=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine2.txt"
t=tests/ops/test_fla_backend.py::test_fla_kernels_match_ours_on_cuda
ids=""; for c in 100-None-True-elu 100-fixed-True-elu 100-gate-True-elu 100-fixed-trained-True-elu \
  256-None-False-identity 256-fixed-False-identity 256-gate-False-identity 256-fixed-trained-False-identity; do ids="$ids $t[$c]"; done
timeout 220 python3 -m pytest -v -p no:cacheprovider -o addopts="" -rs --tb=short --durations=8 $ids \
  2>&1 | tee "$out/pytest-fla-backend-2.log" | grep -E "PASSED|FAILED|SKIPPED|passed|failed" | cut -c1-160
echo "[$SECONDS s] step 1 done"
left=$((300 - SECONDS))
[ "$left" -gt 30 ] && timeout $left python3 -m pytest -v -p no:cacheprovider -o addopts="" -rs --tb=short \
  --durations=4 tests/ops/test_delta_cuda.py -k "fla and None" 2>&1 | tee "$out/pytest-fla-delta-2.log" \
  | grep -E "PASSED|FAILED|SKIPPED|passed|failed|Error" | cut -c1-200
echo "[$SECONDS s] all done"
