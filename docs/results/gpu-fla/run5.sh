#!/bin/bash
# The fifth call (the same warm H100, 188 s of device time left after it): three cases checked with one
# configuration, again with fla's full autotuning.
set -o pipefail
out=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
t=tests/ops/test_fla_backend.py
timeout 215 python3 -m pytest -v -p no:cacheprovider -o addopts= -rfs --tb=short --durations=5 \
  "tests/ops/test_delta_cuda.py::test_fla_delta_rule_kernels_match_ours_on_cuda[True-100-None]" \
  "$t::test_fla_forward_without_gradients_matches_ours_on_cuda[100-fixed]" \
  "$t::test_fla_kernels_match_ours_on_cuda[100-gate-True-elu]" 2>&1 | tee "$out/pytest-full-autotune-2.log" \
  | grep -E "PASSED|FAILED|SKIPPED|passed|failed|s call" | cut -c1-170
echo "[$SECONDS s] done"
